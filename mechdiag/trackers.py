"""mechdiag's signals in the user's own tracker (config `report_to`; the `trackers` extra): TensorBoard, Weights &
Biases (offline), MLflow (a local file store) and Trackio (its local store), each through its own library.

    scalars(stream, records)   one stream's records as namespaced scalars: mechdiag/<stream>/<key>; displacement
                               per layer x module as mechdiag/displacement/<layer>.<module>/<column>; shift per
                               layer as mechdiag/shift/<layer>/<column>; a newly fired alert as mechdiag/alerts/<name>
    Report                     the recorder's last signal: each event's records as scalars, handed to a sink on
                               the writer rank (native trainer: `Trackers`; TRL: its report_to callbacks)
    Trackers                   the native trainer's backends, opened on first use, in the run directory
    ReportTo                   the TRL path's: GRPOTrainer's report_to callbacks, fed through their own on_log
    require(names)             before any heavy work: a missing library is one line naming the extra

The per layer x module displacement also goes in as a heatmap image (TensorBoard) or a table (W&B, MLflow, Trackio).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import math
import os
import re
import sys
import time
import uuid
from pathlib import Path

from mechdiag import atomic
from mechdiag.config import TRACKERS
from mechdiag.errors import UserError
from mechdiag.metrics import is_number
from mechdiag.recorder import Alerts, Signal
from mechdiag.run import flatten_config

LIBRARY = {name: name for name in TRACKERS}  # each through the library of its name
EXTRA = "pip install 'mechdiag[trackers]'"
PREFIX = "mechdiag"
SITE_COLUMNS = ("rel_fro", "delta_fro", "subspace_overlap", "intruders")  # per layer x module, when present
SHIFT_COLUMNS = ("shift", "cos_dist", "logit_kl")
SKIP_STREAMS = ("samples", "summary")  # text, not scalars; summary.json, the run's totals
HEATMAP = f"{PREFIX}/displacement/rel_fro"  # the heatmap's tag / table name


def require(names) -> None:
    """A UserError naming the extra when a tracker's library is not installed."""
    for name in names:
        lib = LIBRARY[name]
        if importlib.util.find_spec(lib) is None:
            raise UserError(f"report_to {name} needs the {lib} library: {EXTRA}")


def scalars(stream: str, records) -> dict[str, float]:
    """The records of one stream (one event's) as {namespaced key: value}; text and non-finite values left out."""
    out: dict[str, float] = {}
    if stream in SKIP_STREAMS:
        return out
    for r in records:
        if stream == "displacement":
            site = f"{r['layer']}.{r['module']}" if r.get("layer") is not None else r.get("name")
            out.update({f"{PREFIX}/displacement/{site}/{c}": float(r[c]) for c in SITE_COLUMNS if is_number(r.get(c))})
        elif stream == "shift":
            out.update({f"{PREFIX}/shift/{r['layer']}/{c}": float(r[c]) for c in SHIFT_COLUMNS if is_number(r.get(c))})
        else:
            out.update({f"{PREFIX}/{stream}/{k}": float(v) for k, v in r.items() if k != "step" and is_number(v)})
    return out


def heatmap(rows: list[dict]) -> tuple[list[int], list[str], list[list[float]]]:
    """(layers, modules, rel_fro[layer][module]) of one step's displacement rows (nan where a site is absent)."""
    rows = [r for r in rows if r.get("layer") is not None and is_number(r.get("rel_fro"))]
    layers = sorted({r["layer"] for r in rows})
    modules = list(dict.fromkeys(r["module"] for r in rows))
    grid = [[math.nan] * len(modules) for _ in layers]
    for r in rows:
        grid[layers.index(r["layer"])][modules.index(r["module"])] = float(r["rel_fro"])
    return layers, modules, grid


def heatmap_image(grid: list[list[float]], cell: int = 12):
    """The grid as an RGB image (H x W x 3 uint8; rows = layers): white (0) to dark blue (the largest), grey for
    an absent site."""
    import numpy as np  # noqa: PLC0415 - numpy comes with torch; loaded only when a tracker draws

    a = np.asarray(grid, dtype=np.float64)
    top = np.nanmax(a) if np.isfinite(a).any() else 0.0
    t = np.nan_to_num(a / top if top > 0 else np.zeros_like(a), nan=0.0)
    low, high = np.array([255.0, 255.0, 255.0]), np.array([8.0, 48.0, 107.0])
    img = low + t[..., None] * (high - low)
    img[~np.isfinite(a)] = 160.0
    return np.repeat(np.repeat(img.round().astype(np.uint8), cell, axis=0), cell, axis=1)


