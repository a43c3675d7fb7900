"""Checkpoint sources and tensor naming.

A source is anything a user points at: a Hugging Face model folder (one file or shards + index), a single
.safetensors file, or a PEFT LoRA adapter folder on top of a base. Each source is opened as a `Side`: for every
tensor name it gives where the dense weight lives (file + key, read lazily, row chunk by row chunk, through
safetensors' memory map) and the LoRA factors to add on top (kept as factors, never multiplied out).
Pickle checkpoints are refused: nothing here unpickles.

Every tensor name maps to (layer, module): layer is the transformer block index (None outside the blocks),
module the projection / norm / embedding name as the model family spells it (q_proj, c_attn, query_key_value...).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from mechdiag import adapters
from mechdiag.errors import UserError, first_line
from mechdiag.parts import experts_in_out

INDEX_NAME = "model.safetensors.index.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
CONVERT_HINT = ("convert it once, in an environment you trust, with "
                "`AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT)` (writes .safetensors)")

# --- naming -----------------------------------------------------------------------------------------------------

# The block index is the first numeric path component in every family (model.layers.N, transformer.h.N,
# gpt_neox.layers.N, model.decoder.layers.N; mechdiag.blocks finds the same blocks in a model in memory).
_LAYER_RE = re.compile(r"(?:^|\.)(\d+)\.")
# Module names that one family uses twice inside a block: qualify them with their parent (GPT-2 attn/mlp c_proj).
_AMBIGUOUS = {"c_proj"}
_SHARED_EXPERT = ("shared_expert", "shared_experts")  # Qwen2-MoE, DeepSeek: a dense expert beside the routed ones
_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")
# Non-parameter buffers some checkpoints carry: not weights, never compared.
_BUFFERS = re.compile(r"(\.rotary_emb\.inv_freq|\.attn\.masked_bias|\.attn\.bias)$")
_LM_HEADS = ("lm_head.weight", "embed_out.weight")
_EMBEDDINGS = ("model.embed_tokens.weight", "transformer.wte.weight", "gpt_neox.embed_in.weight",
               "embed_tokens.weight", "wte.weight")


def tensor_site(name: str, experts: bool = False) -> tuple[int | None, str]:
    """(layer index or None, module name) of a tensor name, e.g. model.layers.3.mlp.up_proj.weight -> (3, up_proj).
    A mixture-of-experts' expert tensors (mlp.experts.5.gate_proj, or the fused 3-D mlp.experts.gate_up_proj) are
    one module, experts.gate_proj, aggregated over the experts; experts=True keeps each: experts.5.gate_proj. A
    shared expert is shared_expert.gate_proj; the router keeps the family's name (gate, router)."""
    m = _LAYER_RE.search(name)
    layer = int(m.group(1)) if m else None
    rest = name[m.end():] if m else name
    parts = rest.split(".")
    if len(parts) > 1 and parts[-1] in ("weight", "bias"):
        parts = parts[:-1]
    module = parts[-1] if parts else name
    if "experts" in parts[:-1]:
        i = parts.index("experts")
        expert = parts[i + 1] if i + 2 < len(parts) and parts[i + 1].isdigit() else None
        return layer, ".".join(["experts", *([expert] if experts and expert else []), module])
    if len(parts) > 1 and parts[-2] in _SHARED_EXPERT:
        return layer, f"{parts[-2]}.{module}"
    if module in _AMBIGUOUS and len(parts) > 1:
        module = f"{parts[-2]}.{module}"
    return layer, module


def expert_index(name: str) -> int | None:
    """The expert of a per-expert tensor name (model.layers.0.mlp.experts.5.up_proj.weight -> 5), else None."""
    m = _EXPERT_RE.search(name)
    return int(m.group(1)) if m else None


def is_buffer(name: str, shape: tuple[int, ...]) -> bool:
    return bool(_BUFFERS.search(name)) and (not name.endswith(".attn.bias") or len(shape) == 4)


# --- dense tensors in safetensors files -----------------------------------------------------------------------------


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class _File:
    """One safetensors file: its validated header and a copy-on-write memory map of it (never written to)."""

    def __init__(self, path: str):
        self.header, self.data_start = _read_header(path)
        try:
            self.handle = safe_open(path, framework="pt")  # the reference parser agrees the file is well formed
        except SafetensorError as e:
            raise UserError(f"{path}: not a valid safetensors file ({first_line(e, 160)})") from None
        with open(path, "rb") as f:
            # ACCESS_COPY makes the buffer writable for torch.frombuffer; we never write, so pages stay the file's
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)

    def keys(self) -> list[str]:
        return [k for k in self.header if k != "__metadata__"]


