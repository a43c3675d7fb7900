"""Issue 26's command cells, one check each, shared by tests/test_family_matrix.py (the named families) and
tests/test_unnamed_families.py (the families the tests do not name): train (native and TRL), displacement (by tensor,
module, layer, --spectral), shift, attribute, recommend (and training its refined config), report and eval, in this
process (click's runner). Each cell's numbers are checked against an independent computation: the adapter file's
factors multiplied out in float64, the models' own logits through plain transformers + peft, and the run's own
summary for the reference rows."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from peft import PeftModel
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from mechdiag import config as C
from mechdiag.cli import main
from mechdiag.recommend import Signals
from mechdiag.report.figures import _module_mass
from mechdiag.run import RunDir, load_run
from tests.tiny_models import N_LAYERS, adapter_deltas, family_folder

SMALL = ["task.name=tests.toy:Toy", "group_size=2", "prompts_per_step=2", "max_completion_tokens=6",
         "max_prompt_tokens=64", "eval_n=3", "threads=1", "learning_rate=0.02", "record.shift_n=2", "save_every=2",
         "eval_every=2", "record.displacement_every=1", "lora.r=2", "lora.alpha=4", "max_time_s=null"]
PROMPTS = ["Once upon a time, a cat", "Tell a story number 3.", "a b"]
BACKENDS = ("native", "trl")


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return r.exit_code, r.stdout, r.stderr


def sets(*items):
    return [x for s in items for x in ("--set", s)]


def train(folder, out, backend="native", *extra, steps=2):
    return cli("train", "--backend", backend, "--out", out, "--max-steps", steps,
               *sets(f"model.name_or_path={folder}", *SMALL, *extra))


def family_runs(family: str, tmp: Path, *extra: str) -> tuple[str, Path, dict[str, Path], Path]:
    """(family, model folder, {backend: run of two steps}, tmp): what a module-scoped fixture shares across cells;
    extra: settings over SMALL."""
    folder = family_folder(family, tmp / "model")
    runs = {}
    for backend in BACKENDS:
        code, _, err = train(folder, tmp / backend, backend, *extra)
        assert code == 0, err[-3000:]
        runs[backend] = tmp / backend
    return family, folder, runs, tmp


@functools.lru_cache(maxsize=2)
def base(folder: Path):
    """The base model of a family's folder, loaded once for the cells that only read it (never modify it)."""
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def deltas(run, folder) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """tensor name (as the model names it: expert stacks per expert) -> (s * B @ A, base weight) in float64, straight
    from the saved adapter file."""
    return adapter_deltas(run / "final", base(folder))


def displacement_rows(*args) -> list[dict]:
    """`mechdiag displacement ARGS --format json`, run once per ARGS (the cells only read the rows)."""
    return _displacement(tuple(str(a) for a in args))


@functools.lru_cache(maxsize=8)
def _displacement(args: tuple[str, ...]) -> list[dict]:
    code, out, err = cli("displacement", *args, "--format", "json")
    assert code == 0, err
    return json.loads(out)


def check_train_records(folder, runs):
    """Each backend's last recorded displacement rows are the saved adapter's factors multiplied out; a fused
    tensor's parts hold its whole update and are displacement's parts of the saved adapter (which
    check_displacement and the unnamed families' part checks hold to the family's own split)."""
    for backend, run in runs.items():
        rd = RunDir(run)
        assert rd.summary()["steps"] == 2 and (run / "final" / "adapter_model.safetensors").exists()
        recs = rd.read("displacement")
        last = max(r["step"] for r in recs)
        rows = {r["name"]: r for r in recs if r["step"] == last and not r.get("part_of")}
        dense = {k: d for k, (d, _) in deltas(run, folder).items()}
        assert set(rows) == set(dense), backend
        for name, d in dense.items():
            assert rows[name]["delta_fro"] == pytest.approx(float(d.norm()), rel=1e-6, abs=1e-12), (backend, name)
        parts = [r for r in recs if r["step"] == last and r.get("part_of")]
        shown = {r["name"]: r for r in displacement_rows(folder, run)} if parts else {}
        for part in parts:
            for key in ("delta_fro", "ref_fro"):
                assert part[key] == pytest.approx(shown[part["name"]][key], rel=1e-6, abs=1e-12), (backend, part)
            whole = rows[part["name"].split("[")[0]]
            siblings = [r for r in recs if r["step"] == last and r["name"].startswith(whole["name"] + "[")]
            assert math.fsum(r["delta_fro"] ** 2 for r in siblings) == pytest.approx(whole["delta_fro"] ** 2,
                                                                                      rel=1e-9, abs=1e-18)