def table_rows(rows: list[dict]) -> tuple[list[str], list[list]]:
    """The heatmap as a table: columns and one row per layer x module."""
    layers, modules, grid = heatmap(rows)
    return ["layer", "module", "rel_fro"], [[layer, m, grid[i][j]] for i, layer in enumerate(layers)
                                            for j, m in enumerate(modules) if math.isfinite(grid[i][j])]


# ---- the recorder's side ---------------------------------------------------------------------------------------
class Report(Signal):
    """Each event's records as scalars at that event's step (after every other signal, Alerts included); `write`
    (writer rank only) hands them to `sink.log(step, scalars)` and the displacement rows to
    `sink.heatmap(step, rows)`; after the last event `sink.close()`. `skip`: streams the sink already has."""

    def __init__(self, sink, skip: tuple[str, ...] = ()):
        self.sink, self.skip = sink, tuple(skip)

    def _collect(self, rec, step: int, end: bool = False):
        out: dict[str, float] = {}
        for stream, records in rec.latest.items():
            if stream and stream not in self.skip:
                out.update(scalars(stream, records))
        alerts = rec.find(Alerts)
        for a in getattr(alerts, "new", ()):
            out[f"{PREFIX}/alerts/{a.alert}"] = 1.0
        disp = list(rec.latest.get("displacement", ())) if "displacement" not in self.skip else []
        if not (out or disp or end):
            return None
        return [{"step": step, "scalars": out, "displacement": disp, "end": end}]

    def on_train(self, rec, step, record):
        return self._collect(rec, step)

    def on_weights(self, rec, step, model, last):
        return self._collect(rec, step)

    def on_eval(self, rec, step, record, ctx):
        return self._collect(rec, step)

    def on_end(self, rec, step, ctx):
        return self._collect(rec, step, end=True)

    def write(self, run, records):
        for r in records:
            if r["scalars"]:
                self.sink.log(r["step"], r["scalars"])
            if r["displacement"]:
                self.sink.heatmap(r["step"], r["displacement"])
            if r["end"]:
                self.sink.close()


