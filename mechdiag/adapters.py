"""What an adapter does to each weight: the one definition of "the tuned weights" for every peft form.

A plain LoRA module (peft_type LORA, no DoRA, no lora_bias) is base + s B A, kept as its factors everywhere
(mechdiag.weights reads them from the files, mechdiag.displacement.lora_rows from a model in memory). Every other
form is measured from peft's own algebra, one module at a time in float64: the module is rebuilt alone (its base
weight and bias in a skeleton at the same path, so the config's target rules match as in the model), peft injects
its layer, the saved tensors load, and peft merges; tuned - base is the module's delta (`module_delta`, the same
routine the trainer's records run on a live layer). This covers DoRA, lora_bias, AdaLoRA, LoHa, LoKr, IA3, VeRA,
OFT, BOFT, HRA, MiSS, FourierFT and every other peft type whose layers merge.

Inits that rewrite the base (PiSSA, OLoRA; LoftQ where peft can run it: a GPU with bitsandbytes) are replayed in
the skeleton exactly as peft runs them when it loads the adapter, so the tuned weights are residual + update and
the default reference is the original base; `against="residual"` measures against the residual instead (the update
alone). A form that cannot be measured exactly gets one line (`check`), the same from every command.
"""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import torch
from torch import nn

from mechdiag.errors import UserError, first_line

_F64 = torch.float64
# inits that subtract their starting product from the base (the residual is what the adapter was trained on)
_REWRITING = ("pissa", "olora", "corda", "loftq", "lora_ga")
# prompt-learning types: virtual tokens or prefixes, no weight of the model changes
_PROMPT_TYPES = {"PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "MULTITASK_PROMPT_TUNING", "ADAPTION_PROMPT", "CPT"}
AGAINST = ("original", "residual")
CONVERT = ("save it once with peft's save_pretrained(OUT, path_initial_model_for_weight_conversion=INIT_DIR), "
           "which writes it as a plain LoRA on the original base")


def rewriting_init(cfg: dict) -> str | None:
    """The init that rewrote the base (pissa, pissa_niter_16, olora, corda, loftq, lora_ga), else None."""
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_REWRITING):
        return init
    return None


def scoped(cfg: dict) -> bool:
    """Whether disabling the adapter gives the base back: not after an init that rewrote the base (the residual
    is left), nor with bias="all" / "lora_only" (peft trains the base layers' own biases)."""
    return rewriting_init(cfg) is None and cfg.get("bias", "none") in (None, "none")


_PLAIN_FLAGS = ("use_rslora", "use_label_mask")  # use_* settings that leave the update s B A
_INIT_CONFIGS = ("loftq_config", "eva_config", "corda_config", "lora_ga_config")  # set the start, not the update


def is_plain_lora(cfg: dict) -> bool:
    """Plain LoRA: every module is base + s B A, exact from its factors. Any LoRA variant (use_dora, use_qalora,
    use_bdlora..., lora_bias, alora_invocation_tokens) goes through peft's own algebra instead."""
    variant = any(v for k, v in cfg.items() if (k.startswith("use_") and k not in _PLAIN_FLAGS)
                  or (k.endswith("_config") and k not in _INIT_CONFIGS))  # arrow_config, monteclora_config...
    return (cfg.get("peft_type", "LORA") == "LORA" and not variant and not cfg.get("lora_bias")
            and not cfg.get("alora_invocation_tokens") and rewriting_init(cfg) is None
            and not cfg.get("layer_replication"))


