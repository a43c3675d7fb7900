"""bench/scale.py's real-vocabulary case builder, at a tiny layer shape (the real shapes are for the benchmark)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoConfig

from mechdiag.models import load_tokenizer

_spec = importlib.util.spec_from_file_location("scale", Path(__file__).parent.parent / "bench" / "scale.py")
scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale)


def test_real_vocab_build_has_qwens_vocabulary_and_keeps_the_bundled_ids(tmp_path):
    tiny = {**scale.SHAPE, "num_hidden_layers": 1, "hidden_size": 8, "intermediate_size": 16,
            "num_attention_heads": 2, "num_key_value_heads": 1}
    folder = scale.build(tmp_path / "m", real_vocab=True, shape=tiny)
    tok, cfg = load_tokenizer(folder), AutoConfig.from_pretrained(folder)
    assert len(tok) == cfg.vocab_size == 151_936 and cfg.tie_word_embeddings
    text = "the cat sat on the mat"
    built = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert built.encode(text).ids == load_tokenizer("bundled")(text)["input_ids"]
    assert built.get_vocab_size() == 151_936 and built.token_to_id("w0") is not None