# ---- the native trainer's backends -------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet():
    """A tracker library's banners go to stderr: stdout stays the command's output."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


class TensorBoard:
    """torch.utils.tensorboard's SummaryWriter into RUN/tensorboard (or a writer given, e.g. TRL's)."""

    def __init__(self, path=None, writer=None):
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - tensorboard is an optional extra

            writer = SummaryWriter(log_dir=str(Path(path) / "tensorboard"))
        self.writer = writer

    def log(self, step, values):
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def heatmap(self, step, rows):
        _, _, grid = heatmap(rows)
        if grid:
            self.writer.add_image(HEATMAP, heatmap_image(grid), step, dataformats="HWC")
            self.writer.flush()

    def close(self):
        self.writer.close()


class Wandb:
    """wandb in offline mode, its files in RUN/wandb (`wandb sync` uploads them later); a resumed run continues
    the W&B run of its id (RUN/wandb/mechdiag-run-id)."""

    def __init__(self, path, name: str, config: dict, resume: bool = False):
        import wandb  # noqa: PLC0415 - wandb is an optional extra

        id_file = Path(path) / "wandb" / "mechdiag-run-id"
        run_id = id_file.read_text().strip() if resume and id_file.exists() else uuid.uuid4().hex[:12]
        id_file.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(id_file, run_id)
        self.wandb = wandb
        with _quiet():
            self.run = wandb.init(mode="offline", dir=str(path), project=os.environ.get("WANDB_PROJECT", PREFIX),
                                  name=name, id=run_id, resume="allow", config=config, reinit="create_new",
                                  settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))

    def log(self, step, values):
        self.run.log(dict(values), step=step)

    def heatmap(self, step, rows):
        cols, data = table_rows(rows)
        if data:
            self.run.log({HEATMAP: self.wandb.Table(columns=cols, data=data)}, step=step)

    def close(self):
        with _quiet():
            self.run.finish()


_MLFLOW_KEY = re.compile(r"[^\w./ -]")  # the characters MLflow refuses in a metric name (pass@k's "@")


def mlflow_key(key: str) -> str:
    """A key as MLflow's file store can hold it: each metric is a file, so "reward" and "reward/correctness"
    cannot both be; past mechdiag/<stream>/ a "/" becomes "." (mechdiag/metrics/reward.correctness)."""
    parts = key.split("/", 2)
    if len(parts) == 3:
        parts[2] = parts[2].replace("/", ".")
    return _MLFLOW_KEY.sub("_", "/".join(parts))


class MLflow:
    """MLflow's client on a local file store, RUN/mlruns (experiment "mechdiag"); a resumed run continues the
    MLflow run of its name."""

    def __init__(self, path, name: str, config: dict, resume: bool = False):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store on request
        from mlflow.entities import Metric, Param  # noqa: PLC0415 - mlflow is an optional extra
        from mlflow.tracking import MlflowClient  # noqa: PLC0415 - mlflow is an optional extra

        self.Metric = Metric
        self.uri = (Path(path).resolve() / "mlruns").as_uri()
        self.client = MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(PREFIX)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(PREFIX)
        earlier = self.client.search_runs([exp_id], f"attributes.run_name = '{name}'",
                                          order_by=["attributes.start_time DESC"], max_results=1) if resume else []
        if earlier:
            self.run_id = earlier[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flatten_config(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step, values):
        ms = int(time.time() * 1000)
        metrics = [self.Metric(mlflow_key(k), v, ms, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def heatmap(self, step, rows):
        cols, data = table_rows(rows)
        if data:
            self.client.log_table(self.run_id, {c: [r[i] for r in data] for i, c in enumerate(cols)},
                                  artifact_file=f"displacement/step_{step:06d}.json")

    def close(self):
        self.client.set_terminated(self.run_id)


class Trackio:
    """Trackio's local store (TRACKIO_DIR, by default ~/.cache/huggingface/trackio), project "mechdiag"."""

    def __init__(self, path, name: str, config: dict, resume: bool = False):
        import trackio  # noqa: PLC0415 - trackio is an optional extra

        self.trackio = trackio
        with _quiet():
            self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", PREFIX), name=name, config=config,
                                    resume="allow" if resume else "never", auto_log_cpu=False, auto_log_gpu=False,
                                    embed=False)

    def log(self, step, values):
        self.run.log(dict(values), step=step)

    def heatmap(self, step, rows):
        cols, data = table_rows(rows)
        if data:
            self.run.log({HEATMAP: self.trackio.Table(columns=cols, data=data)}, step=step)

    def close(self):
        with _quiet():
            if self.trackio.context_vars.current_run.get() is self.run:
                self.trackio.finish()  # also forgets it: trackio's exit hook would finish it again
            else:
                self.run.finish()


@contextlib.contextmanager
def environment(names, path):
    """TRL's report_to callbacks (`--backend trl`) writing where the native backends do: TensorBoard into
    RUN/tensorboard, W&B offline into RUN/wandb, MLflow's file store RUN/mlruns (experiment "mechdiag"); each
    through the environment variable transformers reads, restored afterwards."""
    path = Path(path).resolve()
    env = {}
    if "tensorboard" in names:
        env["TENSORBOARD_LOGGING_DIR"] = str(path / "tensorboard")
    if "wandb" in names:
        env.update(WANDB_MODE="offline", WANDB_DIR=str(path), WANDB_SILENT="true",
                   WANDB_PROJECT=os.environ.get("WANDB_PROJECT", PREFIX))
    if "mlflow" in names:
        env.update(MLFLOW_TRACKING_URI=(path / "mlruns").as_uri(), MLFLOW_ALLOW_FILE_STORE="true",
                   MLFLOW_EXPERIMENT_NAME=PREFIX)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    wandb = sys.modules.get("wandb") if "wandb" in names else None
    if wandb is not None:  # W&B reads the environment once per session: a session already set up starts anew
        wandb.teardown()
    try:
        yield
    finally:
        if "wandb" in names and "wandb" in sys.modules:  # transformers leaves W&B's run open until exit
            with _quiet():
                sys.modules["wandb"].teardown()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


