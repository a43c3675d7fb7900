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
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from mechdiag.errors import UserError

INDEX_NAME = "model.safetensors.index.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
CONVERT_HINT = ("convert it once, in an environment you trust, with "
                "`AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT)` (writes .safetensors)")

# --- naming -----------------------------------------------------------------------------------------------------

# Block containers across families: model.layers.N (Llama, Mistral, Qwen2/3, Gemma, Phi-3), transformer.h.N
# (GPT-2), gpt_neox.layers.N (GPT-NeoX), and the generic blocks.N / layer.N.
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")
# Module names that one family uses twice inside a block: qualify them with their parent (GPT-2 attn/mlp c_proj).
_AMBIGUOUS = {"c_proj"}
# Non-parameter buffers some checkpoints carry: not weights, never compared.
_BUFFERS = re.compile(r"(\.rotary_emb\.inv_freq|\.attn\.masked_bias|\.attn\.bias)$")
_LM_HEADS = ("lm_head.weight", "embed_out.weight")
_EMBEDDINGS = ("model.embed_tokens.weight", "transformer.wte.weight", "gpt_neox.embed_in.weight",
               "embed_tokens.weight", "wte.weight")


def tensor_site(name: str) -> tuple[int | None, str]:
    """(layer index or None, module name) of a tensor name, e.g. model.layers.3.mlp.up_proj.weight -> (3, up_proj)."""
    m = _LAYER_RE.search(name)
    layer = int(m.group(1)) if m else None
    rest = name[m.end():] if m else name
    parts = rest.split(".")
    if len(parts) > 1 and parts[-1] in ("weight", "bias"):
        parts = parts[:-1]
    module = parts[-1] if parts else name
    if module in _AMBIGUOUS and len(parts) > 1:
        module = f"{parts[-2]}.{module}"
    return layer, module


def is_buffer(name: str, shape: tuple[int, ...]) -> bool:
    return bool(_BUFFERS.search(name)) and (not name.endswith(".attn.bias") or len(shape) == 4)


# --- dense tensors in safetensors files -----------------------------------------------------------------------------


