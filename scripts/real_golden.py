"""Make the golden greedy outputs of the named real models (mechdiag/assets/real-models.json).

Each named model's GGUF (from its installed package) is converted without a golden check, then its first N greedy
tokens after a fixed chat-templated question are stored with the file's sha256. Every later conversion (on any
machine) must reproduce them (realmodels.check_golden). Run once per model, after installing its package:

    python scripts/real_golden.py smollm2-135m-instruct gemma3-270m
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from mechdiag import realmodels as R  # noqa: E402

PROMPT = "What is 2+3?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="+", choices=sorted(R.REAL_MODELS))
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    golden = json.loads(R.GOLDEN.read_text()) if R.GOLDEN.exists() else {}
    for name in args.names:
        gguf = R.gguf_of(name)
        with tempfile.TemporaryDirectory() as d:
            target = Path(d) / "model"
            R.convert(gguf, target)
            model = AutoModelForCausalLM.from_pretrained(str(target)).eval()
            tok = AutoTokenizer.from_pretrained(str(target))
            tokens = R.greedy_tokens(model, tok, PROMPT, args.tokens)
        golden[name] = {"sha256": R.sha256(gguf), "prompt": PROMPT, "tokens": tokens, "text": tok.decode(tokens),
                        "licence": R.REAL_MODELS[name].licence}
        print(name, repr(golden[name]["text"]))
    R.GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")


if __name__ == "__main__":
    main()