def check_displacement(folder, run) -> dict[str, dict]:
    """`mechdiag displacement --spectral` of the saved adapter: each adapted tensor's delta, base norm and top
    singular value are the float64 product's; --by module / layer are the root sum of squares of their rows.
    Returns the by-tensor rows."""
    both = deltas(run, folder)
    rows = {r["name"]: r for r in displacement_rows(folder, run, "--spectral")}
    assert any(float(d.norm()) > 0 for d, _ in both.values())
    for name, (d, w) in both.items():
        r = rows[name]
        assert r["delta_fro"] == pytest.approx(float(d.norm()), rel=1e-9, abs=1e-12), name
        assert r["ref_fro"] == pytest.approx(float(w.norm()), rel=1e-9), name
        if float(d.norm()) > 0:
            assert r["sigma_1"] == pytest.approx(float(torch.linalg.svdvals(d)[0]), rel=1e-6), name
    assert {n for n, r in rows.items() if r["delta_fro"] > 0 and not r.get("part_of")} <= set(both)
    whole = [r for r in rows.values() if not r.get("part_of")]
    for by in ("module", "layer"):
        grouped = {g[by]: g for g in displacement_rows(folder, run, "--by", by)}
        for key, g in grouped.items():
            mine = [r for r in whole if r["layer"] == key] if by == "layer" else \
                [r for r in rows.values() if r["module"] == key]
            assert g["delta_fro"] == pytest.approx(math.sqrt(math.fsum(r["delta_fro"] ** 2 for r in mine)),
                                                   rel=1e-9, abs=1e-12), (by, key)
        if by == "layer":
            assert set(grouped) >= set(range(N_LAYERS))
    return rows


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
    assert last["layer"] == N_LAYERS - 1
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ref = base(folder)
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


def check_attribute(runs):
    """`mechdiag attribute`'s reference rows are the run's own summary (nothing removed: the final accuracy; all
    removed: the base's), and each grouping's displacement shares sum to 1."""
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


def check_recommend_train(folder, run, tmp):
    """config.yaml records the LoRA targets the run really used (the family's defaults resolved), so recommend sees
    non-empty layer and module masses; `mechdiag recommend` writes a config of the same model that `mechdiag
    train` runs as it is."""
    loaded = load_run(run)
    used = {r.get("part_of") or r["module"] for r in loaded.displacement}
    targets = set(loaded.cfg.lora.target_modules)

    def matches(module: str, target: str) -> bool:  # a row's name qualifies an ambiguous target (mlp.c_proj)
        return module == target or module.endswith("." + target)

    assert used and all(any(matches(m, t) for t in targets) for m in used), (used, targets)
    assert all(any(matches(m, t) for m in used) for t in targets), (used, targets)
    signals = Signals.from_runs([loaded])
    assert signals.layer_mass and signals.module_mass and set(signals.module_mass) <= used | {
        r["module"] for r in loaded.displacement}
    refined = tmp / "refined.yaml"
    code, out, err = cli("recommend", run, "--out", refined)
    assert code == 0, err
    cfg = C.load(refined)
    assert cfg.model.name_or_path == str(folder)
    code, _, err = cli("train", refined, "--out", tmp / "refined", "--max-steps", "1")
    assert code == 0, err[-2000:]
    assert RunDir(tmp / "refined").summary()["steps"] == 1


def check_report(folder, runs, tmp):
    """`mechdiag report` of the runs shows each module's recorded update mass, displacement's of the final
    adapter."""
    html = tmp / "report.html"
    code, _, err = cli("report", *runs.values(), "--out", html)
    assert code == 0, err
    text = html.read_text()
    native = runs["native"]
    run = load_run(native)
    mass = _module_mass(run)
    grouped = {g["module"]: g for g in displacement_rows(folder, native, "--by", "module")}
    assert mass and math.fsum(v for m, v in mass.items() if m in grouped and grouped[m]["update_mass"]) > 0
    for m, v in mass.items():
        assert v == pytest.approx(grouped[m]["update_mass"], rel=1e-4, abs=1e-12), m
        assert m in text


def check_eval(folder, run, tmp):
    """`mechdiag eval` of the base and the run's adapter reproduces the run's own base and final accuracy."""
    cfg = C.load(RunDir(run).config_path)
    code, out, err = cli("eval", folder, "--adapter", f"run={run}", "--task", "tests.toy:Toy", "--n", cfg.eval_n,
                         "--k", "1", "--max-new-tokens", cfg.max_completion_tokens, "--format", "json",
                         "--out", tmp / "eval")
    assert code == 0, err
    acc = {r["model"]: r["value"] for r in json.loads(out) if r["metric"] == "accuracy"}
    s = RunDir(run).summary()
    assert acc["base"] == pytest.approx(s["base_accuracy"]) and acc["run"] == pytest.approx(s["final_accuracy"])