class SafeFiles:
    """Open safetensors files once each; read whole tensors or row ranges through the memory map."""

    def __init__(self):
        self._handles: dict[str, object] = {}

    def handle(self, path: str):
        h = self._handles.get(path)
        if h is None:
            h = _open_safetensors(path)
            self._handles[path] = h
        return h

    def shape(self, ref: TensorRef) -> tuple[int, ...]:
        return tuple(self.handle(ref.path).get_slice(ref.key).get_shape())

    def dtype(self, ref: TensorRef) -> str:
        return self.handle(ref.path).get_slice(ref.key).get_dtype()

    def read(self, ref: TensorRef, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows start:stop (all when None) of the tensor; a truncated file surfaces here as a UserError."""
        try:
            if start is None:
                return self.handle(ref.path).get_tensor(ref.key)
            return self.handle(ref.path).get_slice(ref.key)[start:stop]
        except (SafetensorError, RuntimeError, ValueError, OSError) as e:
            raise UserError(f"{ref.path}: cannot read tensor {ref.key} ({_short(e)}); the file is corrupt") from None


def _short(e: Exception) -> str:
    return str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__


def _open_safetensors(path: str):
    p = Path(path)
    size = p.stat().st_size
    # safetensors trusts the header's offsets; check them against the file size so a truncated file is caught now.
    try:
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("file shorter than its header")
            n = int.from_bytes(head, "little")
            if n <= 0 or 8 + n > size:
                raise ValueError("header length beyond end of file")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"truncated: data needs {8 + n + end} bytes, file has {size}")
        return safe_open(str(p), framework="pt")
    except (SafetensorError, ValueError, KeyError, TypeError, OSError) as e:
        raise UserError(f"{path}: not a valid safetensors file ({_short(e)})") from None


@dataclass(frozen=True)
class TensorRef:
    """Where a dense tensor lives. Two refs that are equal hold the same bytes (used to skip base == base)."""
    path: str
    key: str


@dataclass
class LoraFactor:
    """One low-rank term s * B @ A in the stored tensor's orientation (B: out x r, A: r x in)."""
    scale: float
    B: torch.Tensor
    A: torch.Tensor


@dataclass
class Entry:
    dense: TensorRef
    lora: list[LoraFactor] = field(default_factory=list)


@dataclass
class Side:
    """One side of a comparison: effective tensor = dense + sum of LoRA terms, for every name."""
    label: str
    entries: dict[str, Entry]
    config: dict
    is_adapter: bool = False


# --- opening sources --------------------------------------------------------------------------------------------


def _safetensors_files(folder: Path) -> dict[str, str]:
    """key -> file for a model folder: the shard index when present, else the single file or all *.safetensors."""
    index = folder / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{index}: not a valid shard index ({_short(e)})") from None
        missing = sorted({f for f in weight_map.values() if not (folder / f).exists()})
        if missing:
            raise UserError(f"{folder}: shard {missing[0]} listed in {INDEX_NAME} is missing")
        return {k: str(folder / f) for k, f in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise UserError(f"{folder}: {pickles[0]} is a pickle checkpoint, refused (unpickling runs code); "
                            + CONVERT_HINT)
        raise UserError(f"{folder}: not a checkpoint (no *.safetensors, no {INDEX_NAME}, no {ADAPTER_CONFIG})")
    out: dict[str, str] = {}
    for f in files:
        for k in _open_safetensors(str(f)).keys():
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
        keys = {k: str(p) for k in files.handle(str(p)).keys()}
        config = _read_config(p.parent)
    else:
        keys = _safetensors_files(p)
        config = _read_config(p)
    entries = {}
    for k, f in keys.items():
        ref = TensorRef(os.path.realpath(f), k)
        if is_buffer(k, files.shape(ref)):
            continue
        entries[k] = Entry(ref)
    return Side(str(p), entries, config)


def is_adapter(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and (p / ADAPTER_CONFIG).exists()


def adapter_base(path: str | os.PathLike) -> str | None:
    """The adapter's base_model_name_or_path when it is a local folder, else None."""
    cfg = _adapter_config(Path(path))
    base = cfg.get("base_model_name_or_path")
    if base and Path(base).is_dir():
        return base
    if base and (Path(path) / base).is_dir():
        return str(Path(path) / base)
    return None


def _adapter_config(folder: Path) -> dict:
    try:
        return json.loads((folder / ADAPTER_CONFIG).read_text())
    except ValueError:
        raise UserError(f"{folder / ADAPTER_CONFIG}: not valid JSON") from None


def _pattern_value(patterns: dict, module_path: str, default):
    """PEFT's rule (peft.utils.other.get_pattern_key): the first pattern key matching the end of the module path."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return value
    return default


_ADAPTER_KEY = re.compile(r"^(?P<path>.+)\.(?P<kind>lora_A\.weight|lora_B\.weight|lora_embedding_A|lora_embedding_B|"
                          r"base_layer\.weight|lora_B\.bias|lora_magnitude_vector(?:\.weight)?)$")


def open_adapter(path: str | os.PathLike, base: Side, files: SafeFiles) -> Side:
    """PEFT LoRA adapter on `base`: each adapted weight is base + s * B @ A (kept as factors)."""
    folder = Path(path)
    cfg = _adapter_config(folder)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{folder}: peft_type {cfg.get('peft_type')} is not supported (LoRA adapters only)")
    if cfg.get("use_dora"):
        raise UserError(f"{folder}: DoRA adapters are not supported (the update is not low-rank)")
    wfile = folder / ADAPTER_WEIGHTS
    if not wfile.exists():
        if any((folder / n).exists() for n in ("adapter_model.bin", "adapter_model.pt")):
            raise UserError(f"{folder}: adapter_model.bin is a pickle checkpoint, refused; load it with peft in an "
                            "environment you trust and save_pretrained() it again (writes adapter_model.safetensors)")
        raise UserError(f"{folder}: adapter folder without {ADAPTER_WEIGHTS}")
    wpath = os.path.realpath(wfile)
    h = files.handle(wpath)
    r_default, alpha_default = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    rslora, fan_in_fan_out = bool(cfg.get("use_rslora")), bool(cfg.get("fan_in_fan_out"))

    entries = {k: Entry(e.dense, list(e.lora)) for k, e in base.entries.items()}
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key in h.keys():
        name = key.removeprefix("base_model.model.")
        m = _ADAPTER_KEY.match(name)
        if m is None:  # modules_to_save / trainable copies: a full replacement tensor
            if name not in entries:
                raise UserError(f"{folder}: adapter tensor {key} has no counterpart in the base {base.label}")
            entries[name].dense = TensorRef(wpath, key)
            entries[name].lora = []
            continue
        mod, kind = m.group("path"), m.group("kind")
        if kind.startswith("lora_magnitude"):
            raise UserError(f"{folder}: DoRA adapters are not supported (the update is not low-rank)")
        if kind == "lora_B.bias":
            raise UserError(f"{folder}: lora_bias adapters are not supported")
        if kind == "base_layer.weight":  # saved embedding base copy
            entries.setdefault(mod + ".weight", Entry(TensorRef(wpath, key))).dense = TensorRef(wpath, key)
            continue
        factors.setdefault(mod, {})[kind] = h.get_tensor(key)

    for mod, f in factors.items():
        target = mod + ".weight"
        if target not in entries:
            raise UserError(f"{folder}: adapter targets {target}, which the base {base.label} does not have")
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
    return Side(str(folder), entries, dict(base.config), is_adapter=True)


def open_side(path: str | os.PathLike, files: SafeFiles, base: str | os.PathLike | None = None,
              other: str | os.PathLike | None = None) -> Side:
    """Open a checkpoint; an adapter goes on --base, else its local base_model_name_or_path, else the other side
    when that is a dense checkpoint."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: no such file or folder")
    if not is_adapter(p):
        return open_dense(p, files)
    base_path = base or adapter_base(p) or (other if other is not None and not is_adapter(other) else None)
    if base_path is None:
        cfg = _adapter_config(p)
        raise UserError(f"{p}: adapter base {cfg.get('base_model_name_or_path')!r} is not a local folder; "
                        "pass --base BASE_DIR")
    if is_adapter(base_path):
        raise UserError(f"{base_path}: the base of an adapter must be a full checkpoint, not another adapter")
    return open_adapter(p, open_dense(base_path, files), files)


def architecture(side: Side) -> str | None:
    cfg = side.config
    arch = cfg.get("architectures") or []
    return cfg.get("model_type") or (arch[0] if arch else None)


def is_tied(side: Side) -> bool:
    return bool(side.config.get("tie_word_embeddings", False))


def lm_head_names() -> tuple[str, ...]:
    return _LM_HEADS


def embedding_names() -> tuple[str, ...]:
    return _EMBEDDINGS
