"""Load a base/tuned pair for probing: model folders (transformers, safetensors) or PEFT adapter folders.

An adapter on the same base as the other side shares one model in memory, switched per trace
(`disable_adapter()` for the plain base, `set_adapter(name)` for an adapter); a merged or fully fine-tuned
checkpoint loads as a second model. Pickle checkpoints (.bin, .pt) are refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from mechdiag import adapters, models
from mechdiag.blocks import n_layers_of
from mechdiag.console import note
from mechdiag.errors import UserError, first_line
from mechdiag.models import adapter_context as _adapter_ctx
from mechdiag.models import load_adapters as _with_adapters
from mechdiag.probes.capture import Probe
from mechdiag.weights import ADAPTER_WEIGHTS, adapter_base, adapter_config, is_adapter, local_base, refuse_pickle


@dataclass
class Source:
    """One side of the pair: a transformers model folder, plus an optional adapter folder applied on it."""

    model_dir: Path
    adapter_dir: Path | None = None

    def __str__(self) -> str:
        return str(self.adapter_dir or self.model_dir)


def _check_model_dir(path: Path) -> None:
    if not path.is_dir():
        raise UserError(f"model folder not found: {path}")
    if not (path / "config.json").is_file():
        raise UserError(f"{path} is neither a transformers model folder (config.json) nor a PEFT adapter "
                        "(adapter_config.json)")
    if not any(path.glob("*.safetensors")):
        refuse_pickle(path)
        raise UserError(f"no .safetensors weights in {path}")


def _check_adapter_dir(path: Path) -> None:
    if not (path / ADAPTER_WEIGHTS).is_file():
        refuse_pickle(path)
        raise UserError(f"no {ADAPTER_WEIGHTS} in {path}")
    adapters.check(path, adapter_config(path))  # before any model loads


def resolve(base: str | Path, tuned: str | Path) -> tuple[Source, Source]:
    """Turn the BASE and TUNED arguments into (model folder, adapter) sources.

    A TUNED adapter is applied on BASE when BASE is a model folder; otherwise on its base_model_name_or_path.
    """
    base, tuned = Path(base), Path(tuned)
    for p in (base, tuned):
        if not p.exists():
            raise UserError(f"not found: {p}")
    if is_adapter(base):
        _check_adapter_dir(base)
        ref = Source(local_base(base), base)
    else:
        ref = Source(base)
    _check_model_dir(ref.model_dir)
    if is_adapter(tuned):
        _check_adapter_dir(tuned)
        root = ref.model_dir if ref.adapter_dir is None else (adapter_base(tuned) or ref.model_dir)
        out = Source(root, tuned)
    else:
        out = Source(tuned)
    _check_model_dir(out.model_dir)
    return ref, out


def _load(path: Path, dtype: str, device):
    return models.load_model(path, dtype).to(device).eval()


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def check_compatible(ref_cfg, tuned_cfg, ref_name: str, tuned_name: str) -> None:
    """Same architecture, depth, width and vocabulary, or a clear line saying which differs."""
    def arch(c):
        return (c.model_type, tuple(getattr(c, "architectures", None) or ()))

    checks = [("architecture", arch(ref_cfg), arch(tuned_cfg)),
              ("number of layers", n_layers_of(ref_cfg), n_layers_of(tuned_cfg)),
              ("hidden size", getattr(ref_cfg, "hidden_size", None), getattr(tuned_cfg, "hidden_size", None)),
              ("vocabulary size", getattr(ref_cfg, "vocab_size", None), getattr(tuned_cfg, "vocab_size", None))]
    for what, a, b in checks:
        if a != b:
            raise UserError(f"base and tuned differ in {what}: {a} ({ref_name}) vs {b} ({tuned_name})")


@dataclass
class Pair:
    ref: Probe
    tuned: Probe
    tokenizer: object
    ref_ctx: Callable[[], contextlib.AbstractContextManager]
    tuned_ctx: Callable[[], contextlib.AbstractContextManager]
    shared: bool  # one model in memory, adapter toggled


def load_pair(base: str | Path, tuned: str | Path, dtype: str = "float32",
              device: str | torch.device = "cpu", against: str = "original") -> Pair:
    """The two models of a comparison (against: see mechdiag.adapters)."""
    if against not in adapters.AGAINST:
        raise UserError(f"--against must be {' or '.join(adapters.AGAINST)}, not {against!r}")
    ref_src, tun_src = resolve(base, tuned)
    tok = models.load_tokenizer(ref_src.model_dir)
    for d in {tun_src.model_dir, tun_src.adapter_dir} - {None, ref_src.model_dir}:
        if _has_tokenizer(d) and models.load_tokenizer(d).get_vocab() != tok.get_vocab():
            raise UserError(f"base and tuned have different vocabularies: tokenizer of {d} differs from "
                            f"{ref_src.model_dir}")
    cfgs = [adapter_config(s.adapter_dir) for s in (ref_src, tun_src) if s.adapter_dir]
    for cfg in cfgs:
        if adapters.note(cfg, against):
            note(adapters.note(cfg, against))
    # an adapter that trains the base's own biases, or whose init rewrote the base, leaves the base changed when it
    # is disabled: the reference is then a model of its own (the residual, when asked for, is the shared one's)
    residual = against == "residual" and all(c.get("bias", "none") in (None, "none") for c in cfgs)
    if ref_src.model_dir.resolve() == tun_src.model_dir.resolve() and (
            all(adapters.scoped(c) for c in cfgs) or residual):
        loaded = {k: s.adapter_dir for k, s in (("ref", ref_src), ("tuned", tun_src)) if s.adapter_dir}
        model = _with_adapters(_load(ref_src.model_dir, dtype, device), loaded)
        probe = Probe(model)
        return Pair(probe, probe, tok, _adapter_ctx(model, "ref" if ref_src.adapter_dir else None),
                    _adapter_ctx(model, "tuned" if tun_src.adapter_dir else None), shared=True)
    try:
        cfgs = [AutoConfig.from_pretrained(s.model_dir) for s in (ref_src, tun_src)]
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"cannot read a model config: {first_line(e)}") from None
    check_compatible(*cfgs, str(ref_src), str(tun_src))
    loaded = []
    for name, src in (("ref", ref_src), ("tuned", tun_src)):
        m = _load(src.model_dir, dtype, device)
        loaded.append(_with_adapters(m, {name: src.adapter_dir}) if src.adapter_dir else m)
    return Pair(Probe(loaded[0]), Probe(loaded[1]), tok, contextlib.nullcontext, contextlib.nullcontext, shared=False)
