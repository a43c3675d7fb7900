"""`mechdiag eval`: a base model and its tuned adapters on benchmarks, in the study's table form.

    metrics per (benchmark, model)   greedy accuracy, eval reward, format rate, completion length, truncation
                                     rate, entropy; pass@k (unbiased, n samples per problem) and maj@k
    comparison                       rows benchmark x metric, columns base and each tuned group (mean ± std over
                                     the adapters of a group, e.g. seeds), improvement/regression vs the base,
                                     and the study's "N of M benchmark-metric configurations improve"

The base is loaded once; every PEFT adapter is loaded into the same PeftModel and switched with `set_adapter`
(the base itself runs under `disable_adapter()`). Problems are processed in chunks: completions are written to a
samples file as they are scored and only per-problem tallies stay in memory. Sampling draws from a generator
seeded by (seed, benchmark, chunk), the same for every model, so results are deterministic for a fixed seed and
batch size, and base and tuned models see the same random numbers (a paired comparison).

Run directory written (`--out`, default runs/eval-<time>):
    eval_benchmarks.jsonl  one row per benchmark x metric x model group: benchmark, metric, model, value, std, n
    eval_models.jsonl      the same per adapter (before grouping)
    eval_samples.jsonl     every completion: benchmark, model, example_id, sample (-1 greedy), completion, ...
    samples.jsonl          (appended) the first greedy completions per benchmark x model, for the report's pairs
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from mechdiag import atomic, models, sandbox
from mechdiag import tasks as T
from mechdiag.console import Progress
from mechdiag.errors import UserError
from mechdiag.eval_table import BASE
from mechdiag.generate import generate, greedy
from mechdiag.metrics import change, maj_at_k, mean_std, metric_order, pass_at_k
from mechdiag.run import RunDir
from mechdiag.tasks.rewards import format_ok, weighted_total
from mechdiag.weights import is_adapter


# ---- per-benchmark tallies ---------------------------------------------------------------------------------
@dataclass
class Tally:
    """Running sums for one (benchmark, model): constant memory in the number of problems."""

    ks: list[int]
    samples: int
    votable: bool = True
    n: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    entropy_sum: float = 0.0

    def _add(self, name: str, value: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(value)

    def add(self, *, correct: bool, reward: float, fmt: float, length: int, truncated: bool,
            sample_correct: list[bool], sample_keys: list) -> dict[str, float]:
        """One problem: its greedy completion and its sampled ones. Returns the problem's pass@k / maj@k."""
        self.n += 1
        self._add("accuracy", correct)
        self._add("eval_reward", reward)
        self._add("format_rate", fmt)
        self._add("completion_length", length)
        self._add("truncation_rate", truncated)
        per: dict[str, float] = {}
        if self.samples:
            c = sum(bool(x) for x in sample_correct)
            for k in self.ks:
                per[f"pass@{k}"] = pass_at_k(self.samples, c, k)
                if self.votable and k > 1:
                    per[f"maj@{k}"] = maj_at_k(sample_keys, sample_correct, k)
        for name, v in per.items():
            self._add(name, v)
        return per

    def add_entropy(self, total: float, tokens: int) -> None:
        self.entropy_sum += total
        self.tokens += tokens

    def metrics(self) -> dict[str, float]:
        if not self.n:
            return {}
        out = {name: v / self.n for name, v in self.sums.items()}
        out["entropy"] = self.entropy_sum / self.tokens if self.tokens else math.nan
        return out


