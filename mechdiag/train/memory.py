"""The native trainer's memory model: how many rows one update pass holds, and the step's predicted peak.

Per token of an update pass: ~4 bytes x layers x (16 hidden + 6 MLP) of saved activations (measured on Qwen2
shapes, docs/benchmarks.md). The vocabulary: the chunked head (mechdiag.vocab) holds CHUNK_LIVE float32 tensors
of one chunk at a time; a head it does not model holds LOGIT_COPIES float32 [positions, V] copies per row.

The peak of a step is the process's runtime, the weights (and a sampler or reference copy), and the largest of
its phases: the rollout's decode (its KV cache and one position's logits per row), the reference pass (no grad:
one layer's transient MLP tensors over all rows, and the cache the shared prompt grows), the update pass.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass

from mechdiag import blocks, vocab

LOGIT_COPIES = 4  # the full-logits path: logits, their float32 log-softmax, its exp and the gradient
ACT_HIDDEN, ACT_MLP = 16, 6  # saved float32 activations per token and layer, in hidden- and MLP-sized vectors
DECODE_LOGIT_COPIES = 3  # one decode position: logits, their float32 softmax and log-softmax (entropy)
REF_MLP_COPIES = 3  # the reference pass's transient MLP tensors of one layer (gate, up, their product)
RUNTIME_BYTES = 700 * 2**20  # torch, transformers, peft, the tokenizer and the task: RSS before the weights
MMAP_THRESHOLD = 64 * 2**10  # glibc serves blocks this large and larger by mmap, and unmaps them when freed
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


@dataclass(frozen=True)
class Shape:
    """What a step's memory depends on: the model config's sizes and the batch's."""

    layers: int
    hidden: int
    mlp: int
    vocab: int
    kv_width: int  # key + value features per token and layer (2 x KV heads x head dim)
    rows: int
    prompt: int  # prompt positions (padded width)
    completion: int  # completion positions (padded width)
    chunked: bool  # the head is a vocab.Head: log-probs a chunk of positions at a time

    @classmethod
    def of(cls, config, rows: int, prompt: int, completion: int, chunked: bool) -> Shape:
        c = getattr(config, "text_config", None) or config
        heads = getattr(c, "num_attention_heads", 1)
        head_dim = getattr(c, "head_dim", None) or getattr(c, "hidden_size", 0) // max(heads, 1)
        kv = getattr(c, "num_key_value_heads", None) or heads
        hidden = getattr(c, "hidden_size", 0) or 0
        # the MLP width under its family's name; None in some configs (GPT-Neo, GPT-J: 4 x hidden by default)
        mlp = next((v for k in ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
                    if isinstance(v := getattr(c, k, None), int)), 4 * hidden)
        return cls(blocks.n_layers_of(c) or 1, hidden, mlp, getattr(c, "vocab_size", 0), 2 * kv * head_dim, rows,
                   prompt, completion, chunked)

    @property
    def width(self) -> int:
        return self.prompt + self.completion


def shape_of(model, roll) -> Shape:
    """The Shape of a rollout's update under `model` (rows, padded prompt and completion widths)."""
    return Shape.of(model.config, len(roll), roll.prompt_ids.size(1), roll.completion_ids.size(1),
                    vocab.head_of(model) is not None)


def row_bytes(s: Shape) -> int:
    """One row's update pass outside the chunked head's own chunk."""
    per_token = 4 * s.layers * (ACT_HIDDEN * s.hidden + ACT_MLP * s.mlp)
    out = per_token * s.width
    if not s.chunked:
        out += LOGIT_COPIES * 4 * s.vocab * s.completion
    return out


def chunk_bytes(s: Shape) -> int:
    """The chunked head's live float32 tensors (CHUNK_LIVE of one chunk), 0 outside it."""
    if not s.chunked:
        return 0
    return vocab.CHUNK_LIVE * 4 * s.vocab * min(vocab.chunk_positions(s.vocab), s.rows * s.width)


def rows_per_pass(s: Shape, weights_bytes: int) -> int:
    """The rows whose update pass fits in half the weights' bytes (at least 256 MiB), the chunk taken off first."""
    budget = max(weights_bytes // 2, 256 * 2**20) - chunk_bytes(s)
    return max(1, int(budget // max(row_bytes(s), 1)))


def predicted_peak(s: Shape, model_bytes: int, per_pass: int, elem: int = 4) -> dict:
    """The step's predicted peak RSS and its parts (bytes): model_bytes = weights + sampler + reference copy,
    per_pass = the update's rows per pass, elem = the weights' element size (the KV cache's)."""
    decode = s.rows * s.width * s.layers * s.kv_width * elem + DECODE_LOGIT_COPIES * 4 * s.rows * s.vocab
    reference = (REF_MLP_COPIES * 4 * s.rows * s.width * s.mlp + s.rows * s.width * s.layers * s.kv_width * elem
                 + chunk_bytes(s))
    update = min(per_pass, s.rows) * row_bytes(s) + chunk_bytes(s)
    phases = {"rollout_phase_bytes": decode, "reference_phase_bytes": reference, "update_phase_bytes": update}
    return {"predicted_peak_bytes": RUNTIME_BYTES + model_bytes + max(phases.values()), **phases}


def release_freed_blocks(threshold: int = MMAP_THRESHOLD) -> bool:
    """Make glibc return freed tensor memory to the OS: blocks of `threshold` bytes and more are mmapped and
    unmapped on free. Glibc's default threshold rises to each freed block's size (up to 32 MiB), so a decode
    loop's growing KV caches and per-position logits end up in the heap, which keeps them after they are freed
    (at Qwen2.5-0.5B's config the process grew ~2 GiB above its live tensors, docs/benchmarks.md). True when set;
    False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))
