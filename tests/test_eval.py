"""`mechdiag eval`: the estimators against closed forms, the scoring path on every real benchmark file, the
comparison table, adapters sharing one base, determinism, streaming to the samples file, and bad input."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mechdiag import eval_table, sandbox
from mechdiag import evaluate as E
from mechdiag.atomic import read_jsonl
from mechdiag.compare import verdict
from mechdiag.errors import UserError
from mechdiag.generate import Sample
from mechdiag.metrics import change
from mechdiag.report.html import _delta_class
from mechdiag.tasks import REGISTRY, get_task
from tests.helpers import assert_bad_input
from tests.sandbox_conditions import guard_only_python, without_landlock

torch.set_num_threads(1)


# ---- estimators ----------------------------------------------------------------------------------------------
def closed_form(n, c, k):
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def by_enumeration(n, c, k):
    """Share of the k-subsets of n samples (c of them correct) holding at least one correct sample."""
    subs = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subs) / len(subs)


@pytest.mark.parametrize("n,c,k", [(1, 0, 1), (1, 1, 1), (5, 0, 1), (5, 0, 5), (5, 1, 1), (5, 1, 3), (5, 2, 3),
                                   (5, 4, 5), (5, 5, 5), (10, 3, 1), (10, 3, 5), (10, 7, 4), (20, 1, 10)])
def test_pass_at_k_matches_closed_form_and_enumeration(n, c, k):
    got = E.pass_at_k(n, c, k)
    assert got == pytest.approx(closed_form(n, c, k), abs=1e-12)
    assert got == pytest.approx(by_enumeration(n, c, k), abs=1e-12)
    if k == 1:
        assert got == pytest.approx(c / n)


def test_pass_at_k_large_n_and_bounds():
    # binomials of this size overflow a float; the product form stays exact
    assert E.pass_at_k(2000, 10, 200) == pytest.approx(closed_form(2000, 10, 200), rel=1e-9)
    for n, c, k in [(3, 0, 4), (3, 4, 1), (3, 1, 0)]:
        with pytest.raises(ValueError):
            E.pass_at_k(n, c, k)


def test_maj_at_k_crafted_cases():
    a, b = "a", "b"
    # [a, a, b] with a correct: k=1 is the share correct; k=2 ties {a, b} half the time; k=3 a wins
    assert E.maj_at_k([a, a, b], [True, True, False], 1) == pytest.approx(2 / 3)
    assert E.maj_at_k([a, a, b], [True, True, False], 2) == pytest.approx((1 + 0.5 + 0.5) / 3)
    assert E.maj_at_k([a, a, b], [True, True, False], 3) == 1.0
    # the wrong answer is the plurality: majority voting loses what pass@k would find
    assert E.maj_at_k([b, b, a], [False, False, True], 3) == 0.0
    # no answer: no vote; all abstain -> wrong
    assert E.maj_at_k([None, None, a], [False, False, True], 3) == 1.0
    assert E.maj_at_k([None, None], [False, False], 2) == 0.0
    # a brute-force plurality vote over every subset, uniform tie-break
    rng = random.Random(1)
    for _ in range(30):
        n = rng.randint(2, 7)
        keys = [rng.choice(["x", "y", "z", None]) for _ in range(n)]
        good = rng.choice(["x", "y", "z"])
        ok = [k == good for k in keys]
        k = rng.randint(1, n)
        want = []
        for sub in itertools.combinations(range(n), k):
            votes = {}
            for i in sub:
                if keys[i] is not None:
                    votes[keys[i]] = votes.get(keys[i], 0) + 1
            top = max(votes.values(), default=0)
            win = [x for x, v in votes.items() if v == top]
            want.append(sum(x == good for x in win) / len(win) if win else 0.0)
        assert E.maj_at_k(keys, ok, k) == pytest.approx(sum(want) / len(want))


def test_maj_at_k_sampled_subsets_approximate_the_exact_value():
    rng = random.Random(0)
    keys = [rng.choice("abc") for _ in range(14)]
    ok = [k == "a" for k in keys]
    exact = E.maj_at_k(keys, ok, 7, max_subsets=10**6)  # C(14, 7) = 3432 subsets, enumerated
    approx = E.maj_at_k(keys, ok, 7, max_subsets=2000)
    assert abs(exact - approx) < 0.05 and approx == E.maj_at_k(keys, ok, 7, max_subsets=2000)


# ---- the scoring path on every real benchmark file -----------------------------------------------------------
FILE_TASKS = [n for n in REGISTRY if n not in ("jsonl", "arith")]
ARITH = [("arith", s) for s in ("test", "ood_steps", "ood_numbers")]


def _score(task, examples, texts_greedy, texts_sampled, ks=(1, 2, 3)):
    mk = lambda t: Sample(text=t, token_ids=[], truncated=False, length=len(t))  # noqa: E731
    tally = E.Tally(list(ks), len(texts_sampled[0]), votable=task.domain != "code")
    recs = E.score_problems(task, examples, [mk(t) for t in texts_greedy], [[mk(t) for t in row] for row in
                                                                          texts_sampled], tally, {"correctness": 1})
    return tally.metrics(), recs


@pytest.mark.parametrize("name,split", [(n, None) for n in FILE_TASKS] + ARITH)
def test_eval_scoring_gold_full_shuffled_zero(data_dir, name, split):
    """Through the eval path (greedy + samples, pass@k, maj@k): gold answers score 1, another problem's 0."""
    task = get_task(name)
    split = split or ("test" if "test" in task.splits else task.splits[0])
    exs = task.examples(split, n=4 if task.domain == "code" else 25)
    gold = [e.meta["gold_completion"] for e in exs]
    m, recs = _score(task, exs, gold, [[g] * 3 for g in gold])
    assert m["accuracy"] == 1.0 and m["pass@1"] == m["pass@3"] == 1.0 and m["format_rate"] == 1.0, (name, m)
    assert m["eval_reward"] == 1.0 and m["truncation_rate"] == 0.0
    if task.domain != "code":
        assert m["maj@3"] == 1.0 and all(r["answer"] is not None for r in recs)
    else:
        assert "maj@3" not in m
    key = lambda e: task.answer_key(e.meta["gold_completion"], e) or e.answer  # noqa: E731  ('x=5' is '5')
    pairs = [(e, o) for e, o in zip(exs, exs[1:] + exs[:1], strict=True) if key(o) != key(e)]
    assert len(pairs) >= len(exs) // 2  # GSM-Plus perturbations of one problem often share the answer
    wrong = [o.meta["gold_completion"] for _, o in pairs]
    m, _ = _score(task, [e for e, _ in pairs], wrong, [[w] * 3 for w in wrong])
    assert m["accuracy"] == 0.0 and m["pass@3"] == 0.0 and m.get("maj@3", 0.0) == 0.0, (name, m)
    assert m["format_rate"] == 1.0  # well formed, just wrong