# ---- what to evaluate --------------------------------------------------------------------------------------
@dataclass
class Settings:
    ks: list[int] = field(default_factory=lambda: [1, 3, 5])
    samples: int | None = None  # completions per problem for pass@k; None = max(ks)
    temperature: float = 0.8  # the study's sampling temperature (Table 7)
    top_p: float = 1.0
    max_new_tokens: int = 256
    max_prompt_tokens: int | None = None
    batch_size: int = 64  # sequences per forward pass
    seed: int = 0
    n: int | None = None  # problems per benchmark (the first n in file order); None = all

    def check(self) -> Settings:
        if not self.ks or any(k < 1 for k in self.ks):
            raise UserError(f"--k needs positive integers, got {','.join(map(str, self.ks)) or 'nothing'}")
        self.ks = sorted(set(self.ks))
        if self.samples is None:
            self.samples = max(self.ks)
        if self.samples < 1:
            raise UserError(f"--samples must be >= 1, got {self.samples}")
        if max(self.ks) > self.samples:
            raise UserError(f"k={max(self.ks)} is larger than --samples {self.samples}: pass@k needs k <= n samples "
                            "per problem")
        if self.temperature < 0:
            raise UserError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        for name in ("batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.n is not None and self.n < 1:
            raise UserError(f"--n must be >= 1, got {self.n}")
        return self


@dataclass
class Benchmark:
    task_name: str
    split: str
    task: object
    examples: list

    @property
    def name(self) -> str:
        return f"{self.task_name}/{self.split}"


def parse_tasks(specs: Iterable[str], splits: Iterable[str] = ()) -> list[tuple[str, str | None]]:
    """`--task` values ("gsm8k", "arith/ood_steps", "a,b") -> [(task, split or None)], with --split as default."""
    names = [s.strip() for spec in specs for s in spec.split(",") if s.strip()]
    if not names:
        raise UserError("give at least one --task NAME (e.g. --task gsm8k or --task arith/ood_steps)")
    default_splits = [s.strip() for spec in splits for s in spec.split(",") if s.strip()] or [None]
    out = []
    for name in names:
        task, sep, split = name.partition("/")
        pairs = [(task, split)] if sep else [(task, s) for s in default_splits]
        for p in pairs:
            if p not in out:
                out.append(p)
    return out


def load_benchmarks(specs: list[tuple[str, str | None]], n: int | None, path: str | None = None,
                    options: dict | None = None) -> list[Benchmark]:
    """Tasks and their examples, read before any model loads (a bad file fails in a second, not after loading)."""
    if path is not None and len({t for t, _ in specs}) > 1:
        raise UserError("--path applies to one task; evaluate tasks with their own files in separate calls")
    tasks: dict[str, object] = {}
    out = []
    for name, split in specs:
        if name not in tasks:
            tasks[name] = T.get_task(name, path, **dict(options or {}))
        task = tasks[name]
        if split is None:
            known = tuple(getattr(task, "splits", ()) or ("test",))
            split = "test" if "test" in known else known[0]
        examples = task.examples(split, n=n, seed=0)
        if not examples:
            raise UserError(f"task {name} split {split}: no examples")
        out.append(Benchmark(name, split, task, examples))
    return out


# ---- models ------------------------------------------------------------------------------------------------
@dataclass
class Tuned:
    label: str
    group: str
    path: Path
    kind: str  # "peft" (an adapter on the base) or "full" (a whole fine-tuned model)


def resolve_adapter(path: str) -> tuple[Path, str]:
    """(folder, kind) for --adapter: a PEFT adapter folder ("peft"), a full model folder ("full") or a run
    directory (its final/)."""
    folder = models.checkpoint_folder(path)
    if not folder.is_dir():
        raise UserError(f"--adapter {path}: no such folder" if not folder.exists() else
                        f"--adapter {path}: is a file; give the folder holding adapter_config.json")
    if is_adapter(folder):
        return folder, "peft"
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder, "full"
    raise UserError(f"--adapter {path}: not a PEFT adapter folder (no adapter_config.json), a model folder or a "
                    "mechdiag run directory")


def default_label(folder: Path, given: str) -> str:
    """The run's name for RUN/final and RUN/checkpoints/step-N ('run:step-N'), else the folder's name."""
    if folder.name == "final":
        return folder.parent.name
    if folder.name.startswith("step-") and folder.parent.name == "checkpoints":
        return f"{folder.parent.parent.name}:{folder.name}"
    return folder.name or Path(given).resolve().name


def parse_adapters(specs: Iterable[str], group: str | None = None) -> list[Tuned]:
    """`--adapter [LABEL=]DIR` values -> Tuned models with their group.

    A label `NAME@ANYTHING` (e.g. "grpo@42", "grpo@3407") joins group NAME: mean ± std over its members. Adapters
    whose label has no '@' form a group of one, unless `--group NAME` is given, which gathers them all in NAME.
    """
    out: list[Tuned] = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or "/" in label or Path(spec).exists():
            label, path = "", spec
        folder, kind = resolve_adapter(path)
        label = label or default_label(folder, path)
        if label == BASE or label.partition("@")[0] == BASE:
            raise UserError(f"--adapter {spec}: the label {BASE!r} is the base model's; choose another")
        if any(t.label == label for t in out):
            raise UserError(f"--adapter {spec}: label {label!r} given twice; name them with --adapter LABEL=DIR")
        grp = label.partition("@")[0] if "@" in label else (group or label)
        out.append(Tuned(label, grp, folder, kind))
    return out


class Models:
    """The base and every tuned model, with the base's weights loaded once and shared by all PEFT adapters."""

    def __init__(self, model_name: str, tuned: list[Tuned], dtype: str = "float32", device: str | None = None):
        self.model_name = model_name
        self.device = models.device(device)
        self.base, self.tokenizer = models.load_model_and_tokenizer(model_name, dtype)
        self.base.to(self.device).eval()  # before the adapters: peft puts their factors beside the base weights
        self.tuned = tuned
        self.dtype = dtype
        self.peft = None
        self._names: dict[str, str] = {}
        for i, t in enumerate(x for x in tuned if x.kind == "peft"):
            name = f"adapter{i}"  # peft adapter names become module keys: no dots or slashes
            self._load_adapter(t, name)
            self._names[t.label] = name
        if self.peft is not None:
            self.peft.eval()

    def _load_adapter(self, t: Tuned, name: str) -> None:
        try:
            self.peft = models.load_adapters(self.peft or self.base, {name: t.path})
        except UserError as e:  # wrong base (shape mismatch), corrupt files: one line for the user
            raise UserError(f"--adapter {t.path}: cannot load it onto {self.model_name}: {e}") from None

    def labels(self) -> list[str]:
        return [BASE] + [t.label for t in self.tuned]

    @contextlib.contextmanager
    def use(self, label: str):
        """The model to generate with for `label` (base: the shared weights with every adapter off)."""
        if label == BASE:
            if self.peft is None:
                yield self.base
            else:
                with self.peft.disable_adapter():
                    yield self.peft
            return
        t = next(t for t in self.tuned if t.label == label)
        if t.kind == "peft":
            self.peft.set_adapter(self._names[label], inference_mode=True)
            yield self.peft
            return
        full = models.load_model(t.path, self.dtype)  # a full fine-tune shares nothing; hold it only while used
        try:
            yield full.to(self.device).eval()
        finally:
            del full


# ---- the scoring loop --------------------------------------------------------------------------------------
def chunk_seed(seed: int, benchmark: str, start: int) -> int:
    h = hashlib.sha256(f"{seed}/{benchmark}/{start}".encode()).digest()
    return int.from_bytes(h[:8], "little") % (2**63 - 1)


def score_problems(task, examples: list, greedy: list, sampled: list[list], tally: Tally, weights: dict) -> list:
    """Score one chunk; update `tally`; return the sample records (greedy as sample -1).

    greedy: one generate.Sample per example; sampled: `tally.samples` Samples per example (may be empty lists).
    """

    flat = [s for row in sampled for s in row]
    flat_ex = [e for e, row in zip(examples, sampled, strict=True) for _ in row]
    g_text = [s.text for s in greedy]
    g_ok = task.correct_many(g_text, examples)
    g_comp = task.components_many(g_text, examples)
    s_ok = task.correct_many([s.text for s in flat], flat_ex) if flat else []
    records, j = [], 0
    for i, ex in enumerate(examples):
        row = sampled[i]
        ok_i, keys_i = [bool(x) for x in s_ok[j:j + len(row)]], [task.answer_key(s.text, ex) for s in row]
        j += len(row)
        reward = weighted_total(g_comp[i], weights)
        g = greedy[i]
        per = tally.add(correct=bool(g_ok[i]), reward=reward, fmt=format_ok(g.text), length=g.length,
                        truncated=g.truncated, sample_correct=ok_i, sample_keys=keys_i)
        gkey = task.answer_key(g.text, ex)
        records.append({"example_id": ex.id, "sample": -1, "completion": g.text, "correct": bool(g_ok[i]),
                        "reward": reward, "answer": None if gkey is None else str(gkey), "length": g.length,
                        "truncated": g.truncated, **per})
        for s_idx, (s, ok, key) in enumerate(zip(row, ok_i, keys_i, strict=True)):
            records.append({"example_id": ex.id, "sample": s_idx, "completion": s.text, "correct": ok,
                            "answer": None if key is None else str(key), "length": s.length,
                            "truncated": s.truncated})
    return records


def fit_eval_budget(context: int | None, s: Settings) -> int | None:
    """The prompt budget that keeps prompt + --max-new-tokens inside the model's context (models.fit_prompt_budget:
    the default is what fits; a --max-prompt-tokens that does not is cut, with a note)."""
    return models.fit_prompt_budget(context, s.max_prompt_tokens, s.max_new_tokens, "--max-prompt-tokens",
                                    "--max-new-tokens")


def evaluate_model(model, tokenizer, bench: Benchmark, settings: Settings, write=None) -> dict[str, float]:
    """Metrics of one model on one benchmark, streaming sample records to `write(records)`."""

    task, s = bench.task, settings
    weights = task.reward_weights()
    tally = Tally(s.ks, s.samples, votable=task.votable)
    model.eval()  # no LoRA dropout
    max_prompt = fit_eval_budget(models.context_length(getattr(model, "config", None)), s)
    per_chunk = max(1, s.batch_size // s.samples)  # problems per chunk: samples x problems <= batch_size rows
    for start in range(0, len(bench.examples), per_chunk):
        chunk = bench.examples[start:start + per_chunk]
        prompts = [task.prompt(e, tokenizer) for e in chunk]
        greedy_done, ent_sum, ent_n = greedy(model, tokenizer, prompts, s.max_new_tokens, max_prompt, len(prompts))
        tally.add_entropy(ent_sum, ent_n)
        sampled = generate(model, tokenizer, prompts, n=s.samples, temperature=s.temperature, top_p=s.top_p,
                           max_new_tokens=s.max_new_tokens, seed=chunk_seed(s.seed, bench.name, start),
                           max_prompt_tokens=max_prompt)
        records = score_problems(task, chunk, greedy_done, sampled, tally, weights)
        for r, p in zip((r for r in records if r["sample"] == -1), prompts, strict=True):
            r["prompt"] = p
        if write is not None:
            write(records)
    return tally.metrics()


# ---- comparison --------------------------------------------------------------------------------------------
STATUS = {1: "improve", -1: "regress", 0: "same"}  # metrics.change -> a row's status


def compare(per_model: list[dict], tuned: list[Tuned]) -> list[dict]:
    """Group per-model rows (benchmark, metric, model, value, n) into the comparison rows.

    One row per benchmark x metric x column, where the columns are the base and each tuned group: value = mean
    over the group's adapters, std = their sample std (None for one adapter), delta = value - base, and status
    "improve" / "regress" / "same" by metrics.change (None for the base and neutral metrics).
    """
    groups: dict[str, list[str]] = {BASE: [BASE]}
    for t in tuned:
        groups.setdefault(t.group, []).append(t.label)
    cell: dict[tuple[str, str, str], float] = {}
    ns: dict[str, int] = {}
    benches, metrics = [], []
    for r in per_model:
        cell[(r["benchmark"], r["metric"], r["model"])] = r["value"]
        ns[r["benchmark"]] = r["n"]
        if r["benchmark"] not in benches:
            benches.append(r["benchmark"])
        if r["metric"] not in metrics:
            metrics.append(r["metric"])
    rows = []
    for b in benches:
        for m in sorted({m for (bb, m, _) in cell if bb == b}, key=metric_order):
            base = cell.get((b, m, BASE), math.nan)
            for g, members in groups.items():
                vals = [cell[(b, m, x)] for x in members if (b, m, x) in cell]
                if not vals:
                    continue
                mean, std = mean_std(vals)
                mean = math.nan if mean is None else mean
                row = {"step": 0, "benchmark": b, "metric": m, "model": g, "value": mean, "std": std, "n": ns[b],
                       "seeds": len(vals), "members": ",".join(members), "delta": None, "status": None}
                if g != BASE:
                    row["delta"] = mean - base
                    row["status"] = STATUS.get(change(m, mean - base, base))
                rows.append(row)
    return rows


# ---- the whole evaluation ----------------------------------------------------------------------------------
@dataclass
class Result:
    rows: list[dict]  # comparison rows (eval_benchmarks.jsonl)
    per_model: list[dict]  # per adapter (eval_models.jsonl)
    out_dir: Path
    samples_path: Path


def _merge_jsonl(path: Path, keep, new_records: list[dict]) -> None:
    old = [r for r in atomic.read_jsonl(path) if keep(r)] if path.exists() else []
    atomic.write_jsonl(path, old + new_records)


def run_eval(model_name: str, tuned: list[Tuned], benches: list[Benchmark], settings: Settings, out_dir,
             dtype: str = "float32", progress=None, report_samples: int = 8, device: str | None = None,
             sandbox_mode: str = "auto") -> Result:
    """Evaluate the base and every tuned model on every benchmark; write the run directory; return the rows.

    Besides the eval_* files, the first `report_samples` greedy completions per benchmark and model go to the run's
    samples.jsonl (kind "eval", source "mechdiag eval"), where the report pairs base and tuned answers.
    """

    settings.check()
    # a budget the model's context cannot hold: one line before any load (the note of a cut budget said once)
    settings = replace(settings, max_prompt_tokens=fit_eval_budget(models.context_of(model_name), settings))
    # code benchmarks run model code: without OS isolation they stop here unless sandbox_mode is guard-only
    code = any(getattr(b.task, "domain", "") == "code" for b in benches)
    iso = sandbox.use(sandbox_mode) if code else "none"
    mode_of = {b.name: iso if getattr(b.task, "domain", "") == "code" else "none" for b in benches}
    loaded = Models(model_name, tuned, dtype, device)  # load (and fail on a bad model or adapter) before writing
    run = RunDir(out_dir, create=True)
    group_of = {t.label: t.group for t in tuned}
    names = {b.name for b in benches}
    redone = lambda r: r.get("benchmark") in names  # noqa: E731  rows of this call replace earlier ones
    samples_path = run.stream("eval_samples")
    tmp = run.path / ".eval_samples.jsonl.partial"
    per_model: list[dict] = []
    shown: list[dict] = []  # a few greedy completions per benchmark x model for the report
    n_shown: Counter = Counter()
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            if samples_path.exists():  # keep the completions of benchmarks this call does not redo
                for r in atomic.read_jsonl(samples_path):
                    if not redone(r):
                        f.write(atomic.dumps(r) + "\n")
            for bench in benches:
                for label in loaded.labels():
                    t0 = time.perf_counter()
                    head = {"step": 0, "split": "eval", "benchmark": bench.name, "model": label,
                            "group": group_of.get(label, BASE)}
                    lines = Progress(f"eval {bench.name} {label}", total=len(bench.examples))
                    done = Counter()

                    def write(records, head=head, lines=lines, done=done):
                        f.write("".join(atomic.dumps({**head, **r}) + "\n" for r in records))
                        f.flush()
                        done["problems"] += sum(1 for r in records if r["sample"] == -1)
                        lines.update(done["problems"], "problems")  # a log line at most every ~10 s
                        key = (head["benchmark"], head["model"])
                        room = max(report_samples - n_shown[key], 0)
                        greedy = [r for r in records if r["sample"] == -1][:room]
                        n_shown[key] += len(greedy)
                        shown.extend({**head, "source": "mechdiag eval", **{k: r[k] for k in SHOWN if k in r}}
                                     for r in greedy)

                    with loaded.use(label) as model:
                        metrics = evaluate_model(model, loaded.tokenizer, bench, settings, write)
                    for m in sorted(metrics, key=metric_order):
                        per_model.append({"step": 0, "benchmark": bench.name, "metric": m, "model": label,
                                          "group": group_of.get(label, BASE), "value": metrics[m],
                                          "n": len(bench.examples), "samples": settings.samples,
                                          "temperature": settings.temperature, "seed": settings.seed,
                                          "sandbox": mode_of[bench.name]})
                    if progress:
                        progress(f"{bench.name}  {label}  {len(bench.examples)} problems  "
                                 f"accuracy {metrics.get('accuracy', math.nan):.3f}  {time.perf_counter() - t0:.1f} s")
        os.replace(tmp, samples_path)
    finally:
        if tmp.exists():
            tmp.unlink()
    rows = compare(per_model, tuned)
    for r in rows:
        r.update(samples=settings.samples, temperature=settings.temperature, seed=settings.seed,
                 sandbox=mode_of[r["benchmark"]])
    _merge_jsonl(run.stream("eval_benchmarks"), lambda r: not redone(r), rows)
    _merge_jsonl(run.stream("eval_models"), lambda r: not redone(r), per_model)
    if shown:
        _merge_jsonl(run.stream("samples"), lambda r: not (r.get("source") == "mechdiag eval" and redone(r)), shown)
    return Result(rows, per_model, run.path, samples_path)


SHOWN = ("example_id", "prompt", "completion", "correct", "reward", "answer", "length", "truncated")


def set_threads(n: int | None) -> None:
    if n:

        torch.set_num_threads(n)