def check(folder: str | Path, cfg: dict) -> None:
    """One line naming a form that cannot be measured exactly, and what would make it measurable; the same line
    from displacement, shift, attribute and eval (mechdiag.models.load_adapters calls it too)."""
    kind = cfg.get("peft_type", "LORA")
    if kind in _PROMPT_TYPES:
        raise UserError(f"{folder}: {kind} adapters add virtual tokens and change no weight of the model; mechdiag "
                        "measures tuned weights and the activations they cause (a LoRA-family adapter)")
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING  # noqa: PLC0415 - peft loads with the first adapter

    if kind not in PEFT_TYPE_TO_CONFIG_MAPPING:
        import peft  # noqa: PLC0415

        raise UserError(f"{folder}: peft_type {kind} is unknown to the installed peft {peft.__version__}; install "
                        "the peft that wrote it")
    init = rewriting_init(cfg) or ""
    if init.startswith("pissa_niter"):
        raise UserError(f"{folder}: init {init} rewrote the base with a randomized SVD that cannot be recomputed, "
                        f"so its tuned weights are unknown; {CONVERT}")
    if init.startswith(("corda", "lora_ga")):
        raise UserError(f"{folder}: init {init} rewrote the base from calibration data that is not saved, so its "
                        f"tuned weights are unknown; {CONVERT}")
    if init == "loftq" and not _loftq_runs():
        raise UserError(f"{folder}: init loftq rewrote the base with bitsandbytes' quantization, which peft runs "
                        f"only on a GPU with bitsandbytes installed (neither is here); run it there, or {CONVERT}")
    if cfg.get("layer_replication"):
        raise UserError(f"{folder}: layer_replication builds the tuned model's blocks from repeated base blocks, so "
                        "its blocks have no one-to-one reference in the base; merge it (merge_and_unload) and "
                        "compare it against a base replicated the same way")
    if kind == "VERA" and not cfg.get("save_projection", True):
        raise UserError(f"{folder}: a VeRA adapter saved without its projection (save_projection=False) is "
                        "regenerated from the whole model's shapes; save it with save_projection=True")


def _loftq_runs() -> bool:
    import importlib.util  # noqa: PLC0415

    return importlib.util.find_spec("bitsandbytes") is not None and torch.cuda.is_available()


def note(cfg: dict, against: str) -> str | None:
    """The one line said for an init that rewrote the base, or None."""
    init = rewriting_init(cfg)
    if init is None:
        return None
    if against == "residual":
        return (f"init {init} rewrote the base: measured against the residual base it left (the update alone; "
                "--against original compares with the original base)")
    return (f"init {init} rewrote the base: the tuned weights are the residual base plus the adapter, measured "
            "against the original base (--against residual measures the update alone)")


# --- one module ------------------------------------------------------------------------------------------------