def test_one_right_sample_among_wrong_ones(data_dir):
    task = get_task("gsm8k")
    exs = task.examples("test", n=3)
    other = exs[1].meta["gold_completion"]
    rows = [[exs[0].meta["gold_completion"], other, other]] + [[e.meta["gold_completion"]] * 3 for e in exs[1:]]
    m, recs = _score(task, exs, [other] * 3, rows)
    assert m["accuracy"] == pytest.approx(1 / 3)  # greedy: only problem 1 matches `other`
    assert m["pass@1"] == pytest.approx((1 / 3 + 1 + 1) / 3)
    assert m["pass@3"] == 1.0
    assert m["maj@3"] == pytest.approx(2 / 3)  # problem 0: two votes for the wrong answer
    greedy0 = next(r for r in recs if r["example_id"] == exs[0].id and r["sample"] == -1)
    assert greedy0["pass@3"] == 1.0 and greedy0["maj@3"] == 0.0


# ---- comparison table ----------------------------------------------------------------------------------------
def _rows(values: dict[str, dict[str, float]], bench="b/test", n=10):
    return [{"benchmark": bench, "metric": m, "model": model, "value": v, "n": n}
            for model, mv in values.items() for m, v in mv.items()]


def test_compare_groups_seeds_and_marks_changes():
    tuned = [E.Tuned("grpo@42", "grpo", None, "peft"), E.Tuned("grpo@3407", "grpo", None, "peft"),
             E.Tuned("lowkl", "lowkl", None, "peft")]
    per = _rows({"base": {"pass@1": 0.5, "pass@3": 0.7, "truncation_rate": 0.2, "completion_length": 20},
                 "grpo@42": {"pass@1": 0.6, "pass@3": 0.6, "truncation_rate": 0.1, "completion_length": 30},
                 "grpo@3407": {"pass@1": 0.7, "pass@3": 0.6, "truncation_rate": 0.3, "completion_length": 10},
                 "lowkl": {"pass@1": 0.5, "pass@3": 0.8, "truncation_rate": 0.1, "completion_length": 20}})
    rows = E.compare(per, tuned)
    cell = {(r["model"], r["metric"]): r for r in rows}
    g = cell[("grpo", "pass@1")]
    assert g["value"] == pytest.approx(0.65) and g["std"] == pytest.approx(math.sqrt(0.005)) and g["seeds"] == 2
    assert g["delta"] == pytest.approx(0.15) and g["status"] == "improve" and g["members"] == "grpo@42,grpo@3407"
    assert cell[("grpo", "pass@3")]["status"] == "regress"
    assert cell[("grpo", "truncation_rate")]["status"] == "same"  # mean 0.2 = base
    assert cell[("lowkl", "truncation_rate")]["status"] == "improve"  # lower is better
    assert cell[("lowkl", "pass@1")]["status"] == "same" and cell[("lowkl", "pass@1")]["std"] is None
    assert cell[("grpo", "completion_length")]["status"] is None  # neither direction
    assert cell[("base", "pass@1")]["delta"] is None and cell[("base", "pass@1")]["seeds"] == 1
    summ = {s["model"]: s for s in eval_table.summary(rows)}  # counts score metrics only (pass@k here)
    assert (summ["grpo"]["improve"], summ["grpo"]["regress"], summ["grpo"]["total"]) == (1, 1, 2)
    assert (summ["lowkl"]["improve"], summ["lowkl"]["same"], summ["lowkl"]["total"]) == (1, 1, 2)
    text = eval_table.render_table(rows, width=100)
    assert "grpo (x2)" in text and "0.650 ± 0.071 ▲+0.150" in text and "▼-0.100" in text
    assert "grpo: 1 of 2 benchmark-metric configurations improve on the base (1 regress, 0 equal)" in text
    assert "\x1b[" not in text and "\x1b[32m" in eval_table.render_table(rows, color=True)
    narrow = eval_table.render_table(rows, width=60)  # the base column goes before a tuned one's Δ
    assert max(len(x) for x in narrow.splitlines()[:-2]) <= 60 and "▲+0.150" in narrow


