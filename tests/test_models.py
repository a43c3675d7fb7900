"""The bundled arith base and the model/tokenizer loaders."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mechdiag.errors import UserError
from mechdiag.models import (
    bundled_path,
    generate,
    load_model,
    load_model_and_tokenizer,
    load_tokenizer,
)
from mechdiag.tasks import get_task
from mechdiag.tasks.arith import TAGS, build_char_tokenizer
from mechdiag.tasks.rewards import format_ok

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def bundled():
    return load_model_and_tokenizer("bundled")


@pytest.fixture(scope="module")
def card():
    return json.loads((bundled_path() / "base_card.json").read_text())


def test_bundled_assets_present_and_small():
    names = {p.name for p in bundled_path().iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "base_card.json"} <= names
    assert not names & {"pytorch_model.bin", "chat_template.jinja"}
    assert sum(p.stat().st_size for p in bundled_path().iterdir()) < 6 * 2**20


def test_bundled_loads_offline_as_small_llama(bundled, monkeypatch):
    model, tok = bundled
    assert model.config.model_type == "llama"
    assert sum(p.numel() for p in model.parameters()) <= 5_000_000
    assert tok.chat_template is None
    assert tok.pad_token == "<pad>" and tok.padding_side == "left"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert load_tokenizer("bundled")("Q: 1").input_ids == tok("Q: 1").input_ids


def test_tokenizer_reload_gives_training_ids(tmp_path, card):
    task = get_task("arith")
    built = build_char_tokenizer()
    built.save_pretrained(tmp_path)
    texts = [task.prompt(ex) + ex.meta["gold_completion"] for ex in task.examples("test", 20)]
    texts += ["Q: odd chars ~ {}\nA: <answer>-3/4</answer>"]
    for loaded in (load_tokenizer(tmp_path), load_tokenizer("bundled")):
        for t in texts:
            assert loaded(t).input_ids == built(t).input_ids
    shipped = load_tokenizer("bundled")
    ids = shipped(texts[0]).input_ids
    assert ids[0] == shipped.bos_token_id and shipped.decode(ids, skip_special_tokens=True) == texts[0]
    for tag in TAGS:  # each tag is one token
        assert len(shipped(tag, add_special_tokens=False).input_ids) == 1


def test_greedy_emits_tag_format_and_eos(bundled):
    model, tok = bundled
    task = get_task("arith")
    exs = task.examples("test", 8)
    enc = tok([task.prompt(e, tok) for e in exs], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=64, do_sample=False, pad_token_id=tok.pad_token_id)
    comps = out[:, enc.input_ids.shape[1]:]
    texts = tok.batch_decode(comps, skip_special_tokens=True)
    assert sum(format_ok(t) for t in texts) >= 6, texts
    ended = [(row == tok.eos_token_id).any().item() for row in comps]
    assert sum(ended) >= 6  # EOS follows </answer>
    for row, t in zip(comps, texts, strict=True):
        if format_ok(t):
            toks = tok.convert_ids_to_tokens(row.tolist())
            i = toks.index("</answer>")
            assert toks[i + 1] == tok.eos_token


def test_card_accuracy_in_band_and_reproduced(bundled, card):
    model, tok = bundled
    task = get_task("arith")
    test = task.examples("test", 500)
    assert 0.2 <= card["heldout_greedy_accuracy"] <= 0.6
    assert card["pass@8_t1"] > card["heldout_greedy_accuracy"]
    comps = generate(model, tok, [task.prompt(e, tok) for e in test], max_new_tokens=64, batch_size=250)
    acc = sum(task.correct(c, e) for c, e in zip(comps, test, strict=True)) / len(test)
    assert abs(acc - card["heldout_greedy_accuracy"]) <= 0.01, (acc, card["heldout_greedy_accuracy"])


def test_missing_and_pickle_and_corrupt_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_model(tmp_path / "nope")
    folder = tmp_path / "m"
    shutil.copytree(bundled_path(), folder)
    (folder / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, folder / "pytorch_model.bin")
    with pytest.raises(UserError, match="pickle.*convert"):
        load_model(folder)
    (folder / "pytorch_model.bin").unlink()
    with pytest.raises(UserError, match="no model.safetensors"):
        load_model(folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="cannot load model"):
        load_model(folder)
    (folder / "tokenizer.json").write_text("{broken")
    with pytest.raises(UserError, match="cannot load tokenizer"):
        load_tokenizer(folder)
    (folder / "config.json").unlink()
    with pytest.raises(UserError, match="no config.json"):
        load_model(folder)


def test_pad_token_set_when_missing(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("pad_token")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token == loaded.eos_token == "</s>"
    assert loaded.padding_side == "left"


def long_word_tokenizer():
    """Whole words as tokens, 20 characters each: a prompt's last ids span more text than a fixed guess."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "supercalifragilistic", "tiny", "Q?", "1", "+", "="]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>")


@pytest.mark.parametrize("form", ["bundled", "stories260k", "long-words"])
def test_tail_ids_are_the_full_encodings_last_ids(form, stories260k):
    """Over-long prompts keep their last max_prompt_tokens ids without encoding the whole text: the same ids as
    encoding all of it, whatever the text's make-up (digits and operators, no spaces at all, multi-byte
    characters a byte-fallback tokenizer splits, runs of newlines)."""
    from mechdiag.models import encode_prompts, tail_ids

    tok = long_word_tokenizer() if form == "long-words" else load_tokenizer(
        "bundled" if form == "bundled" else stories260k)
    texts = ["supercalifragilistic " * 2000 + "Q?", "tiny " * 900 + "supercalifragilistic " * 300,
             "1 + " * 3000 + "1 =", "abcd" * 4000, "é🙂 ü" * 2000 + " end", "line\n\n" * 3000 + "last",
             "Q: what is 3 + 4?", "x" * 40 + " y" * 2]
    for text in texts:
        full = tok(text)["input_ids"]
        for n in (1, 7, 64, 3000):
            assert tail_ids(tok, text, n) == full[-n:], (text[:20], n)
    ids, mask = encode_prompts(tok, texts, 64)
    assert ids.shape == (len(texts), 64)
    for row, m, text in zip(ids, mask, texts, strict=True):
        assert row[m.bool()].tolist() == tok(text)["input_ids"][-64:]
