"""Model I/O, the one home for it: every model form a command accepts, tokenizers, PEFT adapters, devices.

A model argument is `bundled` (or `bundled:deep`), a named real model (`smollm2-135m-instruct`, `gemma3-270m`) or
a GGUF file (both converted once by mechdiag.realmodels), a Hugging Face model folder (or hub name), a PEFT adapter
folder, or a mechdiag run directory (its final/; a checkpoint with `checkpoint=N`); `checkpoint_folder` turns any
of them into a folder.

"bundled" is the tiny Llama shipped in mechdiag/assets/arith-base (made by scripts/make_base.py), so the
default run works offline; "bundled:deep" is its 8-layer sibling in mechdiag/assets/arith-deep
(docs/base-model.md). Only safetensors checkpoints load: a pickle (.bin/.pt) checkpoint can run code on load, so
it is refused with a line saying how to convert it.

Pad token: a tokenizer without one gets its EOS token as pad (else UNK, else BOS). Generation pads on the left
and masks the pad positions, so the choice never changes what the model sees.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path

import torch
from peft import PeftModel
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from mechdiag import adapters as adapter_forms
from mechdiag import realmodels
from mechdiag.console import note
from mechdiag.errors import UserError, first_line
from mechdiag.paths import ASSETS
from mechdiag.run import find_checkpoint, is_run_dir
from mechdiag.weights import ADAPTER_WEIGHTS, adapter_config, is_adapter, local_base, refuse_pickle

BUNDLED = "bundled"
BUNDLED_ASSETS = {BUNDLED: "arith-base", "bundled:deep": "arith-deep"}  # name -> folder under mechdiag/assets


def bundled_path(name: str = BUNDLED) -> Path:
    return ASSETS / BUNDLED_ASSETS[name]


def resolve(name_or_path: str | Path, need: str = "config.json") -> str:
    """'bundled' (or 'bundled:deep') -> the asset folder; an existing folder holding `need` -> itself; else a
    hub name."""
    if str(name_or_path) in BUNDLED_ASSETS:
        path = bundled_path(str(name_or_path))
        if not (path / "config.json").exists():
            raise UserError(f"the bundled base model {name_or_path} is missing from {path}; reinstall mechdiag")
        return str(path)
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"model {path} is a file; give the folder holding config.json and model.safetensors")
        if not (path / need).exists():
            raise UserError(f"model folder {path} has no {need}")
        return str(path)
    if str(name_or_path).startswith((".", "/", "~")) or str(name_or_path).count("/") > 1:
        raise UserError(f"model folder {name_or_path} does not exist")
    return str(name_or_path)  # hub name (needs network or the local HF cache)


# a family's name for the positions it was built for (attribute_map gives GPT-2's n_positions, GPT-J's, CodeGen's,
# DBRX's max_seq_len as max_position_embeddings); MPT says max_seq_len, ChatGLM / Qwen-1 seq_length
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "seq_length")


def context_length(config) -> int | None:
    """The positions a model was built for: learned position tables end there (an index past them crashes), rotary
    and sinusoidal ones were trained up to it (past it, output is extrapolation). None for a family without one
    (Bloom's ALiBi) or a config that is not there."""
    text = getattr(config, "text_config", None) or config
    for key in _CONTEXT_KEYS:
        v = getattr(text, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _config_of(name_or_path: str | Path, local_only: bool = False):
    """The transformers config of a model argument (bundled, a model, adapter or run folder), from its config.json
    alone: known before any weight is loaded. None when it cannot be read (the load reports that, in one line).
    local_only: a Hub name only from the local cache, never the network."""
    from transformers import AutoConfig  # noqa: PLC0415 - the config only

    try:
        folder = checkpoint_folder(name_or_path)
        if is_adapter(folder):
            folder = local_base(folder)
        return AutoConfig.from_pretrained(resolve(folder if folder.exists() else name_or_path),
                                          local_files_only=local_only)
    except Exception:  # noqa: BLE001 - a bad model is reported by the load that follows
        return None


def context_of(name_or_path: str | Path) -> int | None:
    """context_length of a model argument (None when its config cannot be read)."""
    config = _config_of(name_or_path)
    return None if config is None else context_length(config)


def layers_of(name_or_path: str | Path, local_only: bool = False) -> int | None:
    """The number of transformer layers of a model argument (None when its config does not say)."""
    config = _config_of(name_or_path, local_only)
    n = getattr(getattr(config, "text_config", config), "num_hidden_layers", None)
    return n if isinstance(n, int) else None


def fit_prompt_budget(context: int | None, max_prompt: int | None, max_new: int, prompt_name: str = "max_prompt_tokens",
                      new_name: str = "max_completion_tokens") -> int | None:
    """The prompt budget (prompts keep their last tokens) that keeps prompt + completion inside the model's
    context: `max_prompt` where it fits (None: no cut, no context), else context - max_new, said in a note on
    stderr when the user's budget is the one cut (None means "what fits"). UserError when the completion budget
    alone leaves no room for a prompt."""
    if context is None:
        return max_prompt
    if max_new >= context:
        raise UserError(f"{new_name}={max_new} leaves no room for a prompt in the model's context of {context} "
                        f"positions (prompt + completion must fit in it); set {new_name} below {context}")
    room = context - max_new
    if max_prompt is None:
        return room
    if max_prompt > room:
        note(f"prompts keep their last {room} tokens: the model's context is {context} positions and "
             f"{new_name}={max_new}, so {prompt_name}={max_prompt} does not fit")
        return room
    return max_prompt


def fit_to_context(cfg) -> int | None:
    """A training config's prompt budget fitted to its model's context (fit_prompt_budget: rollouts and held-out
    evals decode max_completion_tokens after prompts cut to cfg.max_prompt_tokens), before the model loads; the
    run's config.yaml then holds the budget that ran; a forget probe's continuation length that leaves no prompt
    room fails here too (the probe cuts its prompts itself). Returns the context (None: no limit known)."""
    context = context_of(cfg.model.name_or_path)
    cfg.max_prompt_tokens = fit_prompt_budget(context, cfg.max_prompt_tokens, cfg.max_completion_tokens)
    if cfg.record.forget_prompts:
        fit_prompt_budget(context, None, cfg.record.forget_tokens, new_name="record.forget_tokens")
    return context


def _check_weights(folder: Path) -> None:
    if any(folder.glob("*.safetensors")):
        return
    refuse_pickle(folder)
    raise UserError(f"model folder {folder} has no model.safetensors")


def checkpoint_folder(arg: str | Path, checkpoint: int | None = None) -> Path:
    """The folder behind a model argument: `bundled` (or `bundled:deep`), a named real model or a GGUF file (its
    converted folder, realmodels.folder), a model or adapter folder, or a run
    directory (its final/, else its last complete checkpoint; `checkpoint=N` picks checkpoints/step-N). Other paths
    pass through."""
    if str(arg) in BUNDLED_ASSETS:
        return Path(resolve(str(arg)))
    if realmodels.is_source(arg):  # smollm2-135m-instruct, gemma3-270m, a .gguf file: its converted folder
        if checkpoint is not None:
            raise UserError(f"{arg}: --checkpoint needs a run directory")
        return realmodels.folder(arg)
    path = Path(arg).expanduser()
    own = (path / "config.json").is_file() or is_adapter(path)  # a model of its own wins
    kept = (path / "final").is_dir() or (path / "checkpoints").is_dir()  # what is left of a copied run
    if not path.is_dir() or own or not (is_run_dir(path) or kept):
        if checkpoint is not None:
            raise UserError(f"{arg}: --checkpoint needs a run directory")
        return path
    return find_checkpoint(path, checkpoint)


def load_adapters(model, adapters: dict[str, Path]):
    """`model` with each PEFT adapter loaded under its name (one PeftModel; switch with set_adapter). An init that
    rewrote the base (PiSSA, OLoRA, LoftQ) is run again by peft as it loads, so the model is the residual plus the
    adapter (mechdiag.adapters); forms that cannot be measured are refused with mechdiag.adapters.check's line."""

    out = model
    for path in adapters.values():  # a form that cannot be measured: the line displacement gives
        adapter_forms.check(path, adapter_config(path))
    for name, path in adapters.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # peft reads a deprecated transformers attribute
                if hasattr(out, "peft_config"):
                    out.load_adapter(str(path), adapter_name=name)
                else:
                    out = PeftModel.from_pretrained(out, str(path), adapter_name=name)
        except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
            raise UserError(f"cannot load adapter {path}: {first_line(e)}") from None
    return out.eval()


def load_adapter_weights(peft_model, folder: Path) -> None:
    """A saved adapter's factors (folder/adapter_model.safetensors) into `peft_model`, whose adapter has the same
    targets: a native run's resume, its final adapter in `mechdiag attribute`; one UserError line when the file is
    damaged or does not fit."""
    try:
        adapter_forms.set_factors(peft_model, load_file(Path(folder) / ADAPTER_WEIGHTS))
    except Exception as e:  # noqa: BLE001 - a damaged or mismatched file raises many types
        raise UserError(f"cannot load {Path(folder) / ADAPTER_WEIGHTS}: {first_line(e)}") from None


def adapter_context(model, name: str | None):
    """A context factory that runs `model` as the plain base (name None) or with adapter `name` active."""
    if not hasattr(model, "peft_config"):
        return contextlib.nullcontext
    if name is None:
        return model.disable_adapter

    @contextlib.contextmanager
    def ctx():
        prev = model.active_adapter
        model.base_model.set_adapter(name)
        try:
            yield
        finally:
            model.base_model.set_adapter(prev)

    return ctx


_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def reference_context(model, ref_model):
    """The reference policy: the frozen copy if there is one, else the model with its adapter disabled."""
    if ref_model is not None:
        return ref_model, contextlib.nullcontext()
    return model, model.disable_adapter()


def device(spec: str | None = "auto") -> str:
    """auto (a CUDA GPU when there is one, else Apple's mps, else the CPU), cpu, cuda, cuda:N or mps, checked to
    exist here."""
    spec = spec or "auto"
    if not _DEVICE.fullmatch(spec):
        raise UserError(f"--device {spec}: use auto, cpu, cuda, cuda:N or mps")
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    try:
        torch.empty(0, device=spec)
    except (RuntimeError, AssertionError, ValueError) as e:
        raise UserError(f"--device {spec}: not usable here ({first_line(e)})"
                        ) from None
    return spec


def ensure_pad(tokenizer):
    """Give a tokenizer without a pad token one (EOS, else UNK, else BOS); pad on the left for generation."""
    if tokenizer.pad_token is None:
        for name in ("eos_token", "unk_token", "bos_token"):
            if getattr(tokenizer, name) is not None:
                tokenizer.pad_token = getattr(tokenizer, name)
                break
        else:
            raise UserError("tokenizer has no pad, eos, unk or bos token to pad with")
    tokenizer.padding_side = "left"
    return tokenizer


def pad_id(tokenizer) -> int:
    """Id used for padding; only ever masked, so eos or unk serve when the tokenizer has no pad token."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id):
        if tid is not None:
            return int(tid)
    return 0


def eos_ids(model, tokenizer) -> list[int]:
    ids = getattr(model.config, "eos_token_id", None)
    ids = ids if isinstance(ids, list) else [ids]
    ids = [i for i in (*ids, tokenizer.eos_token_id) if i is not None]
    return sorted(set(int(i) for i in ids))


TAIL_CHARS_PER_TOKEN = 8  # a first guess at the characters an over-long prompt's kept tokens span


def tail_ids(tokenizer, text: str, n: int) -> list[int]:
    """The last n ids of `text`'s encoding, without encoding all of a very long text: the ids of two suffixes of
    it, one twice the other, must agree on their last n (so the cut no longer reaches them), else the suffixes
    double, up to the whole text. Equal to tokenizer(text)["input_ids"][-n:] (tests/test_models.py)."""
    size = TAIL_CHARS_PER_TOKEN * n
    while 2 * size < len(text):
        short, long_ = (tokenizer(text[-k:])["input_ids"] for k in (size, 2 * size))
        if len(short) > n and short[-n:] == long_[-n:]:
            return short[-n:]
        size *= 2
    return tokenizer(text)["input_ids"][-n:]


def encode_prompts(tokenizer, prompts: list[str], max_prompt_tokens: int | None = None):
    """Left-padded (ids, mask); over-long prompts keep their end (the question and the answer cue)."""
    if max_prompt_tokens:
        rows = [tail_ids(tokenizer, p, max_prompt_tokens) for p in prompts]
    else:
        rows = [tokenizer(p)["input_ids"] for p in prompts]
    width = max(len(r) for r in rows)
    pid = pad_id(tokenizer)
    ids = torch.full((len(rows), width), pid, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


def load_tokenizer(name_or_path: str | Path = BUNDLED, checkpoint: int | None = None):
    """The tokenizer of any model form; an adapter folder without one uses its base's."""

    folder = checkpoint_folder(name_or_path, checkpoint)
    if is_adapter(folder) and not (folder / "tokenizer_config.json").exists():
        folder = local_base(folder)
    src = resolve(folder if folder.exists() else name_or_path, need="tokenizer_config.json")
    try:
        if Path(src).is_dir() and (Path(src) / "tokenizer.json").exists():
            # the folder's tokenizer.json exactly as shipped: AutoTokenizer may swap in the config's class, which
            # rebuilds the pipeline from vocab/merges (Qwen2Tokenizer on another family's file drops every space)
            tok = PreTrainedTokenizerFast.from_pretrained(src)
            _check_as_shipped(tok, Path(src) / "tokenizer.json")
        else:
            tok = AutoTokenizer.from_pretrained(src)
    except UserError:
        raise
    except Exception as e:  # corrupt json, missing files, unreachable hub
        raise UserError(f"cannot load tokenizer from {src}: {first_line(e)}"
                        ) from e
    return ensure_pad(tok)


_PROBE_TEXT = "Hello world, 12 + 30 = 42.\n  def f(x):\treturn x  # done"


def _check_as_shipped(tok, path: Path) -> None:
    """The loaded tokenizer encodes as the tokenizers library encodes the file itself."""
    from tokenizers import Tokenizer  # noqa: PLC0415 - only folders that ship tokenizer.json need it

    want = Tokenizer.from_file(str(path)).encode(_PROBE_TEXT, add_special_tokens=False).ids
    got = tok(_PROBE_TEXT, add_special_tokens=False)["input_ids"]
    if got != want:
        raise UserError(f"{path}: the loaded tokenizer encodes differently from the file itself ({len(got)} vs "
                        f"{len(want)} ids on a probe text)")


def load_model(name_or_path: str | Path = BUNDLED, dtype: str = "float32", checkpoint: int | None = None):
    """Any model form in eval mode; a PEFT adapter (or a LoRA run's final/) comes merged into its base."""

    hf_logging.disable_progress_bar()
    folder = checkpoint_folder(name_or_path, checkpoint)
    if is_adapter(folder):
        return load_adapters(load_model(local_base(folder), dtype), {"default": folder}).merge_and_unload().eval()
    src = resolve(folder if folder.exists() else name_or_path)
    if Path(src).is_dir():
        _check_weights(Path(src))
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise UserError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    try:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype, use_safetensors=True)
    except Exception as e:
        raise UserError(f"cannot load model from {src}: {first_line(e)}") from e
    model.eval()
    return model


def load_model_and_tokenizer(name_or_path: str | Path = BUNDLED, dtype: str = "float32",
                             checkpoint: int | None = None, tokenizer=None):
    """(model, tokenizer) of a model argument; `tokenizer`: its tokenizer, already loaded with load_tokenizer."""
    tok = tokenizer if tokenizer is not None else load_tokenizer(name_or_path, checkpoint)
    model = load_model(name_or_path, dtype, checkpoint)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    if getattr(model, "generation_config", None) is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def generate(model, tokenizer, prompts: list[str], max_new_tokens: int = 64, do_sample: bool = False,
             temperature: float = 1.0, batch_size: int = 256, generator_seed: int | None = None) -> list[str]:
    """Completions (special tokens dropped) for plain-text prompts, batched with left padding and a KV cache."""
    out = []
    if generator_seed is not None:
        torch.manual_seed(generator_seed)
    for i in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[i:i + batch_size], return_tensors="pt", padding=True)
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=do_sample,
                                 temperature=temperature if do_sample else None, top_p=None, top_k=None,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        out += tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return out