def test_one_verdict_for_compare_eval_and_the_report():
    """metrics.change is the one improved / regressed rule: mechdiag eval's status, compare's verdict (one seed)
    and the report's cell colour agree on every case, float noise included."""
    cases = [("pass@1", 0.1, 0.5, 1), ("pass@1", -0.1, 0.5, -1), ("truncation_rate", -0.1, 0.2, 1),
             ("loss", 0.3, 2.0, -1), ("accuracy", 0.2 - 0.1 - 0.1, 0.3, 0), ("accuracy", 3e-10, 0.5, 0),
             ("accuracy", 2e-9, 0.5, 1), ("eval_reward", 5e-9, 10.0, 0), ("completion_length", 5.0, 20.0, None),
             ("entropy", -0.5, 1.0, None), ("accuracy", math.nan, 0.5, None)]
    for metric, delta, base, want in cases:
        assert change(metric, delta, base) == want, (metric, delta)
        rows = E.compare(_rows({"base": {metric: base}, "t": {metric: base + delta}}),
                         [E.Tuned("t", "t", None, "peft")])
        assert [r["status"] for r in rows if r["model"] == "t"] == [E.STATUS.get(want)], (metric, delta)
        assert verdict(metric, delta, base, 0.0, 0.0, 1, 1) == \
            {1: "helped (1 seed)", -1: "hurt (1 seed)", 0: "no change (1 seed)", None: "not judged"}[want]
        assert _delta_class(metric, delta, base) == {1: "up", -1: "down"}.get(want, "")
    # with seeds on both sides the band is the sum of their stds
    assert verdict("accuracy", 0.05, 0.5, 0.03, 0.03, 2, 2) == "within seed noise"
    assert verdict("accuracy", -0.07, 0.5, 0.03, 0.03, 2, 2) == "hurt"


