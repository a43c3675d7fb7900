"""Issue 26's command matrix: every family of tests/tiny_models.MATRIX through train (native and TRL),
displacement (by tensor, module, layer, --spectral), shift, attribute, recommend (and training its refined config),
report and eval, in this process (click's runner). Each cell's numbers are checked against an independent
computation: the adapter file's factors multiplied out in float64, the models' own logits through plain
transformers + peft, and the run's own summary for the reference rows."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from peft import PeftModel
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from mechdiag import config as C
from mechdiag.cli import main
from mechdiag.report.figures import _module_mass
from mechdiag.run import RunDir, load_run
from tests.tiny_models import MATRIX, adapter_deltas, family_folder

torch.set_num_threads(1)
F64 = torch.float64
SMALL = ["task.name=tests.toy:Toy", "group_size=2", "prompts_per_step=2", "max_completion_tokens=6",
         "max_prompt_tokens=64", "eval_n=3", "threads=1", "learning_rate=0.02", "record.shift_n=2", "save_every=2",
         "eval_every=2", "record.displacement_every=1", "lora.r=2", "lora.alpha=4", "max_time_s=null"]
PROMPTS = ["Once upon a time, a cat", "Tell a story number 3.", "a b"]


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return r.exit_code, r.stdout, r.stderr


def _sets(*items):
    return [x for s in items for x in ("--set", s)]


@pytest.fixture(scope="module", params=MATRIX)
def fam(request, tmp_path_factory):
    """One family's model folder and its two trained runs (native, TRL), shared by every cell."""
    tmp = tmp_path_factory.mktemp(request.param)
    folder = family_folder(request.param, tmp / "model")
    runs = {}
    for backend in ("native", "trl"):
        out = tmp / backend
        code, _, err = cli("train", "--backend", backend, "--out", out, "--max-steps", "2",
                           *_sets(f"model.name_or_path={folder}", *SMALL))
        assert code == 0, err[-3000:]
        runs[backend] = out
    return request.param, folder, runs, tmp


def _dense_deltas(run, folder) -> dict[str, torch.Tensor]:
    """tensor name (as the model names it: expert stacks per expert) -> s * B @ A in float64, straight from the
    saved adapter file."""
    return {k: d for k, (d, _) in _deltas(run, folder).items()}


def _deltas(run, folder):
    return adapter_deltas(run / "final", AutoModelForCausalLM.from_pretrained(folder))


def test_train_native_and_trl_record_exact_displacement(fam):
    family, folder, runs, _ = fam
    for backend, run in runs.items():
        rd = RunDir(run)
        assert rd.summary()["steps"] == 2 and (run / "final" / "adapter_model.safetensors").exists()
        recs = rd.read("displacement")
        last = max(r["step"] for r in recs)
        rows = {r["name"]: r for r in recs if r["step"] == last and not r.get("part_of")}
        deltas = _dense_deltas(run, folder)
        assert set(rows) == set(deltas), backend
        for name, d in deltas.items():
            assert rows[name]["delta_fro"] == pytest.approx(float(d.norm()), rel=1e-6, abs=1e-12), (backend, name)
        for part in (r for r in recs if r["step"] == last and r.get("part_of")):  # parts hold the whole update
            whole = rows[part["name"].split("[")[0]]
            siblings = [r for r in recs if r["step"] == last and r["name"].startswith(whole["name"] + "[")]
            assert math.fsum(r["delta_fro"] ** 2 for r in siblings) == pytest.approx(whole["delta_fro"] ** 2,
                                                                                      rel=1e-9, abs=1e-18)


def _rows(*args):
    code, out, err = cli("displacement", *args, "--format", "json")
    assert code == 0, err
    return json.loads(out)


def test_displacement_by_tensor_module_layer_and_spectral(fam):
    family, folder, runs, _ = fam
    run = runs["native"]
    both = _deltas(run, folder)
    deltas = {k: d for k, (d, _) in both.items()}
    rows = {r["name"]: r for r in _rows(folder, run, "--spectral")}
    for name, (d, w) in both.items():
        d = d if d.shape == w.shape else d.T  # GPT-2's Conv1D stores in x out
        r = rows[name]
        assert r["delta_fro"] == pytest.approx(float(d.norm()), rel=1e-9, abs=1e-12)
        assert r["ref_fro"] == pytest.approx(float(w.norm()), rel=1e-9)
        if float(d.norm()) > 0:
            assert r["sigma_1"] == pytest.approx(float(torch.linalg.svdvals(d)[0]), rel=1e-6)
    moved = {n for n, r in rows.items() if r["delta_fro"] > 0 and not r.get("part_of")}
    assert moved <= set(deltas)
    whole = [r for r in rows.values() if not r.get("part_of")]
    for by in ("module", "layer"):
        grouped = {g[by]: g for g in _rows(folder, run, "--by", by)}
        for key, g in grouped.items():
            if by == "layer":
                mine = [r for r in whole if r["layer"] == key]
            else:
                mine = [r for r in rows.values() if r["module"] == key]
            assert g["delta_fro"] == pytest.approx(math.sqrt(math.fsum(r["delta_fro"] ** 2 for r in mine)),
                                                   rel=1e-9, abs=1e-12), (by, key)
        if by == "layer":
            assert set(grouped) >= {0, 1}


