"""Batched KV-cache sampling: greedy parity with HF generate under left padding, EOS, truncation, seeds, top-p."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mechdiag.generate import encode_prompts, generate, sample_tokens

torch.set_num_threads(1)
PROMPTS = ["Once upon a time", "Lily had a big red ball and she", "The"]


@pytest.fixture(scope="module")
def lm(stories260k):
    return AutoModelForCausalLM.from_pretrained(stories260k).eval(), AutoTokenizer.from_pretrained(stories260k)


def test_greedy_left_padded_batch_equals_hf_generate_one_by_one(lm):
    model, tok = lm
    out = generate(model, tok, PROMPTS, n=1, temperature=0, max_new_tokens=15)
    for prompt, (s,) in zip(PROMPTS, out, strict=True):
        ids = tok(prompt, return_tensors="pt")
        ref = model.generate(**ids, max_new_tokens=15, do_sample=False)[0, ids["input_ids"].shape[1]:].tolist()
        assert s.token_ids == ref[:s.length]
        assert s.text == tok.decode(s.token_ids, skip_special_tokens=True)


def test_eos_stops_and_truncation_is_flagged(lm):
    model, tok = lm
    ids, mask = encode_prompts(tok, PROMPTS)
    comp, cmask, trunc = sample_tokens(model, ids, mask, max_new_tokens=6, eos=[tok.eos_token_id], pad=0,
                                       temperature=0)
    assert trunc.all() and (cmask.sum(-1) == 6).all()
    first = comp[:, 0].tolist()
    # declare the first greedy token of row 0 an EOS: that row stops after one token, the rest decode on
    comp2, cmask2, trunc2 = sample_tokens(model, ids, mask, max_new_tokens=6, eos=[first[0]], pad=0, temperature=0)
    assert cmask2[0].tolist() == [1, 0, 0, 0, 0, 0] and not trunc2[0]
    assert comp2[0, 1:].tolist() == [0] * 5  # padded after EOS
    for i in (1, 2):
        if first[0] not in comp[i].tolist():
            assert torch.equal(comp2[i], comp[i]) and trunc2[i]


def test_seeded_sampling_is_reproducible_and_groups_are_contiguous(lm):
    model, tok = lm
    a = generate(model, tok, PROMPTS, n=4, temperature=1.0, max_new_tokens=10, seed=7)
    b = generate(model, tok, PROMPTS, n=4, temperature=1.0, max_new_tokens=10, seed=7)
    c = generate(model, tok, PROMPTS, n=4, temperature=1.0, max_new_tokens=10, seed=8)
    assert [[s.token_ids for s in g] for g in a] == [[s.token_ids for s in g] for g in b]
    assert [[s.token_ids for s in g] for g in a] != [[s.token_ids for s in g] for g in c]
    assert len(a) == 3 and all(len(g) == 4 for g in a)
    assert len({tuple(s.token_ids) for g in a for s in g}) > 3  # sampling, not greedy


def test_tiny_top_p_is_greedy_and_batching_does_not_change_greedy(lm):
    model, tok = lm
    greedy = generate(model, tok, PROMPTS, temperature=0, max_new_tokens=8)
    nucleus = generate(model, tok, PROMPTS, temperature=1.0, top_p=1e-6, max_new_tokens=8, seed=0)
    small_batches = generate(model, tok, PROMPTS, temperature=0, max_new_tokens=8, batch_size=2)
    ids = lambda out: [g[0].token_ids for g in out]  # noqa: E731
    assert ids(greedy) == ids(nucleus) == ids(small_batches)


def test_shared_prefill_equals_repeated_prompts(lm):
    model, tok = lm
    ids, mask = encode_prompts(tok, PROMPTS)
    kw = dict(max_new_tokens=8, eos=[tok.eos_token_id], pad=0, temperature=1.0)
    a = sample_tokens(model, ids, mask, repeat=3, gen=torch.Generator().manual_seed(1), **kw)
    b = sample_tokens(model, ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0),
                      gen=torch.Generator().manual_seed(1), **kw)
    assert a[0].shape[0] == 9
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


# ---- TRL 1.16's sampling filters, against transformers' own logits processors -----------------------------------
@pytest.mark.parametrize("top_k,top_p,min_p,penalty", [(5, 1.0, None, 1.0), (0, 0.8, 0.1, 1.0), (7, 0.9, 0.05, 1.3),
                                                       (0, 1.0, None, 0.7)])
def test_filters_match_transformers_processors(top_k, top_p, min_p, penalty):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from mechdiag.generate import Filters, penalise, sampling_probs

    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(4, 50, generator=g)
    ids = torch.randint(0, 50, (4, 12), generator=g)  # the tokens each row has seen (prompt and completion)
    procs = [RepetitionPenaltyLogitsProcessor(penalty), TemperatureLogitsWarper(0.7)]
    procs += [TopKLogitsWarper(top_k)] if top_k else []
    procs += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    procs += [MinPLogitsWarper(min_p)] if min_p else []
    want = torch.softmax(LogitsProcessorList(procs)(ids, logits.clone()), dim=-1)
    seen = torch.zeros(4, 50, dtype=torch.bool).scatter_(1, ids, True)
    p = sampling_probs(penalise(logits, seen, penalty), 0.7, top_p, Filters(top_k, min_p, penalty))
    got = p / p.sum(-1, keepdim=True)
    assert torch.allclose(got, want, atol=1e-6)
    assert (got == 0).any() or (top_k == 0 and top_p == 1 and not min_p)  # the filters removed tokens


def test_repetition_penalty_in_the_decode_loop(lm):
    """A strong penalty makes the sampled completions repeat fewer tokens than the same draw without it."""
    from mechdiag.generate import Filters

    model, tok = lm
    ids, mask = encode_prompts(tok, ["Once upon a time", "The cat"], None)
    kw = dict(max_new_tokens=24, eos=[], pad=0, temperature=1.0, repeat=4)
    plain, _, _ = sample_tokens(model, ids, mask, gen=torch.Generator().manual_seed(0), **kw)
    pen, _, _ = sample_tokens(model, ids, mask, gen=torch.Generator().manual_seed(0), filters=Filters(0, None, 50.0),
                              **kw)
    repeats = lambda x: sum(len(r) - len(set(r)) for r in x.tolist())  # noqa: E731
    assert repeats(pen) < repeats(plain)