def test_parse_tasks_and_adapters(tmp_path):
    assert E.parse_tasks(["gsm8k,arith/ood_steps", "arith"], ["test,ood_numbers"]) == [
        ("gsm8k", "test"), ("gsm8k", "ood_numbers"), ("arith", "ood_steps"), ("arith", "test"),
        ("arith", "ood_numbers")]
    assert E.parse_tasks(["mbpp"]) == [("mbpp", None)]
    run = tmp_path / "seed42"
    (run / "final").mkdir(parents=True)
    (run / "final" / "adapter_config.json").write_text("{}")
    ad = tmp_path / "plain"
    ad.mkdir()
    (ad / "adapter_config.json").write_text("{}")
    t = E.parse_adapters([str(run), f"x@1={ad}"])
    assert [(a.label, a.group, a.path.name) for a in t] == [("seed42", "seed42", "final"), ("x@1", "x", "plain")]
    t = E.parse_adapters([str(run), str(ad)], group="default")
    assert {a.group for a in t} == {"default"}
    for bad, match in [([str(ad), str(ad)], "given twice"), ([f"base={ad}"], "base"),
                       ([str(tmp_path / "none")], "no such folder"), ([str(tmp_path)], "not a PEFT adapter")]:
        with pytest.raises(UserError, match=match):
            E.parse_adapters(bad)