OPEN = {"tensorboard": lambda path, name, config, resume: TensorBoard(path), "wandb": Wandb, "mlflow": MLflow,
        "trackio": Trackio}


class Trackers:
    """The native trainer's sink: the backends named in report_to, opened on the first record (so only the writer
    rank opens them), each getting every record; `resume`: continue the tracker runs of an earlier start."""

    def __init__(self, names, path, config: dict, resume: bool = False):
        self.names, self.path, self.config, self.resume = list(names), Path(path), config, resume
        self.backends: list | None = None

    def _open(self) -> list:
        if self.backends is None:
            self.backends = [OPEN[n](self.path, self.path.name, self.config, self.resume) for n in self.names]
        return self.backends

    def log(self, step, values):
        for b in self._open():
            b.log(step, values)

    def heatmap(self, step, rows):
        for b in self._open():
            b.heatmap(step, rows)

    def close(self):
        for b in self.backends or ():
            b.close()
        self.backends = []


# ---- TRL's report_to callbacks -------------------------------------------------------------------------------
class ReportTo:
    """The TRL path's sink for Report (MechdiagCallback.attach): mechdiag's records of step N go to each report_to
    callback through its own on_log at step N (the call TRL's logs take; TRL logs step N before that step's
    completions, evals and final diagnostics exist, so they are delivered at the next event, with the step they
    belong to). The displacement heatmap goes to TensorBoard as an image, to W&B, MLflow and Trackio as a table."""

    def __init__(self):
        self.handler, self.pending = None, []

    def attach(self, trainer, callback) -> None:
        from transformers.integrations import get_reporting_integration_callbacks  # noqa: PLC0415 - transformers' list of the report_to callbacks

        cbs = trainer.callback_handler.callbacks
        if callback in cbs:
            cbs.remove(callback)
        kinds = tuple(get_reporting_integration_callbacks(trainer.args.report_to))
        cbs.insert(next((i for i, c in enumerate(cbs) if kinds and isinstance(c, kinds)), len(cbs)), callback)
        self.handler, self.kinds = trainer.callback_handler, kinds

    def log(self, step, values):
        self.pending.append((step, values, None))

    def heatmap(self, step, rows):
        self.pending.append((step, None, rows))

    def close(self):
        """The report_to callbacks close their own runs."""

    def deliver(self, args, state, control) -> None:
        if self.handler is None or not self.pending:
            return
        todo, self.pending = self.pending, []
        for c in [c for c in self.handler.callbacks if self.kinds and isinstance(c, self.kinds)]:
            for step, values, rows in todo:
                at = copy.copy(state)
                at.global_step = step
                if values:
                    c.on_log(args, at, control, logs=dict(values))
                elif rows:
                    _heatmap(c, step, rows)


def _heatmap(callback, step: int, rows: list) -> None:
    """The displacement heatmap into the run a report_to callback opened, through that tracker's own library."""
    name = type(callback).__name__
    if name == "TensorBoardCallback" and callback.tb_writer is not None:
        TensorBoard(writer=callback.tb_writer).heatmap(step, rows)
        return
    cols, data = table_rows(rows)
    if not data:
        return
    if name == "WandbCallback":
        import wandb  # noqa: PLC0415 - wandb is an optional extra

        if wandb.run is not None:
            wandb.run.log({HEATMAP: wandb.Table(columns=cols, data=data), "train/global_step": step})
    elif name == "TrackioCallback":
        import trackio  # noqa: PLC0415 - trackio is an optional extra

        trackio.log({HEATMAP: trackio.Table(columns=cols, data=data), "train/global_step": step})
    elif name == "MLflowCallback":
        import mlflow  # noqa: PLC0415 - mlflow is an optional extra

        if mlflow.active_run() is not None:
            mlflow.flush_async_logging()  # transformers logs metrics asynchronously; log_table reads the run
            mlflow.log_table({c: [r[i] for r in data] for i, c in enumerate(cols)},
                             artifact_file=f"displacement/step_{step:06d}.json")
