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


def test_stop_hazard_copy_changes_only_the_eos_row_and_stops_completions_near_its_mean(tmp_path):
    import torch
    from safetensors.torch import load_file

    from mechdiag.generate import sample_tokens
    from mechdiag.models import encode_prompts, load_model_and_tokenizer
    from mechdiag.tasks import get_task

    tiny = {**scale.SHAPE, "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2}
    src = scale.build(tmp_path / "m", real_vocab=4096, shape=tiny)
    mean, budget = 12.0, 48
    stop = scale.with_stops(src, tmp_path / "stop", mean, probe_tokens=budget)
    a, b = load_file(src / "model.safetensors"), load_file(stop / "model.safetensors")
    model, tok = load_model_and_tokenizer(str(stop))
    eos = tok.eos_token_id
    assert a.keys() == b.keys()
    for k in a:
        differ = (a[k] != b[k]).any(dim=-1) if a[k].dim() == 2 else (a[k] != b[k])
        assert differ.nonzero().flatten().tolist() == ([eos] if k.endswith("embed_tokens.weight") else []), k
    task = get_task("arith")
    ids, mask = encode_prompts(tok, [task.prompt(e, tok) for e in task.examples("test", 8)], 96)
    _, cm, trunc = sample_tokens(model, ids, mask, max_new_tokens=budget, eos=[eos], pad=tok.pad_token_id,
                                 temperature=1.0, gen=torch.Generator().manual_seed(7), repeat=8)
    lengths = cm.sum(-1).double()
    expect = mean * (1 - (1 - 1 / mean) ** budget)  # a constant hazard's mean length under the budget
    assert 0.6 * expect < lengths.mean().item() < 1.5 * expect, (lengths.mean().item(), expect)
    assert trunc.double().mean().item() < 0.25 and lengths.min().item() < mean / 2 < 2 * mean < lengths.max().item()