# ---- end to end on a real tiny model -------------------------------------------------------------------------
def make_adapter(model_dir, out, seed: int):
    """A LoRA adapter with random (non-zero) factors: a 'tuned' model that really differs from the base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    get_peft_model(model, cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(stories260k, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return [make_adapter(stories260k, root / f"r{s}", s) for s in (1, 2)]


SMALL = E.Settings(ks=[1, 2], samples=3, max_new_tokens=12, batch_size=8, n=3)


def _run(model, tuned, out, settings=SMALL, tasks=("arith/test", "arith/ood_steps")):
    benches = E.load_benchmarks(E.parse_tasks(list(tasks)), settings.n)
    return E.run_eval(str(model), tuned, benches, E.Settings(**vars(settings)), out)


def test_adapters_share_the_base_and_match_solo_runs(stories260k, adapters, tmp_path):
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(stories260k).pad_token is None  # the no-pad-token case, handled
    both = _run(stories260k, E.parse_adapters([f"r@1={adapters[0]}", f"r@2={adapters[1]}"]), tmp_path / "both")
    solo = _run(stories260k, E.parse_adapters([f"r@2={adapters[1]}"]), tmp_path / "solo")
    alone = _run(stories260k, [], tmp_path / "alone")
    val = lambda res, model: {(r["benchmark"], r["metric"]): r["value"]  # noqa: E731
                              for r in res.per_model if r["model"] == model}
    texts = lambda res, model: [r["completion"] for r in read_jsonl(res.samples_path)  # noqa: E731
                                if r["model"] == model]
    assert texts(both, "r@2") == texts(solo, "r@2")  # set_adapter switches cleanly
    assert texts(both, "base") == texts(alone, "base")  # disable_adapter gives the plain base
    assert val(both, "r@2") == pytest.approx(val(solo, "r@2"), rel=1e-6)
    assert val(both, "base") == pytest.approx(val(alone, "base"), rel=1e-6)
    assert val(both, "r@1") != val(both, "base") != val(both, "r@2")  # the adapters do change the model
    # samples file: every completion, greedy (-1) and sampled, per benchmark x model x problem
    recs = read_jsonl(both.samples_path)
    assert len(recs) == 2 * 3 * 3 * (1 + 3)
    assert {r["model"] for r in recs} == {"base", "r@1", "r@2"} and all(r["split"] == "eval" for r in recs)
    assert all("prompt" in r for r in recs if r["sample"] == -1)
    # determinism: the same seed gives the same completions; another seed other samples, same greedy ones
    again = _run(stories260k, E.parse_adapters([f"r@1={adapters[0]}", f"r@2={adapters[1]}"]), tmp_path / "again")
    assert read_jsonl(again.samples_path) == recs
    other = _run(stories260k, [], tmp_path / "seed1", E.Settings(**{**vars(SMALL), "seed": 1}))
    o = read_jsonl(other.samples_path)
    base = [r for r in recs if r["model"] == "base"]
    assert [r["completion"] for r in o if r["sample"] == -1] == [r["completion"] for r in base if r["sample"] == -1]
    assert [r["completion"] for r in o if r["sample"] >= 0] != [r["completion"] for r in base if r["sample"] >= 0]
    # the run directory: grouped rows (r@1 and r@2 -> r) with std over the two
    rows = read_jsonl(both.out_dir / "eval_benchmarks.jsonl")
    assert {r["model"] for r in rows} == {"base", "r"}
    r = next(r for r in rows if r["model"] == "r" and r["metric"] == "pass@1" and r["benchmark"] == "arith/test")
    vals = [x["value"] for x in both.per_model if x["metric"] == "pass@1" and x["benchmark"] == "arith/test"
            and x["group"] == "r"]
    assert r["value"] == pytest.approx(sum(vals) / 2) and r["seeds"] == 2 and r["n"] == 3
    assert set(r) >= {"benchmark", "metric", "model", "value", "std", "n", "step"}
    shown = read_jsonl(both.out_dir / "samples.jsonl")  # the report's base-vs-tuned pairs
    assert len(shown) == 2 * 3 * 3 and all(s["split"] == "eval" and s["prompt"] for s in shown)


def test_rerun_replaces_only_its_benchmarks(stories260k, tmp_path):
    out = tmp_path / "run"
    _run(stories260k, [], out, tasks=("arith/test",))
    _run(stories260k, [], out, tasks=("arith/ood_numbers",))
    _run(stories260k, [], out, tasks=("arith/test",))
    rows = read_jsonl(out / "eval_benchmarks.jsonl")
    assert sorted({r["benchmark"] for r in rows}) == ["arith/ood_numbers", "arith/test"]
    assert len([r for r in rows if r["metric"] == "accuracy"]) == 2
    assert len(read_jsonl(out / "eval_samples.jsonl")) == 2 * 3 * 4
    assert len(read_jsonl(out / "samples.jsonl")) == 2 * 3
    assert not list(out.glob(".*partial"))


def test_streams_chunk_by_chunk_and_full_models(stories260k, tmp_path):
    """Completions leave in chunks of batch_size // samples problems; a full model folder is a tuned column too."""
    from mechdiag.models import load_model_and_tokenizer as load_model

    model, tok = load_model(str(stories260k))
    bench = E.load_benchmarks([("arith", "ood_numbers")], 6)[0]
    calls = []
    s = E.Settings(ks=[1, 3], samples=3, max_new_tokens=6, batch_size=6).check()
    m = E.evaluate_model(model, tok, bench, s, write=calls.append)
    assert [len(c) for c in calls] == [2 * (1 + 3)] * 3  # 2 problems per chunk, greedy + 3 samples each
    assert m["truncation_rate"] == 1.0 and m["completion_length"] == 6.0  # stories260K never writes an EOS here
    res = _run(stories260k, [E.Tuned("copy", "copy", stories260k, "full")], tmp_path / "full",
               tasks=("arith/ood_numbers",))
    recs = read_jsonl(res.samples_path)
    assert [r["completion"] for r in recs if r["model"] == "copy"] == [r["completion"] for r in recs
                                                                       if r["model"] == "base"]
    assert all(r["status"] in ("same", None) for r in res.rows if r["model"] == "copy")


