"""Every command on a real pretrained model: SmolLM2-135M-Instruct by name (`model.name_or_path:
smollm2-135m-instruct`), prompts through its chat template, tiny budgets. train (native and TRL), displacement,
shift, attribute, recommend (and its refined config trained), report, eval and watch, each checked against an
independent computation as tests/test_family_matrix.py does: the adapter's factors multiplied out in float64, the
models' own logits through plain transformers + peft, the run's own summary and records."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from mechdiag.run import RunDir
from mechdiag.tasks.arith import Arith
from mechdiag.tasks.base import SYSTEM_PROMPT, format_prompt
from tests import family_cells as cells
from tests.toy import Toy

torch.set_num_threads(1)
SMOL = "smollm2-135m-instruct"
# two steps of 2 prompts x 2 completions of 6 tokens; LoRA r=2 on the first and last of 30 layers and on four
# modules (attention and MLP) keeps attribute's passes few; no final geometry pass over 135M float64 weights
REAL = ["task.name=tests.test_real_model_commands:ChatToy", "group_size=2", "prompts_per_step=2",
        "max_completion_tokens=6", "max_prompt_tokens=96", "eval_n=3", "threads=1", "learning_rate=0.02",
        "record.shift_n=2", "save_every=2", "eval_every=2", "record.displacement_every=1", "lora.r=2",
        "lora.alpha=4", "lora.layers=0,29",
        "lora.target_modules=[q_proj,v_proj,up_proj,down_proj]", "record.final_geometry=false", "max_time_s=null"]


class ChatToy(Toy):
    """tests.toy.Toy's dense letter reward, its prompt through the model's chat template."""

    def prompt(self, example, tokenizer=None):
        return format_prompt(example.question, tokenizer, system="Answer in one short sentence.")


@pytest.fixture(scope="module")
def smol_runs(smollm2, tmp_path_factory):
    """Two-step runs of SmolLM2 by name, native and TRL, shared by every cell."""
    tmp = tmp_path_factory.mktemp("smol")
    runs = {}
    for backend in cells.BACKENDS:
        code, _, err = cells.cli("train", "--backend", backend, "--out", tmp / backend, "--max-steps", 2,
                                 *cells.sets(f"model.name_or_path={SMOL}", *REAL))
        assert code == 0, err[-3000:]
        runs[backend] = tmp / backend
    return smollm2, runs, tmp


def test_train_records_the_adapters_exact_displacement(smol_runs):
    folder, runs, _ = smol_runs
    cells.check_train_records(folder, runs)
    for run in runs.values():
        cfg = json.loads((run / "final" / "adapter_config.json").read_text())
        assert sorted(cfg["layers_to_transform"]) == [0, 29]
        sample = RunDir(run).read("samples")[0]
        assert sample["prompt"].startswith("<|im_start|>system\nAnswer in one short sentence.")


def test_displacement_of_the_named_model(smol_runs):
    """check_displacement's float64 products on the converted folder; the model's name gives the same rows."""
    folder, runs, _ = smol_runs
    rows = cells.check_displacement(folder, runs["native"])
    assert {r["layer"] for r in rows.values() if r["delta_fro"] > 0} == {0, 29}
    assert cells.displacement_rows(SMOL, runs["native"], "--by", "layer") == \
        cells.displacement_rows(folder, runs["native"], "--by", "layer")


def test_shift_through_the_chat_template(smol_runs):
    """`mechdiag shift --task arith` on the named model: the last layer's logit-lens KL is the mean over prompts of
    the last position's KL(base || tuned), the output KL the mean over every position (the template's leading
    <|im_start|>, the BOS, included: only the norms leave it out), from transformers + peft on prompts templated
    here."""
    folder, runs, _ = smol_runs
    code, out, err = cells.cli("shift", SMOL, runs["native"], "--task", "arith", "--n", 2, "--format", "json")
    assert code == 0, err
    last = max(json.loads(out), key=lambda r: r["layer"])
    assert last["layer"] == 29
    tok = AutoTokenizer.from_pretrained(folder)
    ref = cells.base(folder)
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), runs["native"] / "final").eval()
    lens, pooled = [], []
    with torch.no_grad():
        for ex in Arith().examples("test", 2):
            ids = tok.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                           {"role": "user", "content": ex.question}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            assert int(ids[0, 0]) == tok.bos_token_id
            p, q = (F.log_softmax(m(ids).logits[0].double(), -1) for m in (ref, tuned))
            kl = (p.exp() * (p - q)).sum(-1)
            lens.append(float(kl[-1]))
            pooled.extend(kl.tolist())
    assert max(lens) > 0
    assert last["logit_kl"] == pytest.approx(sum(lens) / len(lens), rel=1e-4, abs=1e-9)
    assert last["output_kl"] == pytest.approx(sum(pooled) / len(pooled), rel=1e-4, abs=1e-9)


def test_attribute_reference_rows_are_the_summary(smol_runs):
    """check_attribute's checks, by layer on the native run and by module on TRL's (each pass on a real model
    costs seconds; both groupings on both backends run in the family matrix)."""
    _, runs, _ = smol_runs
    for backend, by in (("native", "layer"), ("trl", "module")):
        code, out, err = cells.cli("attribute", runs[backend], "--by", by, "--format", "json")
        assert code == 0, (backend, err)
        rows = json.loads(out)
        s = RunDir(runs[backend]).summary()
        ref = {r["part"]: r for r in rows if r["by"] == "reference"}
        assert ref["none"]["accuracy_without"] == pytest.approx(s["final_accuracy"], abs=1e-12), backend
        assert ref["all"]["accuracy_without"] == pytest.approx(s["base_accuracy"], abs=1e-12), backend
        assert ref["none"]["output_kl_without"] == 0.0 and ref["all"]["output_kl_without"] > 0, backend
        shares = [r["disp_share"] for r in rows if r["by"] == by]
        assert len(shares) == (2 if by == "layer" else 4) and math.fsum(shares) == pytest.approx(1.0), backend


def test_recommend_then_train_its_refined_config(smol_runs):
    _, runs, tmp = smol_runs
    cells.check_recommend_train(SMOL, runs["native"], tmp)


def test_report_shows_the_recorded_module_mass(smol_runs):
    _, runs, tmp = smol_runs
    cells.check_report(SMOL, runs, tmp)


def test_eval_reproduces_the_runs_base_and_final_accuracy(smol_runs):
    _, runs, tmp = smol_runs
    cfg = json.loads((runs["native"] / "summary.json").read_text())
    code, out, err = cells.cli("eval", SMOL, "--adapter", f"run={runs['native']}", "--task",
                               "tests.test_real_model_commands:ChatToy", "--n", cfg["eval_n"], "--k", "1",
                               "--max-new-tokens", 6, "--format", "json", "--out", tmp / "eval")
    assert code == 0, err
    acc = {r["model"]: r["value"] for r in json.loads(out) if r["metric"] == "accuracy"}
    assert acc["base"] == pytest.approx(cfg["base_accuracy"]) and acc["run"] == pytest.approx(cfg["final_accuracy"])
    assert 0 < acc["base"] + acc["run"]  # the letter reward's threshold is met somewhere: not two zeros


def test_watch_shows_the_runs_last_signals(smol_runs):
    _, runs, _ = smol_runs
    code, out, err = cells.cli("watch", runs["native"], "--once")
    assert code == 0, err
    last = RunDir(runs["native"]).read("metrics")[-1]
    row = next(ln for ln in out.splitlines() if "train reward" in ln)
    shown = float(row.replace("│", " ").split()[2])
    assert shown == pytest.approx(last["reward"], abs=5e-4 * max(1.0, abs(last["reward"])))
    assert math.isfinite(shown)
