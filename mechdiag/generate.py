"""Batched sampling with a KV cache: left-padded prompts, temperature and top-p, stop at EOS.

A hand-written decode loop over the model's forward (one token per step, the cache carried between steps) is
several times cheaper than `model.generate` on the small models this project trains: no logits processors,
no stopping-criteria objects, and only the last position's logits are computed.

    generate(model, tokenizer, prompts, n=4, temperature=0.8)  ->  one list of n Samples per prompt
Greedy when temperature == 0. Groups are contiguous: sample j of prompt i is row i*n + j of the batch.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from mechdiag import vocab
from mechdiag.distributed import inference_mode
from mechdiag.errors import UserError
from mechdiag.models import context_length, encode_prompts, eos_ids, pad_id


@dataclass
class Sample:
    text: str
    token_ids: list[int]  # completion tokens, the EOS included when one was emitted
    truncated: bool  # hit max_new_tokens without an EOS
    length: int


def cache_kw(model) -> str:
    """transformers >= 5.2x names the KV cache argument `cache`; older versions `past_key_values`."""

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def kv_cache(model) -> DynamicCache:
    """An empty KV cache for `model`. Layers that carry a recurrent state instead of keys and values (Mamba,
    RecurrentGemma, hybrids) are refused: our batches are padded (left for sampling, between prompt and completion
    for shared prompts), and padding runs through a recurrence where attention would mask it."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    layers = DynamicCache(config=config).layers if config is not None else []
    if any(type(layer).__name__ == "LinearAttentionLayer" for layer in layers):
        raise UserError(f"{type(base).__name__}: layers with a recurrent state (state-space or linear attention) "
                        "cannot be sampled by mechdiag (padded batches); train and eval need attention-only models "
                        "(displacement and shift work on it)")
    return DynamicCache()


@dataclass(frozen=True)
class Filters:
    """The sampling filters besides temperature and top-p, as transformers' logits processors apply them (and TRL
    1.16's top_k / min_p / repetition_penalty): repetition_penalty on the raw logits of tokens the row has seen
    (its prompt and completion so far: z / p where z > 0, z x p where z < 0), then top_k (the k largest logits),
    top-p, min_p (probabilities under min_p x the largest). The defaults change nothing."""

    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0

    @property
    def penalises(self) -> bool:
        return self.repetition_penalty != 1.0


def penalise(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019) on the logits of the tokens `seen` (B, V bool)."""
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float, filters: Filters = Filters()):
    """The distribution a row samples from: softmax(logits / T) after top_k, top-p and min_p (unnormalised
    where filtered: a draw of argmax(p / E) needs no normalisation)."""
    z = logits.float() / temperature
    if filters.top_k and filters.top_k < z.size(-1):
        z = z.masked_fill(z < z.topk(filters.top_k, dim=-1).values[..., -1:], float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the smallest set whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    if filters.min_p:
        probs = probs.masked_fill(probs < filters.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def _pick(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None,
          filters: Filters = Filters()) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    probs = sampling_probs(logits, temperature, top_p, filters)
    # argmax(p / E), E ~ Exp(1), is an exact draw from p and cheaper than torch.multinomial on small batches
    noise = torch.empty_like(probs).exponential_(generator=gen)
    return (probs / noise).argmax(-1)


@inference_mode
def sample_tokens(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
                  eos: list[int], pad: int, temperature: float = 1.0, top_p: float = 1.0,
                  gen: torch.Generator | None = None, entropy: list | None = None, logprobs: list | None = None,
                  repeat: int = 1, filters: Filters = Filters()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode up to max_new_tokens for each left-padded row.

    Returns (completion_ids (B, T) right-padded with `pad`, completion_mask (B, T) with the EOS counted,
    truncated (B,) bool). T is the longest completion in the batch. If `entropy` is a list, the (B, T)
    per-token entropy of the sampling distribution (temperature 1 when greedy) is appended to it; if
    `logprobs` is a list, the (B, T) log-probability of each chosen token at that temperature (before top-p and
    the other `filters`).
    With `repeat` = n, each prompt row is prefilled once and decoded n times (rows i*n .. i*n+n-1).
    """

    b = prompt_ids.size(0) * repeat
    device = prompt_ids.device
    eos_t = torch.tensor(eos or [-1], device=device)
    attn = prompt_mask.clone()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    context = context_length(getattr(model, "config", None))
    if context is not None and prompt_ids.numel() and int(attn.sum(-1).max()) + max_new_tokens > context:
        # the callers fit their budgets first (models.fit_prompt_budget); this is what any other call would run into
        raise UserError(f"a prompt of {int(attn.sum(-1).max())} tokens and {max_new_tokens} new tokens pass the "
                        f"model's context of {context} positions; cut the prompts or the new tokens to fit")
    cache = kv_cache(model)
    kv = {cache_kw(model): cache}
    out = model(input_ids=prompt_ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1,
                **kv)
    logits = out.logits[:, -1, :]
    if repeat > 1:  # one prefill per prompt, then n decodes from its cache
        cache.batch_repeat_interleave(repeat)
        attn, pos = attn.repeat_interleave(repeat, 0), pos.repeat_interleave(repeat, 0)
        logits = logits.repeat_interleave(repeat, 0)
    seen = None  # (B, V): the tokens each row has seen, for the repetition penalty
    if filters.penalises:
        seen = torch.zeros(prompt_ids.size(0), logits.size(-1), dtype=torch.bool, device=device)
        seen.scatter_(1, prompt_ids.clamp(min=0), prompt_mask.bool())
        seen = seen.repeat_interleave(repeat, 0)
    next_pos = pos[:, -1:] + 1
    width = attn.size(1)
    attn = torch.cat([attn, attn.new_ones((b, max_new_tokens))], dim=1)  # a row's mask grows by one per token
    done = torch.zeros(b, dtype=torch.bool, device=device)
    rows = torch.arange(b, device=device)  # the rows still decoding: finished ones leave the batch and its cache
    tokens, alive = [], []
    ents, lps = [], []
    want = entropy is not None or logprobs is not None
    for step in range(max_new_tokens):
        if want:
            logp = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)
            ents.append(torch.zeros(b, device=device).index_copy(0, rows, -(logp.exp() * logp).sum(-1)))
        tok = _pick(logits if seen is None else penalise(logits, seen[rows], filters.repetition_penalty),
                    temperature, top_p, gen, filters)
        if seen is not None:
            seen[rows, tok] = True
        if want:
            lps.append(torch.zeros(b, device=device).index_copy(0, rows, logp.gather(-1, tok[:, None]).squeeze(-1)))
        tokens.append(torch.full((b,), pad, dtype=tok.dtype, device=device).index_copy(0, rows, tok))
        alive.append(~done)
        finished = torch.isin(tok, eos_t)
        done = done.index_fill(0, rows[finished], True)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        if bool(finished.any()):  # a smaller batch for the rest: a row's outputs after its EOS are never used
            keep = (~finished).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, tok, attn, next_pos = rows[keep], tok[keep], attn[keep], next_pos[keep]
        width += 1
        out = model(input_ids=tok[:, None], attention_mask=attn[:, :width], position_ids=next_pos, use_cache=True,
                    logits_to_keep=1, **kv)
        logits = out.logits[:, -1, :]
        next_pos = next_pos + 1
    ids = torch.stack(tokens, dim=1)
    mask = torch.stack(alive, dim=1).long()
    if entropy is not None:
        entropy.append(torch.stack(ents, dim=1) * mask)
    if logprobs is not None:
        logprobs.append(torch.stack(lps, dim=1) * mask)
    return ids, mask, ~done