def test_cli_json_and_bad_input(stories260k, adapters, tmp_path, cli):
    from click.testing import CliRunner

    from mechdiag.cli import main

    out = tmp_path / "cli"
    args = ["eval", str(stories260k), "--adapter", f"a@1={adapters[0]}", "--adapter", f"a@2={adapters[1]}",
            "--task", "arith", "--split", "ood_steps", "--n", "2", "--k", "1,2", "--samples", "2",
            "--max-new-tokens", "8", "--out", str(out), "--format", "json"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, (res.stderr, res.exception)
    rows = json.loads(res.stdout)
    assert {r["model"] for r in rows} == {"base", "a"} and {r["benchmark"] for r in rows} == {"arith/ood_steps"}
    assert {"accuracy", "pass@1", "pass@2", "maj@2", "format_rate", "truncation_rate"} <= {r["metric"] for r in rows}
    assert rows == read_jsonl(out / "eval_benchmarks.jsonl")
    assert {r["sandbox"] for r in rows} == {"none"}  # no model code ran
    res = CliRunner().invoke(main, [*args[:-1], "csv"])
    assert res.exit_code == 0 and res.stdout.splitlines()[0].startswith("step,benchmark,metric,model,value,std,n")
    assert len(res.stdout.splitlines()) == len(rows) + 1
    # bad input: one line, exit 2, nothing written (one as a user runs it, the rest in-process for speed)
    assert_bad_input(cli("eval", str(stories260k), "--task", "gsm9k", "--out", str(tmp_path / "bad")))
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"prompt": "2+2?", "solution": "4"}) + "\n")
    for extra, words in [(["--task", "gsm9k"], "unknown task 'gsm9k'"),
                         (["--task", "arith", "--k", "1,5", "--samples", "3"], "larger than --samples"),
                         (["--task", "gsm8k", "--path", str(wrong)], "not the gsm8k schema"),
                         (["--task", "arith", "--adapter", str(tmp_path)], "not a PEFT adapter"),
                         (["--task", "arith", "--k", "1,x"], "comma-separated integers"),
                         (["--task", "arith/nope"], "arith has splits"),
                         (["--task", "arith", "--device", "nonsense"], "--device nonsense: use auto, cpu, cuda"),
                         (["--task", "arith", "--adapter", str(adapters[0]), "--model", "bundled"],
                          "cannot load it onto bundled")]:
        model = extra[extra.index("--model") + 1] if "--model" in extra else str(stories260k)
        extra = extra[:extra.index("--model")] if "--model" in extra else extra
        res = CliRunner().invoke(main, ["eval", model, *extra, "--out", str(tmp_path / "bad")])
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and words in lines[0], (extra, res.stderr, res.exception)
    assert not (tmp_path / "bad").exists()


def test_end_to_end_bundled_base_vs_trained_adapter(tmp_path, cli):
    """Train a LoRA adapter on the bundled base for a few steps, then `mechdiag eval` it on the arith OOD splits."""
    from safetensors.torch import load_file

    from mechdiag import config as C
    from mechdiag.train.trainer import train

    cfg = C.load(None, ["max_steps=3", "group_size=4", "prompts_per_step=4", "eval_n=4", "threads=1",
                        "lr_schedule=constant", "warmup_ratio=0", "record.displacement_every=0",
                        "record.shift_at_eval=false", "save_every=0"])
    run = train(cfg, tmp_path / "run")
    lora_b = [v for k, v in load_file(run.final / "adapter_model.safetensors").items() if "lora_B" in k]
    assert any(float(v.abs().max()) > 0 for v in lora_b)  # the adapter moved
    proc = cli("eval", "bundled", "--adapter", str(run.path), "--task", "arith/test,arith/ood_steps,arith/ood_numbers",
               "--n", "6", "--k", "1,3", "--samples", "3", "--max-new-tokens", "48", "--threads", "1",
               "--out", str(run.path))
    assert proc.returncode == 0, proc.stderr
    head = next(x for x in proc.stdout.splitlines() if "benchmark" in x).strip("┃ ").split()
    assert [h for h in head if h != "┃"] == ["benchmark", "metric", "base", "run"], proc.stdout
    assert max(len(x) for x in proc.stdout.splitlines()[:-1]) <= 100  # fits a 100-column pipe (console)
    # 3 benchmarks x (accuracy, pass@1, pass@3, maj@3) configurations are counted
    assert re.search(r"^run: \d+ of 12 benchmark-metric configurations improve", proc.stdout, re.M), proc.stdout
    rows = run.read("eval_benchmarks")  # in the training run's directory, where the report reads it
    assert {r["benchmark"] for r in rows} == {"arith/test", "arith/ood_steps", "arith/ood_numbers"}
    assert {r["model"] for r in rows} == {"base", "run"}
    base = {(r["benchmark"], r["metric"]): r["value"] for r in rows if r["model"] == "base"}
    assert all(0.0 <= base[(b, m)] <= 1.0 for b, m in base
               if m not in ("completion_length", "entropy", "eval_reward"))
    assert base[("arith/test", "format_rate")] > 0.5  # the bundled base writes the tags
    assert base[("arith/test", "pass@3")] >= base[("arith/test", "pass@1")]


