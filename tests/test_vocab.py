"""mechdiag.vocab: the chunked head gives the unchunked path's log-probs, gradients, entropy and KL, on the real
model (stories260K) and on a real head with softcapping and a trained weight; chunks of 1 position and of all."""

from __future__ import annotations

import pytest
import torch

from mechdiag import models, vocab
from mechdiag.generate import policy_entropy, policy_hidden, policy_logits, policy_logprobs, policy_logprobs_entropy


def _batch(tok, n=3, t=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids, mask = models.encode_prompts(tok, ["Once upon a time", "The cat", "A dog ran"][:n])
    comp = torch.randint(3, len(tok), (n, t), generator=g)
    cmask = torch.ones(n, t, dtype=torch.long)
    cmask[1, 4:] = 0  # a shorter completion: padding never reaches the head
    return ids, mask, comp, cmask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_grads_equal_the_full_logits(stories260k, temperature):
    model, tok = models.load_model_and_tokenizer(str(stories260k), "float32")
    b = _batch(tok)
    m = b[3].bool()
    params = [p for p in model.parameters() if p.requires_grad]
    full_lp = vocab.token_logprobs(policy_logits(model, *b), b[2], temperature)
    g_full = torch.autograd.grad((full_lp * b[3]).sum(), params)
    for chunk in (1, 5, None):
        head = vocab.head_of(model)
        lp = vocab.selected_logprobs(policy_hidden(model, *b), head, b[2], b[3], temperature, chunk=chunk)
        assert torch.allclose(lp[m], full_lp[m], atol=1e-5, rtol=1e-6) and (lp[~m] == 0).all()
        g = torch.autograd.grad(lp.sum(), params)  # the embedding is tied: the head's weight gradient is in it
        for a, e in zip(g, g_full, strict=True):
            assert float((a - e).norm()) <= 1e-5 * float(e.norm()) + 1e-9
    assert torch.allclose(policy_logprobs(model, *b, temperature=temperature)[m], full_lp[m], atol=1e-5)


def test_softcapped_head_and_bias_match_autograd():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(50, 8, generator=g, requires_grad=True)
    bias = torch.randn(50, generator=g, requires_grad=True)
    h = torch.randn(2, 6, 8, generator=g, requires_grad=True)
    tokens = torch.randint(0, 50, (2, 6), generator=g)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, 5] = 0
    head = vocab.Head(w, bias, softcap=3.0)
    ref = vocab.token_logprobs(head.logits(h), tokens, 0.9) * mask  # autograd through tanh and log_softmax
    got = vocab.selected_logprobs(h, head, tokens, mask, 0.9, chunk=4)
    assert torch.allclose(got, ref, atol=1e-6)
    weights = torch.randn(2, 6, generator=g)
    for a, e in zip(torch.autograd.grad((got * weights).sum(), (h, w, bias)),
                    torch.autograd.grad((ref * weights).sum(), (h, w, bias)), strict=True):
        assert torch.allclose(a, e, atol=1e-5)


