"""`mechdiag attribute`: which layers and modules of a LoRA update caused its effect.

The final adapter of a LoRA run (mechdiag train, native or --backend trl, or a TRL script recorded by
MechdiagCallback(config=CFG, evaluate="heldout")) is evaluated on the run's own held-out problems with one part's
factors zeroed (`*_without`) and with every other part's zeroed (`*_only`). A part is one layer (all its adapted
modules) or one module type across the layers. Zeroing B makes that part's s*B@A exactly zero, so "without" is
exactly the tuned model without that part; the factors are zeroed and restored in place (no reloads). Evaluation is
the trainer's own (recorder.heldout_eval over generate.greedy; through the merged sampler when a native run
used one, through the adapter for TRL runs, as their evaluator did), so the two reference rows are exact: part
"none" (nothing removed) reproduces summary.json's final_accuracy and part "all" its base_accuracy.

    output_kl = mean over the tuned model's greedy completion tokens of KL(tuned || variant)(next token)

causal share of a part = its output_kl_without / the sum over the parts of the same `by` (sums to 1, the
counterpart of the displacement share disp_share).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from mechdiag import config as configlib
from mechdiag import models, vocab
from mechdiag.displacement import lora_rows
from mechdiag.errors import UserError
from mechdiag.generate import policy_hidden, policy_logits
from mechdiag.metrics import ATTRIBUTION_REFERENCE, update_mass
from mechdiag.recorder import HeldOut, heldout_eval
from mechdiag.run import CALLBACK_DIR, RunDir, resolve_run
from mechdiag.train.lora import lora_modules, merge_into, site_name
from mechdiag.train.trainer import auto_threads, prepare_model
from mechdiag.weights import ADAPTER_WEIGHTS, adapter_config

COLUMNS = ["part", "by", "layer", "module", "disp_share", "accuracy_without", "reward_without", "output_kl_without",
           "accuracy_only", "output_kl_only"]
STREAM = "attribution"


@dataclass
class Part:
    part: str
    by: str
    layer: int | None
    module: str | None
    names: list[str] = field(default_factory=list)  # LoRA module paths in the part


@dataclass
class Source:
    """A finished LoRA run to attribute: its run directory, config, the folder of its final adapter, and whether
    TRL trained it (its evaluator ran the adapter itself, so attribute does too; the native trainer's ran the
    merged sampler when it had one)."""

    run: RunDir
    cfg: configlib.Config
    adapter: Path
    trl: bool


def open_run(path) -> Source:
    """The run of `mechdiag train` (native or --backend trl), or the TRL output_dir of a script that recorded with
    MechdiagCallback, checked before any model is loaded."""
    run = resolve_run(path)
    if not run.config_path.is_file():
        raise UserError(f"{run.path} has no config.yaml: not a mechdiag run directory (attribute reads runs of "
                        "mechdiag train, and TRL output_dirs recorded by MechdiagCallback)")
    cfg = configlib.load(run.config_path)
    if not cfg.lora.enabled:
        raise UserError(f"{run.path} is not a LoRA run (lora.enabled is false): nothing to attribute")
    summary = run.summary()
    trl = summary.get("source") == "trl"
    if (run.final / ADAPTER_WEIGHTS).is_file():
        if "final_accuracy" not in summary:
            raise UserError(f"{run.path} has no summary.json with final_accuracy: the run did not finish")
        return Source(run, cfg, run.final, trl)
    if not trl or "steps" not in summary:
        raise UserError(f"{run.path} has no final/{ADAPTER_WEIGHTS}: the run did not finish (or is not a LoRA run)")
    if summary.get("config_derived") is not False:  # the callback's config came from the GRPOConfig: no task
        raise UserError(f"{run.path}: MechdiagCallback was given no mechdiag config, so the run names no held-out "
                        'problems; record with MechdiagCallback(config=CFG, evaluate="heldout") to attribute it')
    return Source(run, cfg, callback_adapter(run, summary), True)


def callback_adapter(run: RunDir, summary: dict) -> Path:
    """The adapter a TRL script saved at the run's last step: OUT/checkpoint-STEP/, else OUT's own adapter when
    it was written after the run ended (trainer.save_model(OUT) after train())."""
    step = summary["steps"]
    # OUT/mechdiag/ sits in its output_dir (wherever that was moved); a run_dir= elsewhere names it in the summary
    out = run.path.parent if run.path.name == CALLBACK_DIR else Path(summary.get("trl_output_dir", run.path.parent))
    if (out / f"checkpoint-{step}" / ADAPTER_WEIGHTS).is_file():
        return out / f"checkpoint-{step}"
    saved = out / ADAPTER_WEIGHTS
    if saved.is_file() and saved.stat().st_mtime >= run.summary_path.stat().st_mtime:
        return out
    raise UserError(f"{out}: no adapter of the run's last step {step} (no checkpoint-{step}/, and no "
                    f"{ADAPTER_WEIGHTS} saved after the run); call trainer.save_model() after trainer.train()")


def _switches(mod, adapter: str) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(tensor, its trained value, its value with the module off) for one adapter of a LoRA layer: B (and a
    lora_bias) zero; a DoRA magnitude set to the base weight's own row norms, so m / ||W + s B A|| (W + s B A) with
    B = 0 is W itself (peft's get_weight_norm, the norm its forward divides by)."""
    B = mod.lora_B[adapter]
    out = [(B.weight, B.weight.detach().clone(), torch.zeros_like(B.weight))]
    if getattr(B, "bias", None) is not None:
        out.append((B.bias, B.bias.detach().clone(), torch.zeros_like(B.bias)))
    magnitude = getattr(mod, "lora_magnitude_vector", {})
    if adapter in magnitude:
        from peft.utils.other import transpose  # noqa: PLC0415

        m, w = magnitude[adapter].weight, mod.get_base_layer().weight  # stored orientation, as peft's forward passes it
        zero = torch.zeros_like(transpose(w, getattr(magnitude[adapter], "fan_in_fan_out", False)))
        with torch.no_grad():
            norm = magnitude[adapter].get_weight_norm(w, zero, scaling=1).to(m.dtype)
        out.append((m, m.detach().clone(), norm.reshape(m.shape)))
    return out