def module_delta(layer, adapters=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tuned - base weight, tuned - base bias or None), float64, of one peft tuner layer with `adapters` (default:
    its active ones) merged by peft on a float64 copy; the live layer is not touched."""
    base = layer.get_base_layer()
    w0 = base.weight.detach().to(_F64)
    b0 = None if getattr(base, "bias", None) is None else base.bias.detach().to(_F64)
    work = copy.deepcopy(layer).to(_F64)
    names = list(adapters or layer.active_adapters)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        work.merge(adapter_names=names)
    merged = work.get_base_layer()
    dw = merged.weight.detach().to(_F64) - w0.to(merged.weight.device)
    db = None if b0 is None else merged.bias.detach().to(_F64) - b0.to(merged.bias.device)
    return dw, db


_EMBEDDING_NAME = re.compile(r"(^|\.)(embed_tokens|wte|embed_in|word_embeddings|tok_embeddings|embeddings)$")


def _leaf(module: str, weight: torch.Tensor, bias: torch.Tensor | None, fan_in_fan_out: bool) -> nn.Module:
    if weight.dim() != 2:
        raise UserError(f"{module}: a {weight.dim()}-D weight (peft forms are measured on 2-D weights)")
    if _EMBEDDING_NAME.search(module):
        leaf = nn.Embedding(*weight.shape, dtype=weight.dtype)
    elif fan_in_fan_out:  # GPT-2's Conv1D: weight stored in x out
        from transformers.pytorch_utils import Conv1D  # noqa: PLC0415

        leaf = Conv1D(weight.shape[1], weight.shape[0]).to(weight.dtype)
    else:
        leaf = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        leaf.weight.copy_(weight)
        if bias is not None:
            if getattr(leaf, "bias", None) is None:
                leaf.bias = nn.Parameter(bias.clone())
            else:
                leaf.bias.copy_(bias)
    return leaf


def _skeleton(module: str, leaf: nn.Module) -> nn.Module:
    root = node = nn.Module()
    parts = module.split(".")
    for p in parts[:-1]:
        child = nn.Module()
        node.add_module(p, child)
        node = child
    node.add_module(parts[-1], leaf)
    return root


def _put_shared(model, shared: dict[str, torch.Tensor]) -> None:
    """Tensors the adapter shares across modules (VeRA's projections base_model.vera_A, sized for the whole model)
    put in place as saved: the skeleton's own are sized for its one module, which slices what it needs."""
    for key, value in shared.items():
        owner, _, attr = key.rpartition(".")
        try:
            container = getattr(model.get_submodule(owner), attr)
            container["default"] = value.to(container["default"].dtype)
        except (AttributeError, KeyError, TypeError):
            raise UserError(f"adapter tensor {key} has no place in a {type(model.base_model).__name__}") from None


class Replay:
    """peft's algebra for the modules of one adapter folder, one module at a time."""

    def __init__(self, folder: Path, cfg: dict, shared: dict[str, torch.Tensor]):
        from peft import PeftConfig  # noqa: PLC0415

        self.folder, self.cfg, self.shared = folder, cfg, shared
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.config = PeftConfig.from_pretrained(str(folder))
        # rows the files hold in full (modules_to_save, trainable tokens) are read from the files, not replayed
        for field in ("modules_to_save", "trainable_token_indices", "layer_replication"):
            if hasattr(self.config, field):
                setattr(self.config, field, None)
        self.config.inference_mode = True
        self.init = rewriting_init(cfg)

    def delta(self, module: str, weight: torch.Tensor, bias: torch.Tensor | None,
              saved: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(tuned - weight, tuned - bias or None, residual - weight or None), float64, for the module at path
        `module` whose saved tensors are `saved` (names as peft saves them, the adapter name removed). `weight`
        in its stored dtype: an init that rewrites the base runs on it as peft runs it on load."""
        from peft import get_peft_model  # noqa: PLC0415

        w = weight if weight.dtype in (torch.float32, torch.float16, torch.bfloat16) else weight.float()
        leaf = _leaf(module, w, None if bias is None else bias.to(w.dtype), bool(self.cfg.get("fan_in_fan_out")))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = get_peft_model(_skeleton(module, leaf), copy.deepcopy(self.config))
                layer = model.base_model.model.get_submodule(module)
                residual = layer.get_base_layer().weight.detach().to(_F64) - weight.to(_F64) if self.init else None
                model.to(_F64)
                _put_shared(model, self.shared)
                sd = {f"base_model.model.{k}": v for k, v in saved.items()}
                sd.update(self.shared)  # peft checks they are there, now that they fit
                result = set_factors(model, sd)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - peft's own refusal of this module, in one line
            raise UserError(f"{self.folder}: peft cannot rebuild module {module} ({first_line(e, 200)})") from None
        unexpected = [k for k in getattr(result, "unexpected_keys", []) if k not in self.shared]
        if unexpected:
            raise UserError(f"{self.folder}: adapter tensor {unexpected[0]} does not fit module {module}")
        try:
            dw, db = module_delta(layer)
        except Exception as e:  # noqa: BLE001
            raise UserError(f"{self.folder}: peft cannot merge module {module} ({first_line(e, 200)})") from None
        dw = dw + (residual if residual is not None else 0.0)  # tuned = residual + update, against the original
        return dw, db, residual


def set_factors(peft_model, tensors: dict):
    """Saved adapter tensors (names as peft saves them) into a peft model whose adapter has the same targets: the
    one place factors are loaded (a resume, attribute's final adapter, a module rebuilt for its algebra). Returns
    peft's load result (its unexpected keys)."""
    from peft.utils import set_peft_model_state_dict  # noqa: PLC0415 - peft only where factors are loaded

    return set_peft_model_state_dict(peft_model, tensors)