def generate(model, tokenizer, prompts: list[str], n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
             max_new_tokens: int = 64, seed: int | None = None, batch_size: int | None = None,
             max_prompt_tokens: int | None = None) -> list[list[Sample]]:
    """Sample n completions per prompt (greedy when temperature == 0); see the module docstring."""
    if n < 1 or max_new_tokens < 1:
        raise ValueError("n and max_new_tokens must be >= 1")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    eos, pad = eos_ids(model, tokenizer), pad_id(tokenizer)
    batch_size = max(1, (batch_size or len(prompts) * n) // n)  # prompts per batch, each decoded n times
    was_training = model.training
    model.eval()
    flat: list[Sample] = []
    try:
        for start in range(0, len(prompts), batch_size):
            ids, mask = encode_prompts(tokenizer, prompts[start:start + batch_size], max_prompt_tokens)
            comp, cmask, trunc = sample_tokens(model, ids.to(device), mask.to(device), max_new_tokens=max_new_tokens,
                                               eos=eos, pad=pad, temperature=temperature, top_p=top_p, gen=gen,
                                               repeat=n)
            flat += samples_from(tokenizer, comp, cmask, trunc)
    finally:
        model.train(was_training)
    return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]


def policy_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                  prompt_of: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, T, V) that predict each completion token, from one forward over prompt + completion.

    prompt_of (B,): rows with the same value share one prompt (a GRPO group). Each distinct prompt is then run
    once and its KV cache, indexed out to its rows, serves their completions: the same attention over the same
    tokens with a G-th of the prompt's compute, differentiable like the plain forward. At real vocabularies this
    tensor is a step's largest: log-probs go through `policy_logprobs`, which never builds it.
    """
    return _completion_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_of, True)


def policy_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                  prompt_of: torch.Tensor | None = None) -> torch.Tensor:
    """The final hidden states (B, T, H) that predict each completion token (what the head of `policy_logits`
    reads): the same forward without the head."""
    return _completion_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_of, False)


def policy_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float = 1.0,
                    prompt_of: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) log-probs of the completion tokens at `temperature`, 0 at padding, differentiable: the head applied
    a chunk of positions at a time (mechdiag.vocab), so no vocabulary-wide tensor wider than a chunk exists."""
    head = vocab.head_of(model)
    if head is None:  # a head vocab.Head does not model: the full logits, masked as the chunked path is
        logits = policy_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_of)
        return vocab.token_logprobs(logits, completion_ids, temperature) * completion_mask
    hidden = policy_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_of)
    return vocab.selected_logprobs(hidden, head, completion_ids, completion_mask, temperature)