def _rel(a: torch.Tensor, e: torch.Tensor) -> float:
    """|a - e| / |e| (Frobenius): the error relative to the tensor's scale."""
    return float((a.detach().double() - e.detach().double()).norm() / e.detach().double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_fused_logprobs_entropy_and_grads_equal_the_full_logits(dtype, temperature, softcap):
    """One chunked pass gives the log-probs, the entropy and the gradient of any mix of them (the entropy detached,
    or alone) in hidden, weight and bias: chunks of 3 over 10 real positions (the last holds 1), 2 masked."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(97, 16, generator=g, dtype=dtype).requires_grad_()
    bias = torch.randn(97, generator=g, dtype=dtype).requires_grad_()
    h = torch.randn(2, 6, 16, generator=g, dtype=dtype).requires_grad_()
    tokens = torch.randint(0, 97, (2, 6), generator=g)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, 4:] = 0
    m = mask.bool()
    head = vocab.Head(w, bias, softcap)
    # the reference's logits from the same 3-row matmuls: a float32 head over 3 rows and over 12 rounds differently
    # (blocking, ~1 ulp), which moves a gradient by ~1e-6 (the float32 floor, not the formula's)
    logits = torch.cat([head.logits(x) for x in h[m].split(3)])
    ref_lp, ref_ent = vocab.token_logprobs(logits, tokens[m], temperature), vocab.token_entropy(logits, temperature)
    lp, ent = vocab.selected_logprobs_entropy(h, head, tokens, mask, temperature, chunk=3)
    assert lp.dtype == ent.dtype == torch.float32 and (lp[~m] == 0).all() and (ent[~m] == 0).all()
    assert _rel(lp[m], ref_lp) <= 1e-6 and _rel(ent[m], ref_ent) <= 1e-6
    a, b = torch.randn(10, generator=g), torch.randn(10, generator=g)
    # the entropy's gradient alone, -p (log p + H), cancels where the softmax is broad (a softcap of 3): there the
    # float32 reference is itself ~6e-7 off the float64 one, and the two agree to ~1e-6, the float32 floor
    losses = {"both": (lambda lp, ent: (a * lp + b * ent).sum(), 1e-6),
              "entropy detached": (lambda lp, ent: (a * lp + b * ent.detach()).sum(), 1e-6),
              "entropy alone": (lambda lp, ent: (b * ent).sum(), 3e-6)}
    for name, (loss, tol) in losses.items():
        lp, ent = vocab.selected_logprobs_entropy(h, head, tokens, mask, temperature, chunk=3)
        got = torch.autograd.grad(loss(lp[m], ent[m]), (h, w, bias))
        want = torch.autograd.grad(loss(ref_lp, ref_ent), (h, w, bias), retain_graph=True)
        for x, y, of in zip(got, want, ("hidden", "weight", "bias"), strict=True):
            assert x.dtype == dtype and _rel(x, y) <= tol, (name, of, _rel(x, y))
    # the log-prob alone is selected_logprobs's: the same function, without the entropy
    assert torch.equal(lp, vocab.selected_logprobs(h, head, tokens, mask, temperature, chunk=3))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_policy_logprobs_entropy_equal_the_full_logits(stories260k, temperature):
    """The update pass's entropy path on the real model: chunked where vocab.Head models the head, the full logits
    under an adapter on lm_head; policy_entropy (no gradient) the same values."""
    from peft import LoraConfig, get_peft_model

    model, tok = models.load_model_and_tokenizer(str(stories260k), "float32")
    b = _batch(tok)
    m = b[3].bool()
    params = [p for p in model.parameters() if p.requires_grad]
    a = torch.randn(b[2].shape, generator=torch.Generator().manual_seed(4))
    logits = policy_logits(model, *b)
    want = vocab.token_logprobs(logits, b[2], temperature), vocab.token_entropy(logits, temperature)
    g_want = torch.autograd.grad(((want[0] + a * want[1]) * b[3]).sum(), params)
    lp, ent = policy_logprobs_entropy(model, *b, temperature=temperature)
    for x, y in zip((lp, ent), want, strict=True):
        assert _rel(x[m], y[m]) <= 1e-6 and (x[~m] == 0).all()
    for x, y in zip(torch.autograd.grad((lp + a * ent).sum(), params), g_want, strict=True):
        assert _rel(x, y) <= 1e-5  # the float32 model's own forward and backward, beyond the head
    assert _rel(policy_entropy(model, *b, temperature=temperature)[m], ent[m].detach()) <= 1e-6
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["lm_head"]))
    assert vocab.head_of(peft) is None
    lp, ent = policy_logprobs_entropy(peft, *b, temperature=temperature)
    assert _rel(lp[m], want[0][m]) <= 1e-6 and _rel(ent[m], want[1][m]) <= 1e-6 and (ent[~m] == 0).all()
    assert torch.equal(policy_entropy(peft, *b, temperature=temperature), ent.detach())  # the same formula


def test_chunked_entropy_and_kl_equal_the_full_softmax(stories260k):
    model, tok = models.load_model_and_tokenizer(str(stories260k), "float32")
    b = _batch(tok)
    m = b[3].bool()
    with torch.no_grad():
        logits, hidden = policy_logits(model, *b), policy_hidden(model, *b)
        other = hidden + 0.1 * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2))
    head = vocab.head_of(model)
    ent = vocab.selected_entropy(hidden, head, b[3], chunk=2)
    assert torch.allclose(ent[m], vocab.token_entropy(logits)[m], atol=1e-5) and (ent[~m] == 0).all()
    lp, lq = torch.log_softmax(logits.double(), -1), torch.log_softmax(head.logits(other).double(), -1)
    want = ((lp.exp() * (lp - lq)).sum(-1) * b[3]).sum()
    got = vocab.selected_kl(hidden, head, other, head, b[3], chunk=3)
    # the float32 head of a 3-row chunk and of the whole batch round differently (matmul blocking, ~1e-7 in the
    # logits): a few 1e-6 of this small KL, the float32 floor, not the chunking's
    assert got.dtype == torch.float64 and float(got) > 0 and torch.allclose(got, want, rtol=2e-5)


def test_chunks_follow_the_vocabulary_and_lm_head_adapters_fall_back(stories260k):
    assert vocab.chunk_positions(151_936) == vocab.CHUNK_BYTES // (4 * 151_936) == 110
    from peft import LoraConfig, get_peft_model

    model, _ = models.load_model_and_tokenizer(str(stories260k), "float32")
    assert vocab.head_of(model) is not None
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["lm_head"]))
    assert vocab.head_of(peft) is None  # an adapter on the head: the full-logits path keeps it exact


class _Roll:
    """The shape a rollout gives rows_per_pass: 4 rows of 6 prompt + 10 completion tokens."""
    prompt_ids, completion_ids = torch.zeros(4, 6, dtype=torch.long), torch.zeros(4, 10, dtype=torch.long)

    def __len__(self):
        return 4


@pytest.mark.parametrize("chunked", [True, False])
def test_row_pass_budget_counts_the_vocabulary_as_documented(chunked):
    from types import SimpleNamespace

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mechdiag.train.memory import LOGIT_COPIES
    from mechdiag.train.objective import Objective
    from mechdiag.train.trainer import Trainer

    def rows(n_vocab):
        c = Qwen2Config(vocab_size=n_vocab, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
        if not chunked:
            c.logit_scale = 2.0  # a rescaled head: vocab.head_of is None, the full-logits path
        model = Qwen2ForCausalLM(c)
        assert (vocab.head_of(model) is not None) == chunked
        me = SimpleNamespace(cfg=SimpleNamespace(update_rows=None), model=model, objective=Objective(),
                             memory={"weights_bytes": 8 * 2**30})
        return Trainer.rows_per_pass(me, _Roll())

    budget, per_row, width = 4 * 2**30, 4 * 2 * (16 * 8 + 6 * 16) * 16, 16
    for n_vocab in (177, 151_936):
        if chunked:
            off = vocab.CHUNK_LIVE * 4 * n_vocab * min(vocab.chunk_positions(n_vocab), 4 * width)
            assert rows(n_vocab) == (budget - off) // per_row
        else:
            assert rows(n_vocab) == budget // (per_row + LOGIT_COPIES * 4 * n_vocab * 10)
    assert rows(151_936) < rows(177)