class Attribution:
    """The final model of a LoRA run, with parts of its adapter switched off and on in place."""

    def __init__(self, path, n: int | None = None):
        src = open_run(path)
        self.run, self.cfg = src.run, src.cfg
        cfg = self.cfg
        torch.set_num_threads(cfg.threads or auto_threads())  # the trainer's setting: same kernels, same numbers
        if src.trl:  # the adapter as TRL saved it, evaluated through itself like the run's evaluator
            kind = adapter_config(src.adapter).get("peft_type", "LORA")
            if kind != "LORA":
                raise UserError(f"{src.adapter}: attribute switches the modules of a LoRA adapter off and on; a {kind} "
                                "adapter has no LoRA modules (displacement and shift measure it)")
            model, self.tokenizer = models.load_model_and_tokenizer(cfg.model.name_or_path, cfg.model.dtype)
            self.model, self._sampler = models.load_adapters(model, {"default": src.adapter}), None
        else:
            self.model, self.tokenizer, _, self._sampler = prepare_model(cfg)
            models.load_adapter_weights(self.model, src.adapter)
        self.model.eval()
        heldout = HeldOut.from_config(cfg, self.tokenizer)  # the trainer's held-out set
        self.task, self.examples, self.prompts = heldout.task, heldout.examples[:n or None], heldout.prompts[:n or None]
        self.sites = {r["name"]: r for r in lora_modules(self.model)}
        self._factors = {}  # module path -> [(tensor, saved copy, its value when the module is off)]
        for name, mod in self.model.named_modules():
            short = site_name(name, mod)
            if short in self.sites:
                for a in mod.active_adapters:
                    self._factors.setdefault(short, []).extend(_switches(mod, a))
        self._tuned_tokens: list | None = None
        self._tuned_out: list | None = None  # per batch: the tuned model's (head, hidden) or (None, log-softmax)
        # an adapted head changes with the adapter state, so the tuned model's head cannot be kept by reference
        self._head_adapted = any(n.rsplit(".", 1)[-1] == "lm_head" for n in self.sites)

    # ---- parts --------------------------------------------------------------------------------------------
    def parts(self, by: str) -> list[Part]:
        out: dict[tuple, Part] = {}
        for name, site in self.sites.items():
            for b in (("layer", "module") if by == "both" else (by,)):
                key = site[b]
                if b == "layer":
                    p = out.setdefault((b, key), Part(f"layer {key}", b, key, None))
                else:
                    p = out.setdefault((b, key), Part(key, b, None, key))
                p.names.append(name)
        order = {"layer": 0, "module": 1}
        mods = {m: i for i, m in enumerate(dict.fromkeys(s["module"] for s in self.sites.values()))}
        return sorted(out.values(), key=lambda p: (order[p.by], p.layer if p.by == "layer" else mods[p.module]))

    def keep(self, names) -> None:
        """Restore the factors of the modules in `names`, zero every other's."""
        names = set(names)
        with torch.no_grad():
            for short, pairs in self._factors.items():
                for w, saved, off in pairs:
                    w.copy_(saved if short in names else off)

    # ---- measuring ----------------------------------------------------------------------------------------
    def eval_model(self):
        """The module the trainer evaluates: the merged sampler brought up to date with the adapter, or the model."""
        return merge_into(self.model, self._sampler)

    def evaluate(self, kl: bool = True) -> dict:
        """The trainer's held-out eval (recorder.heldout_eval) of the current adapter state, and its output KL
        from the tuned model."""
        model = self.eval_model()
        metrics, scored = heldout_eval(model, self.tokenizer, self.task, self.examples, self.prompts, self.cfg)
        if self._tuned_tokens is None:  # the first evaluation is the tuned model's: its completions carry the KL
            self._tuned_tokens = self._batches([smp for smp, _, _ in scored])
            self._tuned_out = [self._outputs(model, t) for t in self._tuned_tokens]
            metrics["output_kl"] = 0.0
        elif kl:
            metrics["output_kl"] = self._kl(model)
        return metrics

    def _batches(self, samples, batch_size: int = 256) -> list:
        """(prompt_ids, prompt_mask, completion_ids, completion_mask) batches of the tuned greedy completions."""
        pad = models.pad_id(self.tokenizer)
        out = []
        for s in range(0, len(self.prompts), batch_size):
            ids, mask = models.encode_prompts(self.tokenizer, self.prompts[s:s + batch_size],
                                              self.cfg.max_prompt_tokens)
            chunk = samples[s:s + batch_size]
            width = max(1, max(len(x.token_ids) for x in chunk))
            comp = torch.tensor([x.token_ids + [pad] * (width - len(x.token_ids)) for x in chunk], dtype=torch.long)
            cmask = torch.tensor([[1] * len(x.token_ids) + [0] * (width - len(x.token_ids)) for x in chunk],
                                 dtype=torch.long)
            out.append((ids, mask, comp, cmask))
        return out

    def _outputs(self, model, batch) -> tuple:
        """What the output KL needs of one batch: (head, final hidden states), the vocabulary then read a chunk of
        positions at a time (mechdiag.vocab); or (None, float64 log-softmax of the full logits) for a head that
        vocab.Head does not model or that the adapter changes."""
        device = next(model.parameters()).device
        b = tuple(t.to(device) for t in batch)
        head = None if self._head_adapted else vocab.head_of(model)
        with torch.inference_mode():
            if head is None:
                return None, torch.log_softmax(policy_logits(model, *b).double(), dim=-1).cpu()
            return head, policy_hidden(model, *b)

    def _kl(self, model) -> float:
        """KL(tuned || current) per completion token of the tuned greedy completions."""
        total, count = 0.0, 0
        for batch, (head_t, tuned) in zip(self._tuned_tokens, self._tuned_out, strict=True):
            head, out = self._outputs(model, batch)  # the same eval model each time: head is None iff head_t is
            if head is None:
                per_tok = (tuned.exp() * (tuned - out)).sum(-1)
                total += float((per_tok * batch[3].to(out.dtype)).sum())
            else:
                total += float(vocab.selected_kl(tuned, head_t, out, head, batch[3].to(out.device)))
            count += int(batch[3].sum())
        return total / max(count, 1)

    def disp_shares(self, by: str) -> dict:
        """The displacement share (metrics.update_mass) of each layer or module type of the final adapter."""
        self.keep(self.sites)
        return {(int(k) if by == "layer" else str(k)): v for k, v in update_mass(lora_rows(self.model), by).items()}

    def rows(self, by: str = "both", progress=None) -> list[dict]:
        parts = self.parts(by)
        shares = {b: self.disp_shares(b) for b in {p.by for p in parts}}
        everything = list(self.sites)
        advance = progress or (lambda: None)
        self.keep(everything)
        tuned = self.evaluate()
        advance()
        self.keep([])
        base = self.evaluate()
        advance()
        rows = [_row(Part("none", ATTRIBUTION_REFERENCE, None, None), None, tuned, base),
                _row(Part("all", ATTRIBUTION_REFERENCE, None, None), None, base, tuned)]
        for p in parts:
            self.keep([n for n in everything if n not in set(p.names)])
            without = self.evaluate()
            advance()
            self.keep(p.names)
            only = self.evaluate()
            advance()
            key = p.layer if p.by == "layer" else p.module
            rows.append(_row(p, shares[p.by].get(key, 0.0), without, only))
        self.keep(everything)
        return rows

    def n_evals(self, by: str) -> int:
        return 2 + 2 * len(self.parts(by))


def _row(p: Part, disp_share, without: dict, only: dict) -> dict:
    return {"part": p.part, "by": p.by, "layer": p.layer, "module": p.module, "disp_share": disp_share,
            "accuracy_without": without["accuracy"], "reward_without": without["eval_reward"],
            "output_kl_without": without["output_kl"], "accuracy_only": only["accuracy"],
            "output_kl_only": only["output_kl"]}