def test_sandbox_mode_in_every_eval_table_and_the_report(stories260k, tmp_path):
    """A code benchmark records the sandbox mode in force in its rows, the text table and the report; without
    bubblewrap `mechdiag eval` refuses it (one line, exit 2, nothing written) unless --sandbox guard-only."""
    from mechdiag.eval_table import render_table
    from mechdiag.report import render
    from mechdiag.report.html import sandbox_of
    from mechdiag.run import load_run

    def ev(out, *extra, env=None, python=sys.executable, path=()):
        # env given: no bwrap on PATH and a kernel without landlock (tests/sandbox_conditions.py)
        args = ["-m", "mechdiag", "eval", str(stories260k), "--task", "mbpp,arith", "--n", "1", "--k", "1",
                "--samples", "1", "--max-new-tokens", "6", "--out", str(out), "--format", "json", *extra]
        root = str(Path(__file__).resolve().parent.parent)
        return subprocess.run(without_landlock(args, python) if env else [python, *args], capture_output=True,
                              text=True, timeout=300,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join([root, *path]), **(env or {})))

    p = ev(tmp_path / "bw")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    modes = {r["benchmark"]: r["sandbox"] for r in rows}
    assert modes == {"mbpp/test": "bwrap", "arith/test": "none"}
    assert render_table(rows).splitlines()[-1] == "sandbox: bwrap (mbpp/test); none (arith/test)"
    assert sandbox_of(load_run(tmp_path / "bw")) == "bwrap, none"
    page = render([load_run(tmp_path / "bw")])  # the HTML report's runs table
    assert ">sandbox</th>" in page and "<td>bwrap, none</td>" in page
    (tmp_path / "bw" / "summary.json").write_text(json.dumps({"sandbox": "guard-only"}))  # a training run's
    assert sandbox_of(load_run(tmp_path / "bw")) == "guard-only"
    nobw = {"PATH": str(tmp_path)}  # no bwrap on PATH
    p = ev(tmp_path / "refused", env=nobw)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "sandbox: auto, but bubblewrap cannot be used" in lines[0], p
    assert "and landlock cannot either" in lines[0]
    assert not (tmp_path / "refused").exists()
    if sandbox._guard_only_refusal() is not None:  # this interpreter sits where only root may enter
        p = ev(tmp_path / "guard", "--sandbox", "guard-only", env=nobw)
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == 2 and len(lines) == 1 and "guard-only cannot hold here" in lines[0], p
        assert not (tmp_path / "guard").exists()
    python, path = guard_only_python()  # an interpreter every user can read
    p = ev(tmp_path / "guard", "--sandbox", "guard-only", env=nobw, python=python, path=path)
    assert p.returncode == 0, p.stderr
    assert {r["sandbox"] for r in json.loads(p.stdout) if r["benchmark"] == "mbpp/test"} == {"guard-only"}
    assert "warning: sandbox: guard-only" in p.stderr
