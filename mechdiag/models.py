"""Load models and tokenizers: the bundled arith base, a local Hugging Face folder, or a hub name.

"bundled" is the tiny Llama shipped in mechdiag/assets/arith-base (made by scripts/make_base.py), so the
default run works offline. Only safetensors checkpoints load: a pickle (.bin/.pt) checkpoint can run code on
load, so it is refused with a line saying how to convert it.

Pad token: a tokenizer without one gets its EOS token as pad (else UNK, else BOS). Generation pads on the left
and masks the pad positions, so the choice never changes what the model sees.
"""

from __future__ import annotations

import json
from pathlib import Path

from mechdiag.errors import UserError
from mechdiag.paths import ASSETS

BUNDLED = "bundled"
TAGS = ["<reasoning>", "</reasoning>", "<answer>", "</answer>"]
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = ("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
         " \n.,:;?!+-*/=()$%'\"<>")
# Whole-word tokens for the arith vocabulary (bare and with a leading space): prompts shrink ~3x, which makes
# pre-training and GRPO rollouts faster. Everything else, digits included, stays one token per character.
TEMPLATE_WORDS = ["has", "gets", "finds", "more", "gives", "away", "loses", "ends", "up", "with", "twice", "three",
                  "times", "as", "many", "How", "does", "have"]
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.bin")


def bundled_path() -> Path:
    return ASSETS / "arith-base"


def resolve(name_or_path: str | Path, need: str = "config.json") -> str:
    """'bundled' -> the asset folder; an existing folder holding `need` -> itself; else a hub name."""
    if str(name_or_path) == BUNDLED:
        path = bundled_path()
        if not (path / "config.json").exists():
            raise UserError(f"the bundled base model is missing from {path}; reinstall mechdiag")
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


def _check_weights(folder: Path) -> None:
    if any(folder.glob("*.safetensors")):
        return
    pickled = [f for f in PICKLE_FILES if (folder / f).exists()]
    if pickled:
        raise UserError(f"{folder / pickled[0]} is a pickle checkpoint, which can run code when loaded; convert it "
                        "with `AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR, "
                        "safe_serialization=True)` in a trusted environment")
    raise UserError(f"model folder {folder} has no model.safetensors")


def word_list() -> list[str]:
    from mechdiag.tasks.arith import ITEMS, NAMES

    return list(dict.fromkeys(TEMPLATE_WORDS + NAMES + ITEMS))


def build_char_tokenizer():
    """The bundled tokenizer: one token per character, the four tags and the arith words as single tokens.

    BOS is added in front of every encoded text (training and inference alike); EOS ends a completion.

    Built with the `tokenizers` library and wrapped in PreTrainedTokenizerFast, which reloads with identical ids
    (AutoTokenizer for some model types swaps the pre-tokenizer on reload).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = sorted(word_list(), key=len, reverse=True)
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for t in [*CHARS, *words, *(" " + w for w in words)]:
        vocab.setdefault(t, len(vocab))
    # Pre-tokens: a known whole word (with its leading space), else a single character; unknown -> <unk>.
    pattern = r" ?(?<![A-Za-z])(?:" + "|".join(words) + r")(?![A-Za-z])|[\s\S]"
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False, single_word=False) for t in TAGS])
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", padding_side="left", clean_up_tokenization_spaces=False,
                                   model_max_length=512)


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


def load_tokenizer(name_or_path: str | Path = BUNDLED):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    src = resolve(name_or_path, need="tokenizer_config.json")
    try:
        if Path(src).is_dir() and (Path(src) / "tokenizer.json").exists():
            cls = _tokenizer_class(Path(src))
            tok = (PreTrainedTokenizerFast if cls == "PreTrainedTokenizerFast" else AutoTokenizer).from_pretrained(src)
        else:
            tok = AutoTokenizer.from_pretrained(src)
    except UserError:
        raise
    except Exception as e:  # corrupt json, missing files, unreachable hub
        raise UserError(f"cannot load tokenizer from {src}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                        ) from e
    return ensure_pad(tok)


def _tokenizer_class(folder: Path) -> str | None:
    try:
        return json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None


DEVICE_HELP = "auto (the GPU if there is one), cpu, cuda, cuda:N or mps"


def resolve_device(spec: str | None = "auto"):
    """The torch.device that `spec` names, checked against this machine before any model is loaded.

    "auto"/None: the first CUDA GPU, else Apple's MPS, else the CPU. A device that is not here is a UserError."""
    import torch

    s = "auto" if spec is None else str(spec).strip().lower()
    if s == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        mps = getattr(torch.backends, "mps", None)
        return torch.device("mps" if mps is not None and mps.is_available() else "cpu")
    try:
        dev = torch.device(s)
    except (RuntimeError, ValueError):
        raise UserError(f"device {spec!r} is not a device; use {DEVICE_HELP}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise UserError(f"device {spec!r}: no CUDA GPU here (torch {torch.__version__}); use --device cpu or auto")
        index = 0 if dev.index is None else dev.index
        if index >= n:
            raise UserError(f"device {spec!r}: this machine has {n} CUDA GPU(s), cuda:0 to cuda:{n - 1}")
        return torch.device("cuda", index)
    if dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise UserError(f"device {spec!r}: Apple MPS is not available here; use --device cpu or auto")
        return torch.device("mps")
    raise UserError(f"device {spec!r} is not supported; use {DEVICE_HELP}")


def load_model(name_or_path: str | Path = BUNDLED, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    src = resolve(name_or_path)
    if Path(src).is_dir():
        _check_weights(Path(src))
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise UserError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    try:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype, use_safetensors=True)
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"cannot load model from {src}: {msg}") from e
    model.eval()
    return model


def load_model_and_tokenizer(name_or_path: str | Path = BUNDLED, dtype: str = "float32"):
    tok = load_tokenizer(name_or_path)
    model = load_model(name_or_path, dtype)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    if getattr(model, "generation_config", None) is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def generate(model, tokenizer, prompts: list[str], max_new_tokens: int = 64, do_sample: bool = False,
             temperature: float = 1.0, batch_size: int = 256, generator_seed: int | None = None) -> list[str]:
    """Completions (special tokens dropped) for plain-text prompts, batched with left padding and a KV cache."""
    import torch

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
