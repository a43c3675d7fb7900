"""Every vocabulary-wide path holds less than one [rows, positions, V] float32 tensor at a time: the update pass,
the rollout's sampling and reference pass, the held-out eval, the forget probe and attribute's output KL.

Measured, not read from the code: torch's profiler records every CPU allocation and free; replayed in time order
they give the peak of live bytes during a call. The model is a tiny Qwen2 with a 16,384-entry tokenizer built the way
bench/scale.py builds Qwen2.5's 151,936, so the logits dwarf everything else; chunks are 1 MiB (vocab.CHUNK_BYTES,
16 positions). The full-logits path, measured the same way, shows the meter sees such tensors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen2Config, Qwen2ForCausalLM

from mechdiag import models, vocab
from mechdiag.generate import greedy, policy_hidden, policy_logits, policy_logprobs, sample_tokens
from mechdiag.probes.forget import ForgetProbe
from mechdiag.train.memory import Shape, chunk_bytes

_spec = importlib.util.spec_from_file_location("scale", Path(__file__).parent.parent / "bench" / "scale.py")
scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale)

V, ROWS, COMPLETION = 16_384, 4, 48
FULL = ROWS * COMPLETION * V * 4  # one [rows, positions, V] float32 tensor: 12 MiB
PROMPTS = ["1 + 2 =", "3 + 4 =", "5 + 6 =", "7 + 8 ="]


def peak_bytes(fn) -> tuple[int, object]:
    """(peak live CPU bytes allocated during fn(), its result): the profiler's raw allocation and free records
    (not their attribution to ops, which nets a parent's frees against its children's allocations), in time
    order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = prof.profiler.kineto_results.events()
    records = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live = peak = 0
    for _, n in records:
        live += n
        peak = max(peak, live)
    return peak, out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vocab16k")
    models.load_tokenizer("bundled").save_pretrained(folder)
    scale.real_vocab_tokenizer(folder, V)
    tok = models.load_tokenizer(folder)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval(), tok


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(vocab, "CHUNK_BYTES", 2**20)


def _batch(tok):
    ids, mask = models.encode_prompts(tok, PROMPTS[:1])
    ids, mask = ids.repeat(ROWS, 1), mask.repeat(ROWS, 1)  # one GRPO group of ROWS completions
    comp = torch.randint(3, V, (ROWS, COMPLETION), generator=torch.Generator().manual_seed(0))
    return ids, mask, comp, torch.ones_like(comp)


def test_the_meter_sees_full_logits(tiny):
    model, tok = tiny
    b = _batch(tok)

    def full():
        lp = vocab.token_logprobs(policy_logits(model, *b), b[2])
        lp.sum().backward()

    peak, _ = peak_bytes(full)
    assert peak > 2 * FULL  # logits, their float32 log-softmax and its gradient


def test_update_and_reference_passes_hold_no_full_logits(tiny):
    model, tok = tiny
    b = _batch(tok)
    group = torch.zeros(ROWS, dtype=torch.long)
    model.zero_grad(set_to_none=True)
    peak, lp = peak_bytes(lambda: policy_logprobs(model, *b, temperature=0.7, prompt_of=group).sum().backward())
    assert peak < FULL / 2, peak
    assert model.lm_head.weight.grad is not None  # the head's gradient came through the chunked backward
    with torch.inference_mode():  # the rollout's reference pass (rollout.sequence_logprobs)
        peak, lp = peak_bytes(lambda: policy_logprobs(model, *b, prompt_of=group))
    assert peak < FULL / 2 and lp.shape == (ROWS, COMPLETION)
    s = Shape.of(model.config, ROWS, b[0].size(1), COMPLETION, True)
    assert chunk_bytes(s) == vocab.CHUNK_LIVE * 4 * V * 16 < FULL / 2  # what the memory model counts for it


def test_sampling_and_heldout_eval_hold_one_position_of_logits(tiny):
    model, tok = tiny
    ids, mask = models.encode_prompts(tok, PROMPTS[:1])
    ent, lps = [], []
    with torch.inference_mode():
        peak, out = peak_bytes(lambda: sample_tokens(model, ids, mask, max_new_tokens=COMPLETION, eos=[1], pad=0,
                                                     temperature=1.0, top_p=1.0, entropy=ent, logprobs=lps,
                                                     repeat=ROWS))
    assert out[0].shape == (ROWS, COMPLETION) and ent[0].shape == (ROWS, COMPLETION)
    assert peak < FULL / 4, peak
    peak, (samples, ent_sum, n) = peak_bytes(lambda: greedy(model, tok, PROMPTS, max_new_tokens=COMPLETION))
    assert len(samples) == len(PROMPTS) and n > 0 and ent_sum > 0
    assert peak < FULL / 4, peak


def test_forget_probe_and_attribute_kl_hold_no_full_logits(tiny):
    model, tok = tiny
    other = Qwen2ForCausalLM(model.config).eval()  # a second model: the KL between two random ones
    probe = ForgetProbe(PROMPTS, tok, max_new_tokens=COMPLETION)
    peak, kl = peak_bytes(lambda: probe.kl(model, ref_model=other))
    assert kl > 0 and peak < FULL / 2, peak
    b = _batch(tok)  # attribute._kl: both models' hidden states, then vocab.selected_kl
    with torch.inference_mode():
        hp, hq = policy_hidden(model, *b), policy_hidden(other, *b)
        peak, kl = peak_bytes(lambda: vocab.selected_kl(hp, vocab.head_of(model), hq, vocab.head_of(other), b[3]))
    assert float(kl) > 0 and peak < FULL / 2, peak