class SafeFiles:
    """Open safetensors files once each. Tensors (or row ranges) are zero-copy views of the memory map: reading
    costs page faults only, and the pages belong to the page cache, not to this process."""

    def __init__(self):
        self._files: dict[str, _File] = {}

    def file(self, path: str) -> _File:
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = _File(path)
        return f

    def keys(self, path: str) -> list[str]:
        return self.file(path).keys()

    def _info(self, ref: TensorRef) -> dict:
        """The header entry of the tensor ref points at; for one expert of a stack, that expert's shape and bytes."""
        try:
            info = self.file(ref.path).header[ref.key]
        except KeyError:
            raise UserError(f"{ref.path}: no tensor {ref.key}") from None
        if ref.expert is None:
            return info
        shape, (b, e) = info["shape"], info["data_offsets"]
        if len(shape) != 3 or not 0 <= ref.expert < shape[0]:
            raise UserError(f"{ref.path}: tensor {ref.key} {shape} has no expert {ref.expert}")
        per = (e - b) // shape[0]
        return {"dtype": info["dtype"], "shape": shape[1:],
                "data_offsets": [b + ref.expert * per, b + (ref.expert + 1) * per]}

    def shape(self, ref: TensorRef | ConcatRef) -> tuple[int, ...]:
        if isinstance(ref, ConcatRef):
            shapes = [self.shape(p) for p in ref.parts]
            return (sum(s[0] for s in shapes), *shapes[0][1:])
        shape = tuple(self._info(ref)["shape"])
        return shape[::-1] if ref.transposed else shape

    def dtype(self, ref: TensorRef | ConcatRef) -> str:
        return self._info(ref.parts[0] if isinstance(ref, ConcatRef) else ref)["dtype"]

    def span(self, ref: TensorRef) -> tuple[object, int, str, int]:
        """(buffer, byte offset, dtype, element count) of the whole tensor in its file's memory map."""
        info, f = self._info(ref), self.file(ref.path)
        return f.mm, f.data_start + info["data_offsets"][0], info["dtype"], math.prod(info["shape"])

    def read(self, ref: TensorRef | ConcatRef, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows start:stop (all when None) of the tensor, as a read-only view of the file's pages (a copy of the
        rows of a ConcatRef's parts)."""
        if isinstance(ref, ConcatRef):
            start, stop = start or 0, self.shape(ref)[0] if stop is None else stop
            pieces, row = [], 0
            for p in ref.parts:
                n = self.shape(p)[0]
                lo, hi = max(start - row, 0), min(stop - row, n)
                if lo < hi or not pieces:
                    pieces.append(self.read(p, lo, max(lo, hi)))
                row += n
            return torch.cat(pieces)
        if ref.transposed:  # an [in, out] expert read as [out, in]: rows of the transpose, a strided view
            whole = self.read(TensorRef(ref.path, ref.key, ref.expert)).T
            return whole if start is None else whole[start:stop]
        info = self._info(ref)
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise UserError(f"{ref.path}: tensor {ref.key} has unsupported dtype {info['dtype']}")
        shape = list(info["shape"])
        rows = shape[0] if shape else 1
        start, stop = (0, rows) if start is None else (start, min(stop, rows))
        row_elems = math.prod(shape[1:]) if shape else 1
        count = (stop - start) * row_elems
        out_shape = [stop - start, *shape[1:]] if shape else []
        if count == 0:
            return torch.empty(out_shape, dtype=dtype)
        item = torch.empty((), dtype=dtype).element_size()
        buf, offset = self.span(ref)[:2]
        offset += start * row_elems * item
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(out_shape)


def _read_header(path: str) -> tuple[dict, int]:
    """The header and where the data starts, checked against the file size: safetensors trusts the offsets, so a
    truncated file is caught here, before any tensor is touched."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("file shorter than its header")
            n = int.from_bytes(head, "little")
            if n <= 0 or 8 + n > size:
                raise ValueError("header length beyond end of file")
            header = json.loads(f.read(n))
        data_len = size - 8 - n
        for k, v in header.items():
            if k == "__metadata__":
                continue
            b, e = v["data_offsets"]
            if e > data_len:
                raise ValueError(f"truncated: tensor {k} ends at byte {8 + n + e}, file has {size}")
            dtype = _DTYPES.get(v["dtype"])
            if not 0 <= b <= e or (dtype is not None and e - b != math.prod(v["shape"]) * dtype.itemsize):
                raise ValueError(f"tensor {k}: {e - b} bytes do not hold shape {v['shape']} {v['dtype']}")
        return header, 8 + n
    except (ValueError, KeyError, TypeError, OSError, AttributeError) as e:
        raise UserError(f"{path}: not a valid safetensors file ({first_line(e, 160)})") from None


@dataclass(frozen=True)
class TensorRef:
    """Where a dense tensor lives. Two refs that are equal hold the same bytes (used to skip base == base).
    expert: one expert [e] of a 3-D expert stack (contiguous in the file), read as a tensor of its own;
    transposed: that expert of a stack stored [E, in, out] (GPT-OSS) read as its transpose, out x in as a Linear's
    weight and every other family's expert (a 2-D [in, out] expert, so shape and parts read the output rows)."""
    path: str
    key: str
    expert: int | None = None
    transposed: bool = False


@dataclass(frozen=True)
class ConcatRef:
    """Tensors stacked along their rows, read as one: an expert's saved gate_proj and up_proj as the
    gate_up_proj [2I, H] that a LoRA on the expert stack adapts (equal refs, equal bytes, as for TensorRef)."""
    parts: tuple[TensorRef, ...]


@dataclass
class LoraFactor:
    """One low-rank term s * B @ A in the stored tensor's orientation (B: out x r, A: r x in)."""
    scale: float
    B: torch.Tensor
    A: torch.Tensor


class Delta:
    """A float64 addition to a dense tensor that is not low-rank (a peft form replayed by mechdiag.adapters, the
    rows trainable tokens replace), computed when first read and released after its tensor's row."""

    def __init__(self, compute):
        self._compute, self._value = compute, None

    def whole(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._compute()
        return self._value

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.whole()[start:stop]

    def release(self) -> None:
        self._value = None

    def restrict(self, idx: torch.Tensor, axis: int) -> Delta:
        return Delta(lambda: self.whole().index_select(axis, idx))


class RowsDelta(Delta):
    """Rows `idx` of an n-row tensor moved by `values` (float64), every other row unchanged: trainable tokens."""

    def __init__(self, idx: torch.Tensor, values: torch.Tensor, n: int):
        super().__init__(lambda: self.rows(0, n))
        self.idx, self.values = idx, values

    def rows(self, start: int, stop: int) -> torch.Tensor:
        out = torch.zeros((stop - start, *self.values.shape[1:]), dtype=torch.float64)
        sel = (self.idx >= start) & (self.idx < stop)
        out[self.idx[sel] - start] = self.values[sel]
        return out


@dataclass
class Entry:
    dense: TensorRef
    lora: list[LoraFactor] = field(default_factory=list)
    delta: Delta | None = None  # a form that is not low-rank: tuned = dense + LoRA terms + delta


@dataclass
class Side:
    """One side of a comparison: effective tensor = dense + sum of LoRA terms, for every name."""
    label: str
    entries: dict[str, Entry]
    config: dict
    is_adapter: bool = False
    # an adapter's parameter LoRA names its experts as the model does: new name -> [(saved name, expert or None,
    # read transposed)] (regroup)
    regroup: dict[str, list[tuple[str, int | None, bool]]] = field(default_factory=dict)
    # against="residual": the reference's own delta per name (the residual an init left), applied to the base side
    reference: dict[str, Delta] = field(default_factory=dict)
    note: str | None = None  # the one line said about this side (an init that rewrote the base)


# --- opening sources --------------------------------------------------------------------------------------------


def _safetensors_files(folder: Path, files: SafeFiles) -> dict[str, str]:
    """key -> file for a model folder: the shard index when present, else the single file or all *.safetensors."""
    index = folder / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{index}: not a valid shard index ({first_line(e, 160)})") from None
        missing = sorted({f for f in weight_map.values() if not (folder / f).exists()})
        if missing:
            raise UserError(f"{folder}: shard {missing[0]} listed in {INDEX_NAME} is missing")
        return {k: str(folder / f) for k, f in weight_map.items()}
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        refuse_pickle(folder)
        raise UserError(f"{folder}: not a checkpoint (no *.safetensors, no {INDEX_NAME}, no {ADAPTER_CONFIG})")
    out: dict[str, str] = {}
    for f in found:
        for k in files.keys(str(f)):
            out[k] = str(f)
    return out


def _read_config(folder: Path) -> dict:
    cfg = folder / "config.json"
    if not cfg.exists():
        return {}
    try:
        return json.loads(cfg.read_text())
    except ValueError:
        raise UserError(f"{cfg}: not valid JSON") from None


def open_dense(path: str | os.PathLike, files: SafeFiles) -> Side:
    """A model folder (single file or shards) or one .safetensors file."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: no such file or folder")
    if p.is_file():
        if p.suffix in PICKLE_SUFFIXES:
            raise UserError(f"{p}: pickle checkpoint refused (unpickling runs code); " + CONVERT_HINT)
        if p.suffix != ".safetensors":
            raise UserError(f"{p}: not a checkpoint (expected a .safetensors file or a model folder)")
        keys = {k: str(p) for k in files.keys(str(p))}
        config = _read_config(p.parent)
    else:
        keys = _safetensors_files(p, files)
        config = _read_config(p)
    entries = {}
    for k, f in keys.items():
        ref = TensorRef(os.path.realpath(f), k)
        if is_buffer(k, files.shape(ref)):
            continue
        entries[k] = Entry(ref)
    return Side(str(p), entries, config)


def refuse_pickle(folder: str | os.PathLike) -> None:
    """Refuse a folder whose weights are pickle files (.bin/.pt/.pkl...): loading one can run code. Callers call it
    when they found no safetensors weights."""
    folder = Path(folder)
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES) if folder.is_dir() else []
    if pickles:
        raise UserError(f"{folder}: {pickles[0]} is a pickle checkpoint, refused (unpickling runs code); "
                        + CONVERT_HINT)


def is_adapter(path: str | os.PathLike) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | os.PathLike) -> Path | None:
    """The adapter's base_model_name_or_path when it is a local folder (absolute or relative to it), else None."""
    base = adapter_config(Path(path)).get("base_model_name_or_path")
    if base and Path(base).is_dir():
        return Path(base)
    if base and (Path(path) / base).is_dir():
        return Path(path) / base
    return None


def local_base(adapter: str | os.PathLike) -> Path:
    """adapter_base, or one clear line when the adapter names no local base."""
    base = adapter_base(adapter)
    if base is None:
        raise UserError(f"the base model of adapter {adapter} is not a local folder (base_model_name_or_path)")
    return base


def adapter_config(folder: str | os.PathLike) -> dict:
    """An adapter folder's adapter_config.json (one clear line when it is unreadable or not JSON)."""
    folder = Path(folder)
    try:
        return json.loads((folder / ADAPTER_CONFIG).read_text())
    except ValueError:
        raise UserError(f"{folder / ADAPTER_CONFIG}: not valid JSON") from None
    except OSError as e:
        raise UserError(f"unreadable {folder / ADAPTER_CONFIG}: {first_line(e)}") from None


def _pattern_value(patterns: dict, module_path: str, default):
    """PEFT's rule (peft.utils.other.get_pattern_key): the first pattern key matching the end of the module path."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return value
    return default


_ADAPTER_KEY = re.compile(r"^(?P<path>.+)\.(?P<kind>lora_A\.weight|lora_B\.weight|lora_embedding_A|lora_embedding_B)$")
_TOKENS = ".token_adapter.trainable_tokens_delta"


def canonical_key(key: str) -> tuple[str | None, bool]:
    """(the name a saved adapter key stands for, whether it is a base-layer copy). peft saves without the adapter
    name; a raw state dict keeps it (lora_A.default.weight, modules_to_save.default.weight): both read the same.
    A modules_to_save copy is the module's own tensor; its original_module copy is the base (None: skipped)."""
    name = re.sub(r"\.default(?=\.|$)", "", key.removeprefix("base_model.model."))
    if ".original_module." in name:
        return None, False
    name = name.replace(".modules_to_save.", ".")
    base_copy = name.endswith((".base_layer.weight", ".base_layer.bias"))  # not a parameter LoRA's nested wrapper
    return (name.replace(".base_layer.", ".") if base_copy else name), base_copy


def _peft_prefix(cfg: dict) -> str:
    from peft.mapping import PEFT_TYPE_TO_PREFIX_MAPPING  # noqa: PLC0415 - peft loads with the first adapter

    return PEFT_TYPE_TO_PREFIX_MAPPING.get(cfg.get("peft_type", "LORA"), "lora_")


def _module_of(name: str, prefix: str) -> tuple[str, str] | None:
    """(module path, peft parameter name) of an adapter tensor name, or None for a full tensor of the model."""
    parts = name.split(".")
    for i, p in enumerate(parts[1:], 1):
        if p.startswith(prefix):
            return ".".join(parts[:i]), ".".join(parts[i:])
    return None


def _token_indices(cfg: dict, module: str) -> list[int]:
    spec = cfg.get("trainable_token_indices")
    if isinstance(spec, dict):
        for k, v in spec.items():
            if module == k or module.endswith("." + k):
                return list(v)
        raise UserError(f"trainable tokens on {module}, which trainable_token_indices {spec} does not name")
    return list(spec or [])


def open_adapter(path: str | os.PathLike, base: Side, files: SafeFiles, against: str = "original") -> Side:
    """A PEFT adapter on `base`. Plain LoRA: each adapted weight is base + s * B @ A (kept as factors). Every
    other form (mechdiag.adapters): each adapted module's float64 delta from peft's own algebra, computed when its
    tensor is compared. Full tensors (modules_to_save, bias="all") replace the base's; trainable tokens replace
    their rows. against="residual": an init that rewrote the base is measured against the residual it left (the
    reference's own delta, in `reference`)."""
    folder = Path(path)
    cfg = adapter_config(folder)
    adapters.check(folder, cfg)
    if against not in adapters.AGAINST:
        raise UserError(f"--against must be {' or '.join(adapters.AGAINST)}, not {against!r}")
    wfile = folder / ADAPTER_WEIGHTS
    if not wfile.exists():
        if any((folder / n).exists() for n in ("adapter_model.bin", "adapter_model.pt")):
            raise UserError(f"{folder}: adapter_model.bin is a pickle checkpoint, refused; load it with peft in an "
                            "environment you trust and save_pretrained() it again (writes adapter_model.safetensors)")
        raise UserError(f"{folder}: adapter folder without {ADAPTER_WEIGHTS}")
    wpath = os.path.realpath(wfile)
    r_default, alpha_default = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    rslora, fan_in_fan_out = bool(cfg.get("use_rslora")), bool(cfg.get("fan_in_fan_out"))
    plain, prefix = adapters.is_plain_lora(cfg), _peft_prefix(cfg)

    entries = {k: Entry(e.dense, list(e.lora)) for k, e in base.entries.items()}
    config = dict(base.config)
    # A tied base's output head is its embedding (`tied_head`): an update of the head changes that one tensor, as
    # merge_and_unload does; a modules_to_save copy of the head unties it (a head of its own, as merged saves it).
    tied_head = tied_embedding(base)
    factors: dict[str, dict[str, torch.Tensor]] = {}  # plain LoRA: module -> its factors
    replayed: dict[str, dict[str, str]] = {}  # other forms: module -> {saved name: file key}
    shared: dict[str, torch.Tensor] = {}  # tensors of no module (VeRA's shared projections)
    tokens: dict[str, str] = {}  # module -> its trainable tokens' rows
    tied_copies: dict[str, str] = {}  # a tied base's head or embedding saved as a modules_to_save copy
    for key in files.keys(wpath):
        name, base_copy = canonical_key(key)
        if name is None:
            continue
        if name.endswith(_TOKENS):
            tokens[name.removesuffix(_TOKENS)] = key
            continue
        if name.startswith("base_model."):
            shared[key] = files.read(TensorRef(wpath, key)).clone()
            continue
        site = _module_of(name, prefix)
        if site is None:  # modules_to_save / bias copies / a saved base layer: a full replacement tensor
            if tied_head is not None and name in (*_LM_HEADS, tied_head) and not base_copy:
                tied_copies[name] = key  # a copy of one side of the tied pair: _tied_copies
                continue
            if name in _LM_HEADS and tied_head is not None:  # the tied embedding's bytes, saved again
                continue
            if name not in entries:
                raise UserError(f"{folder}: adapter tensor {key} has no counterpart in the base {base.label}")
            entries[name].dense = TensorRef(wpath, key)
            entries[name].lora = []
            continue
        mod, param = site
        if plain:
            factors.setdefault(mod, {})[param] = files.read(TensorRef(wpath, key)).clone()
        else:
            replayed.setdefault(mod, {})[name] = key

    if tied_copies:
        _tied_copies(cfg, base, entries, config, tied_head, {n: TensorRef(wpath, k) for n, k in tied_copies.items()})

    def target_of(mod: str) -> str:
        target = mod + ".weight"
        if tied_head is not None and target in _LM_HEADS and target not in entries:
            target = tied_head  # the head of a tied base is its embedding
        if target not in entries:
            raise UserError(f"{folder}: adapter targets {target}, which the base {base.label} does not have")
        return target

    reference: dict[str, Delta] = {}
    if replayed:
        if cfg.get("target_parameters"):
            raise UserError(f"{folder}: target_parameters with {cfg.get('peft_type', 'LORA')} "
                            f"{'(DoRA) ' if cfg.get('use_dora') else ''}is not supported (plain LoRA only)")
        replay = adapters.Replay(folder, cfg, shared)
        for mod, saved in replayed.items():
            target, bias = target_of(mod), mod + ".bias"
            has_bias = bias in entries and not (tied_head is not None and target == tied_head)
            if any(n.endswith(".lora_B.bias") for n in saved) and not has_bias:
                raise UserError(f"{folder}: lora_bias on {mod}, whose base layer has no bias: the adapter adds a "
                                "bias the base does not have (peft cannot merge it either); train without lora_bias")
            run = _replay_call(replay, files, mod, entries[target].dense, entries[bias].dense if has_bias else None,
                               {n: TensorRef(wpath, k) for n, k in saved.items()})
            entries[target].delta = Delta(lambda run=run: run()[0])
            if has_bias:
                entries[bias].delta = Delta(lambda run=run: run()[1])
            if against == "residual" and adapters.rewriting_init(cfg):
                reference[target] = Delta(lambda run=run: run()[2])
    for mod, key in tokens.items():
        target = target_of(mod)
        idx = torch.tensor(_token_indices(cfg, mod), dtype=torch.long)
        rows = files.read(TensorRef(wpath, key)).to(torch.float64)
        shape = files.shape(entries[target].dense)
        if rows.shape != (len(idx), *shape[1:]) or (len(idx) and int(idx.max()) >= shape[0]):
            raise UserError(f"{folder}: trainable tokens of {mod} ({tuple(rows.shape)}, indices "
                            f"{idx.tolist()[:8]}) do not fit {target} {tuple(shape)}")
        old = torch.stack([files.read(entries[target].dense, int(i), int(i) + 1)[0].to(torch.float64) for i in idx]) \
            if len(idx) else rows
        entries[target].delta = RowsDelta(idx, rows - old, shape[0])

    plan: dict[str, list[tuple[str, int | None, bool]]] = {}  # expert tensors renamed as the model names them
    for mod, f in factors.items():
        if _targets_parameter(mod, cfg.get("target_parameters"), entries):
            _parameter_lora(folder, cfg, mod, {k: v for k, v in f.items()}, entries, files, plan, config)
            continue
        target = target_of(mod)
        if "lora_A.weight" in f and "lora_B.weight" in f:
            A, B, embedding = f["lora_A.weight"], f["lora_B.weight"], False
        elif "lora_embedding_A" in f and "lora_embedding_B" in f:
            A, B, embedding = f["lora_embedding_A"], f["lora_embedding_B"], True
        else:
            raise UserError(f"{folder}: adapter module {mod} has only one of its two LoRA factors")
        r = A.shape[0]
        if B.shape[1] != r:
            raise UserError(f"{folder}: adapter module {mod}: lora_B {tuple(B.shape)} does not match lora_A "
                            f"{tuple(A.shape)}")
        r_cfg = _pattern_value(cfg.get("rank_pattern"), mod, r_default)
        if r_cfg != r:
            raise UserError(f"{folder}: adapter module {mod} has rank {r} but its config says {r_cfg}")
        alpha = _pattern_value(cfg.get("alpha_pattern"), mod, alpha_default)
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        # Stored orientation: Linear weight is out x in = B @ A; Conv1D (fan_in_fan_out) and Embedding store the
        # transpose, (B @ A)^T = A^T @ B^T, so the factors swap roles.
        if embedding or fan_in_fan_out:
            B, A = A.T.contiguous(), B.T.contiguous()
        shape = files.shape(entries[target].dense)
        if (B.shape[0], A.shape[1]) != tuple(shape):
            raise UserError(f"{folder}: adapter delta for {target} is {B.shape[0]}x{A.shape[1]}, base weight is "
                            f"{'x'.join(map(str, shape))}")
        entries[target].lora.append(LoraFactor(scale, B, A))
    _check_vocabulary(folder, base, entries, config, files)
    return Side(str(folder), entries, config, is_adapter=True, regroup=plan, reference=reference,
                note=adapters.note(cfg, against))


def _tied_copies(cfg: dict, base: Side, entries: dict[str, Entry], config: dict, embedding: str,
                 copies: dict[str, TensorRef]) -> None:
    """modules_to_save copies of a tied base's head or embedding, as peft leaves the model: with
    ensure_weight_tying the copy is the one tied tensor (the model stays tied); without it, the copy unties the
    pair, the other side keeping the base's tensor (an lm_head row against the base's embedding)."""
    head_name = next((h for h in _LM_HEADS if h in copies), "embed_out.weight" if embedding.startswith("gpt_neox")
                     else "lm_head.weight")
    head, emb = copies.get(head_name), copies.get(embedding)
    if cfg.get("ensure_weight_tying"):
        entries[embedding] = Entry(emb or head)
        return
    if emb is not None:
        entries[embedding] = Entry(emb)
    entries[head_name] = Entry(head or base.entries[embedding].dense)
    config["tie_word_embeddings"] = False


def _check_vocabulary(folder: Path, base: Side, entries: dict[str, Entry], config: dict, files: SafeFiles) -> None:
    """An adapter that resized the vocabulary must hold both of an untied model's resized tensors: peft saves the
    embedding it adapted, and a head it did not train is not in the files (its added rows are unknown)."""
    emb = next((e for e in _EMBEDDINGS if e in entries), None)
    head = next((h for h in _LM_HEADS if h in entries), None)
    if config.get("tie_word_embeddings") or emb is None or head is None or head not in base.entries:
        return
    rows = [files.shape(entries[n].dense)[0] for n in (emb, head)]
    if rows[0] != rows[1] and files.shape(base.entries[emb].dense)[0] == files.shape(base.entries[head].dense)[0]:
        raise UserError(f"{folder}: the adapter resized {emb} to {rows[0]} rows but holds no {head} of that size (the "
                        f"head's added rows are not saved); save it with modules_to_save=['{head.split('.')[0]}']")


def _replay_call(replay, files: SafeFiles, mod: str, weight: TensorRef, bias: TensorRef | None,
                 saved: dict[str, TensorRef]):
    """The replay of one module, read from the files when first called (its weight and bias share one call)."""
    def run():
        return replay.delta(mod, files.read(weight).clone(), None if bias is None else files.read(bias).clone(),
                            {n: files.read(r).clone() for n, r in saved.items()})
    return run


# A stacked expert parameter and the per-expert tensors transformers saves it as, in the stack's output order
# (transformers' conversion_mapping: qwen2_moe's family gate_proj + up_proj, Mixtral's w1 + w3, concatenated).
_STACK_SOURCES = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}


def _targets_parameter(mod: str, targets, entries: dict) -> bool:
    """Whether adapter module `mod` is peft's ParamWrapper: its path (one .base_layer per parameter nested on the
    same module) and a parameter of it are a target_parameters entry (peft's rule: the key or its end). A module
    the base holds as a Linear (its .weight) has no parameter but weight and bias: peft >= 0.22 saves a bare
    "down_proj" for qwen2_moe's expert stacks, which is not the shared expert's down_proj Linear."""
    unwrapped = mod.replace(".base_layer", "")
    linear = unwrapped + ".weight" in entries
    for t in targets or ():
        owner, _, param = t.rpartition(".")
        if linear and param not in ("weight", "bias"):
            continue
        if not owner or unwrapped == owner or unwrapped.endswith("." + owner):
            return True
    return False


def regroup(entries: dict[str, Entry], plan: dict[str, list[tuple[str, int | None, bool]]]) -> None:
    """Rename saved tensors as the model's parameters: each new name is the saved tensors listed (one expert of a
    3-D stack when the expert is set, read transposed when the flag is), stacked by rows (ConcatRef), their LoRA
    terms kept; the saved names go. A side without all of a group's tensors keeps them as they are."""
    gone = set()
    for new, olds in plan.items():
        if not all(o in entries for o, _, _ in olds) or olds == [(new, None, False)]:
            continue
        refs = [entries[o].dense if e is None else TensorRef(entries[o].dense.path, entries[o].dense.key, e, t)
                for o, e, t in olds]
        lora = [f for o, _, _ in olds for f in entries[o].lora]
        if lora and len(olds) > 1:  # rows of several LoRA'd tensors are not one pair of factors
            raise UserError(f"{olds[0][0]}: carries LoRA of its own and is also part of {new}")
        gone.update(o for o, _, _ in olds)
        entries[new] = Entry(refs[0] if len(refs) == 1 else ConcatRef(tuple(refs)), lora)
    for o in gone - set(plan):
        entries.pop(o, None)


def _parameter_lora(folder: Path, cfg: dict, mod: str, f: dict, entries: dict, files: SafeFiles,
                    plan: dict[str, list[tuple[str, int | None, bool]]], model_config: dict) -> None:
    """LoRA on a parameter (peft's target_parameters: an expert stack [E, out, in], a router's weight), put on the
    tensors the base files hold, as factors. peft's layout: lora_A (E*r, in) and lora_B (out, r*E) give expert e
    A_e = A.reshape(E, r, in)[e], B_e = B.reshape(out, r, E)[:, :, e]; its update is s B_e A_e, the stack stored
    [E, out, in] (transformers 5's experts). A stack stored [E, in, out] (GPT-OSS: the shapes tell, a square one
    its family, mechdiag.parts.experts_in_out) holds the transpose: its experts are read transposed, out x in like
    every other. Each expert is one entry named as the model names it (model.layers.0.mlp.experts.5.gate_up_proj
    .weight, as lora_rows records it): the files' stack split per expert, or the expert's saved tensors (gate_proj
    and up_proj, Mixtral's block_sparse_moe w1 and w3) stacked by rows (`plan`, applied to the other side too)."""
    if "lora_A.weight" not in f or "lora_B.weight" not in f:
        raise UserError(f"{folder}: adapter parameter {mod} has only one of its two LoRA factors")
    A, B = f["lora_A.weight"], f["lora_B.weight"]
    owner = mod.replace(".base_layer", "")
    out_f, in_f = B.shape[0], A.shape[1]
    m = _LAYER_RE.search(owner)
    layer_prefix = owner[:m.end()] if m else ""
    last = owner.rsplit(".", 1)[-1]
    names = [t.rpartition(".")[2] for t in cfg.get("target_parameters") or ()
             if _targets_parameter(mod, [t], entries)]
    fits = []  # (parameter, layout, tensor names) whose shape takes this pair of factors
    for param in dict.fromkeys(names):
        key = f"{owner}.{param}"
        if key not in entries:  # a renamed owner in the files (Mixtral: mlp.gate -> block_sparse_moe.gate)
            near = [k for k in entries if k.startswith(layer_prefix) and k.endswith(f".{last}.{param}")]
            key = near[0] if len(near) == 1 else key
        if key in entries:
            shape = files.shape(entries[key].dense)
            if len(shape) == 2 and tuple(shape) == (out_f, in_f):
                fits.append((param, "matrix", [key]))
            elif len(shape) == 3 and tuple(shape[1:]) in ((out_f, in_f), (in_f, out_f)):
                in_out = tuple(shape[1:]) != (out_f, in_f) or (out_f == in_f and experts_in_out(model_config))
                fits.append((param, "stack_t" if in_out else "stack", [key]))
            continue
        for sources in _STACK_SOURCES.get(param, ()):
            found = sorted(k for k in entries if k.startswith(layer_prefix)
                           and re.search(rf"\.{re.escape(last)}\.0\.{sources[0]}\.weight$", k))
            if len(found) != 1:
                continue
            saved = found[0][:-len(f"0.{sources[0]}.weight")]
            E = 0
            while f"{saved}{E}.{sources[0]}.weight" in entries:
                E += 1
            keys = [[f"{saved}{e}.{src}.weight" for src in sources] for e in range(E)]
            if all(k in entries for ks in keys for k in ks):
                rows = [files.shape(entries[k].dense) for k in keys[0]]
                if sum(r[0] for r in rows) == out_f and all(r[1] == in_f for r in rows):
                    fits.append((param, "experts", [k for ks in keys for k in ks]))
    if len(fits) != 1:
        what = "no tensor of" if not fits else f"{len(fits)} parameters ({', '.join(p for p, _, _ in fits)}) of"
        raise UserError(f"{folder}: adapter parameter LoRA at {mod} ({out_f}x{in_f} per expert) fits {what} the "
                        f"base (target_parameters {cfg.get('target_parameters')})")
    param, layout, keys = fits[0]
    r = _pattern_value(cfg.get("rank_pattern"), f"{owner}.{param}", cfg.get("r", 8))
    alpha = _pattern_value(cfg.get("alpha_pattern"), f"{owner}.{param}", cfg.get("lora_alpha", 8))
    E = A.shape[0] // r if r else 0
    if not E or A.shape[0] != E * r or B.shape[1] != r * E:
        raise UserError(f"{folder}: adapter parameter {mod}: lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} "
                        f"do not hold rank {r} per expert")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    A3, B3 = A.reshape(E, r, in_f), B.reshape(out_f, r, E)
    if layout == "matrix":  # a router's weight (E = 1): named as the model names it (mlp.gate.weight)
        group = {f"{owner}.{param}": [(keys[0], None, False)]}
    elif layout == "experts":  # per expert and source (gate_proj, up_proj): stacked by rows, as the stack holds them
        per = len(keys) // E
        if per * E != len(keys):
            raise UserError(f"{folder}: adapter parameter {mod} has {E} experts, the base {len(keys)} tensors")
        group = {f"{owner}.{e}.{param}.weight": [(k, None, False) for k in keys[e * per:(e + 1) * per]]
                 for e in range(E)}
    else:
        if files.shape(entries[keys[0]].dense)[0] != E:
            raise UserError(f"{folder}: adapter parameter {mod} has {E} experts, {keys[0]} has "
                            f"{files.shape(entries[keys[0]].dense)[0]}")
        group = {f"{owner}.{e}.{param}.weight": [(keys[0], e, layout == "stack_t")] for e in range(E)}
    plan.update(group)
    regroup(entries, group)
    for e, new in enumerate(group):
        Be, Ae = B3[:, :, e].contiguous(), A3[e]
        if layout == "matrix":
            Be, Ae = B, A
        entries[new].lora.append(LoraFactor(scale, Be, Ae))


def open_side(path: str | os.PathLike, files: SafeFiles, base: str | os.PathLike | None = None,
              other: str | os.PathLike | None = None, against: str = "original") -> Side:
    """Open a checkpoint; an adapter goes on --base, else its local base_model_name_or_path, else the other side
    when that is a dense checkpoint (against: open_adapter)."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: no such file or folder")
    if not is_adapter(p):
        return open_dense(p, files)
    base_path = base or adapter_base(p) or (other if other is not None and not is_adapter(other) else None)
    if base_path is None:
        cfg = adapter_config(p)
        raise UserError(f"{p}: adapter base {cfg.get('base_model_name_or_path')!r} is not a local folder; "
                        "pass --base BASE_DIR")
    if is_adapter(base_path):
        raise UserError(f"{base_path}: the base of an adapter must be a full checkpoint, not another adapter")
    return open_adapter(p, open_dense(base_path, files), files, against)


def architecture(side: Side) -> str | None:
    cfg = side.config
    arch = cfg.get("architectures") or []
    return cfg.get("model_type") or (arch[0] if arch else None)


def is_tied(side: Side) -> bool:
    return bool(side.config.get("tie_word_embeddings", False))


def tied_embedding(side: Side) -> str | None:
    """The embedding a tied side's output head is (its name in side.entries), or None when the side is untied.
    A tied side that saved a copy of the head anyway still has the embedding as its head."""
    if not is_tied(side):
        return None
    return next((e for e in _EMBEDDINGS if e in side.entries), None)


def lm_head_names() -> tuple[str, ...]:
    return _LM_HEADS


def embedding_names() -> tuple[str, ...]:
    return _EMBEDDINGS
