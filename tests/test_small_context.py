"""Issue 26, small-context models: a model whose context (max_position_embeddings, GPT-2's n_positions, MPT's
max_seq_len) is shorter than max_prompt_tokens + the completion budget. Past a learned position table decoding
crashes (GPT-2: an IndexError), past a rotary one it is silent extrapolation; so `mechdiag train` (native) and
`mechdiag eval` fit the prompt budget to the context (prompts keep their last tokens) with one note on stderr, and a
completion budget the context cannot hold at all is one line and exit 2 before any model loads, as is TRL (which
does not cut prompts) when the training prompts do not fit. The completions are the model's own greedy tokens on
the prompts' last tokens (a plain argmax loop, no cache)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from mechdiag import config as C
from mechdiag.models import context_length, load_tokenizer
from mechdiag.run import RunDir
from tests import family_cells as cells
from tests.tiny_models import MATRIX, UNNAMED, family_config, family_folder
from tests.toy import Toy

torch.set_num_threads(1)
CONTEXT, NEW = 44, 6  # the toy prompts are 41-42 tokens: with 6 new tokens they pass a context of 44
FIT = CONTEXT - NEW


def _one(err: str, kind: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith(f"mechdiag: {kind}: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


@pytest.mark.parametrize("family", [f for f in (*MATRIX, *UNNAMED) if f not in ("bloom", "mamba", "recurrent_gemma")])
def test_context_length_reads_each_familys_own_key(family):
    """Every family's context under its own key (n_positions, max_seq_len...): the limit the fit holds to."""
    assert context_length(family_config(family, positions=40)) == 40


@pytest.mark.parametrize("family", ["bloom", "mamba", "recurrent_gemma"])
def test_no_context_where_the_family_has_none(family):
    assert context_length(family_config(family)) is None  # ALiBi / recurrent state: no position table to pass


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A GPT-2 (learned positions) with a context of 44, trained natively 2 steps with max_prompt_tokens=64."""
    tmp = tmp_path_factory.mktemp("small")
    folder = family_folder("gpt2", tmp / "model", positions=CONTEXT)
    assert context_length(AutoModelForCausalLM.from_pretrained(folder).config) == CONTEXT
    code, _, err = cells.train(folder, tmp / "native")
    assert code == 0, err[-3000:]
    return folder, tmp / "native", err, tmp


def _own_greedy(model, ids: list[int], n: int, eos: int) -> list[int]:
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(nxt)
            if nxt == eos:
                break
    return out


def test_train_fits_the_prompt_budget_with_one_note(small):
    folder, run, err, _ = small
    line = _one(err, "note")
    assert f"prompts keep their last {FIT} tokens" in line and f"context is {CONTEXT} positions" in line
    cfg = C.load(RunDir(run).config_path)
    assert cfg.max_prompt_tokens == FIT and cfg.max_completion_tokens == NEW  # config.yaml: the budget that ran
    assert RunDir(run).summary()["steps"] == 2


def test_eval_decodes_the_prompts_last_tokens_and_reproduces_the_run(small):
    """`mechdiag eval` (default prompt budget: what fits) gives the run's own accuracies, and its greedy completions
    are the model's argmax tokens after each prompt's last 38 tokens."""
    folder, run, _, tmp = small
    cells.check_eval(folder, run, tmp)
    tok = load_tokenizer(str(folder))
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    rows = [json.loads(ln) for ln in (tmp / "eval" / "eval_samples.jsonl").read_text().splitlines()]
    base = {r["example_id"]: r for r in rows if r["model"] == "base" and r["sample"] == -1}
    examples = Toy().examples("test", 3)
    assert set(base) == {ex.id for ex in examples}
    for ex in examples:
        ids = tok(Toy().prompt(ex, tok))["input_ids"]
        assert len(ids) > FIT  # the cut is real
        want = _own_greedy(model, ids[-FIT:], NEW, tok.eos_token_id)
        assert base[ex.id]["completion"] == tok.decode(want, skip_special_tokens=True), ex.id
        assert base[ex.id]["length"] == len(want)


def test_eval_cuts_a_prompt_budget_that_does_not_fit_with_one_note(small):
    folder, run, _, tmp = small
    code, out, err = cells.cli("eval", folder, "--task", "tests.toy:Toy", "--n", 3, "--k", 1, "--max-new-tokens", NEW,
                               "--max-prompt-tokens", 60, "--format", "json", "--out", tmp / "eval60")
    assert code == 0, err
    assert "--max-prompt-tokens=60 does not fit" in _one(err, "note")
    acc = {r["model"]: r["value"] for r in json.loads(out) if r["metric"] == "accuracy"}
    assert acc["base"] == pytest.approx(RunDir(run).summary()["base_accuracy"])  # the same 38-token prompts


@pytest.mark.parametrize("command", ["train", "forget", "eval"])
def test_a_completion_budget_past_the_context_is_one_line_before_any_load(small, command):
    folder, _, _, tmp = small
    out = tmp / f"refused-{command}"
    if command == "train":
        code, _, err = cells.train(folder, out, "native", f"max_completion_tokens={CONTEXT}")
        name = "max_completion_tokens"
    elif command == "forget":  # the forget probe's greedy continuations
        code, _, err = cells.train(folder, out, "native", "record.forget_prompts=tests.toy:Toy",
                                   f"record.forget_tokens={CONTEXT}")
        name = "record.forget_tokens"
    else:  # eval's default --max-new-tokens is 256
        code, _, err = cells.cli("eval", folder, "--task", "tests.toy:Toy", "--n", 3, "--out", out)
        name = "--max-new-tokens"
    assert code == 2
    line = _one(err, "error")
    assert f"{name}=" in line and f"context of {CONTEXT} positions" in line
    assert not out.exists()  # refused before the run directory (and the model) came


def test_trl_refuses_prompts_that_do_not_fit_in_one_line(small):
    folder, _, _, tmp = small
    code, _, err = cells.train(folder, tmp / "trl", "trl")
    assert code == 2
    line = _one(err, "error")
    assert "--backend trl" in line and f"context of {CONTEXT} positions" in line
    assert "mechdiag: note:" not in err and not (tmp / "trl").exists()