def policy_logprobs_entropy(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                            temperature: float = 1.0, prompt_of: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """policy_logprobs and the (B, T) entropy (nats) of the same distribution, 0 at padding, both differentiable,
    from one chunked pass over the head (vocab.selected_logprobs_entropy)."""
    head = vocab.head_of(model)
    if head is None:
        logits = policy_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_of)
        return (vocab.token_logprobs(logits, completion_ids, temperature) * completion_mask,
                vocab.token_entropy(logits, temperature) * completion_mask)
    hidden = policy_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_of)
    return vocab.selected_logprobs_entropy(hidden, head, completion_ids, completion_mask, temperature)


def policy_entropy(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float = 1.0,
                   prompt_of: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) entropy of the completion positions' distributions, 0 at padding, without gradient (the head a chunk
    of positions at a time where vocab.Head models it)."""
    with torch.no_grad():
        head = vocab.head_of(model)
        if head is None:
            logits = policy_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_of)
            return vocab.token_entropy(logits, temperature) * completion_mask
        hidden = policy_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_of)
        return vocab.selected_entropy(hidden, head, completion_mask, temperature)


def _decoder(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder()


def _completion_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_of,
                        logits: bool) -> torch.Tensor:
    """policy_logits (logits=True) or policy_hidden: the model's forward, or its decoder's (LoRA layers included:
    PEFT injects them in place), over prompt + completion."""
    net = model if logits else _decoder(model)
    head_kw = lambda k: {"logits_to_keep": k} if logits else {}  # noqa: E731
    field = "logits" if logits else "last_hidden_state"
    t = completion_ids.size(1)
    if prompt_of is None or t == 1:
        ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attn = torch.cat([prompt_mask, completion_mask], dim=1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = getattr(net(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False, **head_kw(t + 1)),
                      field)
        return out[:, -t - 1:-1, :]
    inverse = torch.unique(prompt_of, return_inverse=True)[1].to(prompt_ids.device)  # row -> distinct prompt
    rows = torch.arange(len(inverse), device=inverse.device)
    first = rows.new_full((int(inverse.max()) + 1,), len(inverse)).scatter_reduce(0, inverse, rows, reduce="amin")
    u_mask = prompt_mask[first]
    pos = (u_mask.cumsum(-1) - 1).clamp(min=0)
    cache = kv_cache(net)
    kv = {cache_kw(net): cache}
    head = getattr(net(input_ids=prompt_ids[first], attention_mask=u_mask, position_ids=pos, use_cache=True,
                       **head_kw(1), **kv), field)[:, -1:, :]
    cache.batch_select_indices(inverse)
    attn = torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1)
    c_pos = pos[inverse, -1:] + 1 + torch.arange(t - 1, device=pos.device)[None, :]
    rest = getattr(net(input_ids=completion_ids[:, :-1], attention_mask=attn, position_ids=c_pos, use_cache=True,
                       **kv), field)
    return torch.cat([head[inverse], rest], dim=1)


def samples_from(tokenizer, comp: torch.Tensor, cmask: torch.Tensor, trunc: torch.Tensor) -> list[Sample]:
    lengths = cmask.sum(-1).tolist()
    comp = comp.tolist()
    out = []
    for i, n_tok in enumerate(lengths):
        ids = comp[i][:n_tok]
        out.append(Sample(text=tokenizer.decode(ids, skip_special_tokens=True), token_ids=ids,
                          truncated=bool(trunc[i]), length=n_tok))
    return out


@inference_mode
def greedy(model, tokenizer, prompts: list[str], max_new_tokens: int, max_prompt_tokens: int | None = None,
           batch_size: int = 256) -> tuple[list[Sample], float, int]:
    """The one greedy evaluation pass (trainer, `mechdiag eval`, the TRL evaluator): completions of `prompts`,
    and the summed entropy (float64) over their completion tokens with the token count."""
    device = next(model.parameters()).device
    eos, pad = eos_ids(model, tokenizer), pad_id(tokenizer)
    out, ent_sum, ent_n = [], 0.0, 0
    for s in range(0, len(prompts), batch_size):
        ids, mask = encode_prompts(tokenizer, prompts[s:s + batch_size], max_prompt_tokens)
        ent: list = []
        comp, cmask, trunc = sample_tokens(model, ids.to(device), mask.to(device), max_new_tokens=max_new_tokens,
                                           eos=eos, pad=pad, temperature=0.0, entropy=ent)
        ent_sum += float((ent[0].double() * cmask).sum())
        ent_n += int(cmask.sum())
        out += samples_from(tokenizer, comp, cmask, trunc)
    return out, ent_sum, ent_n


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """The seed of step `step`'s sampling (salt: which draw), so that a resumed run replays the same draws."""
    return (seed * 1_000_003 + step * 7919 + salt) % (2**63 - 1)
