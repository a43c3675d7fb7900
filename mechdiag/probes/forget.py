"""Forgetting probe: how far the tuned model has moved from the base on prompts outside the task.

    forget_kl = (1 / sum_x T_x) sum_x sum_t KL(pi_base(. | x, y_<t) || pi_tuned(. | x, y_<t))

over the base model's greedy continuations y of the probe prompts x (T_x tokens each, EOS included): the "RL's
Razor" measure, KL to the base on data the reward never saw. The continuations are decoded once, from the base
(the model with its adapter disabled, or the frozen reference of a full fine-tune), and cached; each eval then
costs two forward passes. KL is exact over the vocabulary, summed in float64.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mechdiag import vocab
from mechdiag.distributed import inference_mode
from mechdiag.errors import UserError
from mechdiag.generate import policy_hidden, policy_logits, sample_tokens
from mechdiag.models import context_length, encode_prompts, eos_ids, fit_prompt_budget, pad_id, reference_context
from mechdiag.probes.prompts import read_prompts, task_prompts


def forget_prompts(spec: str, tokenizer, n: int) -> list[str]:
    """The probe prompts: a prompts file (.jsonl with "prompt", or one per line) or a task name (its test split,
    formatted as in training). A spec that names no file and looks like a path is an error, not a task."""
    if Path(spec).is_file():
        return read_prompts(spec, n)
    if "/" in spec or Path(spec).suffix in (".jsonl", ".txt", ".json"):
        raise UserError(f"record.forget_prompts: file not found: {spec}")
    return task_prompts(spec, tokenizer, split="test", n=n)


class ForgetProbe:
    def __init__(self, prompts: list[str], tokenizer, max_new_tokens: int = 32, max_prompt_tokens: int | None = None,
                 batch_size: int = 16):
        if not prompts:
            raise UserError("record.forget_prompts: no prompts")
        self.prompts, self.tokenizer = list(prompts), tokenizer
        self.max_new_tokens, self.max_prompt_tokens, self.batch_size = max_new_tokens, max_prompt_tokens, batch_size
        self._cache: list | None = None  # per batch: (prompt ids, prompt mask, continuation ids, continuation mask)

    @classmethod
    def from_config(cls, record, tokenizer, max_prompt_tokens: int | None = None) -> ForgetProbe | None:
        """The probe of a config's record section (None when record.forget_prompts is unset)."""
        if not record.forget_prompts:
            return None
        return cls(forget_prompts(record.forget_prompts, tokenizer, record.forget_n), tokenizer,
                   max_new_tokens=record.forget_tokens, max_prompt_tokens=max_prompt_tokens)

    def _continuations(self, base, device) -> list:
        if self._cache is None:
            tok, cache = self.tokenizer, []
            budget = fit_prompt_budget(context_length(getattr(base, "config", None)), self.max_prompt_tokens,
                                       self.max_new_tokens, "max_prompt_tokens", "record.forget_tokens")
            for s in range(0, len(self.prompts), self.batch_size):
                ids, mask = encode_prompts(tok, self.prompts[s:s + self.batch_size], budget)
                ids, mask = ids.to(device), mask.to(device)
                comp, cmask, _ = sample_tokens(base, ids, mask, max_new_tokens=self.max_new_tokens,
                                               eos=eos_ids(base, tok), pad=pad_id(tok), temperature=0.0)
                cache.append((ids, mask, comp.clone(), cmask.clone()))
            self._cache = cache
        return self._cache

    @inference_mode
    def kl(self, model, ref_model=None) -> float:
        """forget_kl of `model` (a PEFT model: base = adapter disabled; else `ref_model` is the base)."""
        device = next(model.parameters()).device
        was = model.training
        model.eval()
        try:
            ref, ctx = reference_context(model, ref_model)
            with ctx:
                batches = self._continuations(ref, device)
            total, n = torch.zeros((), dtype=torch.float64), 0
            for b in batches:  # hidden states per batch; the vocabulary a chunk of positions at a time
                ref, ctx = reference_context(model, ref_model)
                head_base, head = vocab.head_of(ref), vocab.head_of(model)
                if head_base is None or head is None:  # a head vocab.Head does not model: the full logits
                    with ctx:
                        lp_base = torch.log_softmax(policy_logits(ref, *b).double(), -1)
                    lp = torch.log_softmax(policy_logits(model, *b).double(), -1)
                    per_token = (lp_base.exp() * (lp_base - lp)).sum(-1)
                    total += (per_token * b[3].to(per_token.dtype)).sum().cpu()
                else:
                    with ctx:
                        h_base = policy_hidden(ref, *b)
                    total += vocab.selected_kl(h_base, head_base, policy_hidden(model, *b), head, b[3]).cpu()
                n += int(b[3].sum())
        finally:
            model.train(was)
        return float(total / max(n, 1))