def _kl_rows(p_logits, q_logits):
    p, q = F.log_softmax(p_logits.double(), -1), F.log_softmax(q_logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1)


def check_shift(folder, run, tmp):
    """`mechdiag shift`'s last layer equals the models' own logits: its logit-lens KL the mean over prompts of the
    last position's KL(base || tuned), its output KL the mean over every position, from plain transformers + peft,
    each prompt alone (no padding), ids from tokenizer.json itself."""
    probe = tmp / "prompts.txt"
    probe.write_text("\n".join(PROMPTS) + "\n")
    code, out, err = cli("shift", folder, run, "--prompts", probe, "--format", "json")
    assert code == 0, err
    rows = json.loads(out)
    last = max(rows, key=lambda r: r["layer"])
    assert last["layer"] == 1
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ref = AutoModelForCausalLM.from_pretrained(folder).eval()
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), run / "final").eval()
    lens, pooled = [], []
    with torch.no_grad():
        for text in PROMPTS:
            ids = torch.tensor([tok.encode(text).ids])
            a, b = ref(ids).logits[0], tuned(ids).logits[0]
            kl = _kl_rows(a, b)
            lens.append(float(kl[-1]))
            pooled.extend(kl.tolist())
    assert max(lens) > 0  # the adapter moved the logits: equal KLs are not two zeros
    assert last["logit_kl"] == pytest.approx(sum(lens) / len(lens), rel=1e-4, abs=1e-9)
    assert last["output_kl"] == pytest.approx(sum(pooled) / len(pooled), rel=1e-4, abs=1e-9)


def test_shift_lens_and_output_kl_are_the_models_own(fam):
    family, folder, runs, tmp = fam
    check_shift(folder, runs["native"], tmp)


def test_attribute_reference_rows_are_the_summary(fam):
    family, folder, runs, _ = fam
    for backend, run in runs.items():
        code, out, err = cli("attribute", run, "--by", "both", "--format", "json")
        assert code == 0, (backend, err)
        rows = json.loads(out)
        s = RunDir(run).summary()
        ref = {r["part"]: r for r in rows if r["by"] == "reference"}
        assert ref["none"]["accuracy_without"] == pytest.approx(s["final_accuracy"], abs=1e-12), backend
        assert ref["all"]["accuracy_without"] == pytest.approx(s["base_accuracy"], abs=1e-12), backend
        assert ref["none"]["output_kl_without"] == 0.0
        for by in ("layer", "module"):
            shares = [r["disp_share"] for r in rows if r["by"] == by]
            assert shares and math.fsum(shares) == pytest.approx(1.0), (backend, by)


def test_recommend_then_train_its_refined_config(fam):
    family, folder, runs, tmp = fam
    refined = tmp / "refined.yaml"
    code, out, err = cli("recommend", runs["native"], "--out", refined)
    assert code == 0, err
    cfg = C.load(refined)
    assert cfg.model.name_or_path == str(folder)
    code, _, err = cli("train", refined, "--out", tmp / "refined", "--max-steps", "1")
    assert code == 0, err[-2000:]
    assert RunDir(tmp / "refined").summary()["steps"] == 1


def test_report_shows_the_recorded_module_mass(fam):
    family, folder, runs, tmp = fam
    html = tmp / "report.html"
    code, _, err = cli("report", runs["native"], runs["trl"], "--out", html)
    assert code == 0, err
    text = html.read_text()
    run = load_run(runs["native"])
    mass = _module_mass(run)
    last = max(r["step"] for r in run.displacement)
    grouped = {g["module"]: g for g in _rows(folder, runs["native"], "--by", "module")}
    assert mass and math.fsum(v for m, v in mass.items() if m in grouped and grouped[m]["update_mass"]) > 0
    for m, v in mass.items():  # the report's bars are displacement's update mass of the final adapter
        assert v == pytest.approx(grouped[m]["update_mass"], rel=1e-4, abs=1e-12), (m, last)
        assert m in text


def test_eval_reproduces_the_runs_base_and_final_accuracy(fam):
    family, folder, runs, tmp = fam
    run = runs["native"]
    cfg = C.load(RunDir(run).config_path)
    code, out, err = cli("eval", folder, "--adapter", f"run={run}", "--task", "tests.toy:Toy", "--n", cfg.eval_n,
                         "--k", "1", "--max-new-tokens", cfg.max_completion_tokens, "--format", "json",
                         "--out", tmp / "eval")
    assert code == 0, err
    acc = {r["model"]: r["value"] for r in json.loads(out) if r["metric"] == "accuracy"}
    s = RunDir(run).summary()
    assert acc["base"] == pytest.approx(s["base_accuracy"]) and acc["run"] == pytest.approx(s["final_accuracy"])
