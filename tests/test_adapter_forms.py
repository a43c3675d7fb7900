"""Issue 39: every adapter form users bring is measured exactly or refused with its reason, never silently wrong.

Each form is built with peft on a tiny model as users build it (get_peft_model, trained parameters moved, then
save_pretrained), and its ground truth is computed without mechdiag: peft's merge_and_unload of the model in
float64, minus the ORIGINAL base, per parameter (a tied pair counted once, as the model holds it). `mechdiag
displacement` must give every parameter's ||delta|| and ||W_ref|| to 1e-6 relative, and the trainer's in-memory
records (lora_rows) the same figure for every row they give. Forms that cannot be measured give one line, the same
from displacement and shift."""

from __future__ import annotations

import copy
import json
import math

import peft
import pytest
import torch
import torch.nn.functional as F
from peft import get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from mechdiag.displacement import displacement, lora_rows
from mechdiag.probes.shift import shift
from tests.helpers import assert_bad_input
from tests.tiny_models import MATRIX, family_config, family_folder

QKV = ["q_proj", "v_proj"]
FORMS = {  # name: (family, tied, peft config); a tiny model of the family, its parameters moved by training
    "lora": ("llama", False, lambda: peft.LoraConfig(r=2, target_modules=QKV)),
    "dora": ("qwen2", False, lambda: peft.LoraConfig(r=2, target_modules=[*QKV, "down_proj"], use_dora=True)),
    "dora_conv1d": ("gpt2", False, lambda: peft.LoraConfig(r=2, target_modules=["c_attn", "c_fc"], use_dora=True,
                                                           fan_in_fan_out=True)),
    "dora_embedding": ("llama", False, lambda: peft.LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"],
                                                               use_dora=True)),
    "lora_bias": ("qwen2", False, lambda: peft.LoraConfig(r=2, target_modules=QKV, lora_bias=True)),
    "bias_all": ("qwen2", False, lambda: peft.LoraConfig(r=2, target_modules=["q_proj"], bias="all")),
    "bias_lora_only": ("qwen2", False, lambda: peft.LoraConfig(r=2, target_modules=["q_proj"], bias="lora_only")),
    "adalora": ("llama", False, lambda: peft.AdaLoraConfig(r=2, target_modules=QKV, total_step=10)),
    "loha": ("llama", False, lambda: peft.LoHaConfig(r=2, target_modules=QKV)),
    "lokr": ("llama", False, lambda: peft.LoKrConfig(r=2, target_modules=QKV)),
    "ia3": ("qwen2", False, lambda: peft.IA3Config(target_modules=["q_proj", "down_proj"],
                                                   feedforward_modules=["down_proj"])),
    "vera": ("llama", False, lambda: peft.VeraConfig(r=2, target_modules=["q_proj", "v_proj", "up_proj"])),
    "oft": ("llama", False, lambda: peft.OFTConfig(r=0, oft_block_size=4, target_modules=QKV)),
    "boft": ("llama", False, lambda: peft.BOFTConfig(boft_block_size=4, target_modules=["q_proj"])),
    "hra": ("llama", False, lambda: peft.HRAConfig(r=2, target_modules=QKV)),
    "miss": ("llama", False, lambda: peft.MissConfig(r=2, target_modules=QKV)),
    "fourierft": ("llama", False, lambda: peft.FourierFTConfig(n_frequency=10, target_modules=QKV)),
    "trainable_tokens": ("llama", False, lambda: peft.LoraConfig(r=2, target_modules=QKV,
                                                                 trainable_token_indices=[3, 5])),
    "trainable_tokens_tied": ("qwen2", True, lambda: peft.LoraConfig(r=2, target_modules=QKV,
                                                                     trainable_token_indices=[3, 5])),
    "modules_to_save": ("llama", False, lambda: peft.LoraConfig(r=2, target_modules=QKV,
                                                                modules_to_save=["lm_head", "model.norm"])),
    "modules_to_save_tied": ("qwen2", True, lambda: peft.LoraConfig(r=2, target_modules=QKV,
                                                                    modules_to_save=["lm_head"])),
    "modules_to_save_tied_embedding": ("qwen2", True, lambda: peft.LoraConfig(r=2, target_modules=QKV,
                                                                              modules_to_save=["embed_tokens"])),
    "modules_to_save_weight_tying": ("qwen2", True, lambda: peft.LoraConfig(r=2, target_modules=QKV,
                                                                            modules_to_save=["lm_head"],
                                                                            ensure_weight_tying=True)),
    "pissa": ("llama", False, lambda: peft.LoraConfig(r=2, target_modules=[*QKV, "down_proj"],
                                                      init_lora_weights="pissa")),
    "olora": ("qwen2", False, lambda: peft.LoraConfig(r=2, target_modules=QKV, init_lora_weights="olora")),
    "default_keys": ("llama", False, lambda: peft.LoraConfig(r=2, target_modules=QKV)),  # raw state-dict names
    "resized_vocab": ("llama", False, lambda: peft.LoraConfig(r=2, target_modules=QKV,
                                                              modules_to_save=["embed_tokens", "lm_head"])),
}


def _model(family: str, tied: bool, seed: int = 0):
    cfg = family_config(family)
    cfg.tie_word_embeddings = tied
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def tokenizer_of(folder):
    """The bundled tokenizer beside a tiny model (shift reads one; its ids stay below the tiny vocabulary here)."""
    import shutil

    from mechdiag.models import bundled_path

    for f in bundled_path().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)


def _params(model) -> dict[str, torch.Tensor]:
    """Every parameter as the model holds it (named_parameters counts a tied pair once), float64."""
    return {n: p.detach().double().clone() for n, p in model.named_parameters()}


def _build(tmp_path, form: str):
    """(base folder, adapter folder, truth {name: (delta, W_ref)}, the adapted model in memory)."""
    family, tied, make = FORMS[form]
    base = _model(family, tied)
    base.save_pretrained(tmp_path / "base")
    tokenizer_of(tmp_path / "base")
    original = _params(base)
    model = _model(family, tied)
    if form == "resized_vocab":  # tokens added before training
        model.resize_token_embeddings(model.config.vocab_size + 6, mean_resizing=False)
    pm = get_peft_model(model, make())
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # what training does: every trainable parameter moves
        for p in pm.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    pm.save_pretrained(tmp_path / "adapter")
    if form == "default_keys":  # an adapter written from the raw state dict keeps the adapter name in its keys
        f = tmp_path / "adapter" / "adapter_model.safetensors"
        sd = load_file(f)
        save_file({k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
                   for k, v in sd.items()}, f)
    merged = _params(copy.deepcopy(pm).double().merge_and_unload())
    truth = {}
    for name, w in merged.items():
        ref = original.get(name)
        if ref is None:  # untied by the adapter: the base's head is its embedding
            ref = original["model.embed_tokens.weight"]
        truth[name] = (w - ref, ref) if w.shape == ref.shape else (w, ref)
    return tmp_path / "base", tmp_path / "adapter", truth, pm


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= 1e-6 * abs(want) + 1e-12


@pytest.mark.parametrize("form", list(FORMS))
def test_form_is_measured_exactly(tmp_path, form):
    base, adapter, truth, pm = _build(tmp_path, form)
    rows = displacement(str(base), str(adapter)).to_dict(orient="records")
    whole = {r["name"]: r for r in rows if not isinstance(r["part_of"], str)}
    assert set(whole) == set(truth), (set(whole) ^ set(truth))  # exactly the tensors the tuned model has
    moved = 0
    for name, (delta, ref) in truth.items():
        r = whole[name]
        if delta.shape != ref.shape:  # a resized vocabulary: the shared rows, and the added rows apart
            n = ref.shape[0]
            assert _close(r["delta_fro"], float((delta[:n] - ref).norm())), name
            added = next(x for x in rows if x["name"] == f"{name}[added]")
            assert _close(added["delta_fro"], float(delta[n:].norm())) and added["part_of"] is not None
            moved += 1
            continue
        assert _close(r["delta_fro"], float(delta.norm())), (name, r["delta_fro"], float(delta.norm()))
        assert _close(r["ref_fro"], float(ref.norm())), name
        moved += float(delta.norm()) > 0
    assert moved  # the form moved something: equal figures are not two zeros
    parts: dict[str, float] = {}  # a fused tensor's parts (GPT-2's c_attn q / k / v) add up to the tensor
    for r in rows:
        if isinstance(r["part_of"], str) and not r["name"].endswith(("[added]", "[removed]")):
            parts[r["name"].split("[")[0]] = parts.get(r["name"].split("[")[0], 0.0) + r["delta_fro"] ** 2
    for name, sq in parts.items():
        assert _close(math.sqrt(sq), whole[name]["delta_fro"]), name
    if FORMS[form][2]().to_dict().get("init_lora_weights") in ("pissa", "olora"):
        return  # in memory, the original base is gone: the trainer's records measure the update alone
    live = lora_rows(pm)  # the trainer's records of the same model in memory
    for r in live:
        if not isinstance(r.get("part_of"), str) and r["name"] in truth:
            assert _close(r["delta_fro"], float(truth[r["name"]][0].norm())), (r["name"], r["delta_fro"])


def _adapter_with(tmp_path, **changes):
    base, adapter, _, _ = _build(tmp_path, "lora")
    cfg_path = adapter / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))
    return base, adapter


REFUSED = {  # config changes -> the reason said
    "pissa_niter": ({"init_lora_weights": "pissa_niter_4"}, "randomized SVD"),
    "corda": ({"init_lora_weights": "corda"}, "calibration data"),
    "lora_ga": ({"init_lora_weights": "lora_ga"}, "calibration data"),
    "layer_replication": ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication"),
    "prompt_tuning": ({"peft_type": "PROMPT_TUNING"}, "virtual tokens"),
    "unknown_type": ({"peft_type": "NOT_A_PEFT_TYPE"}, "unknown to the installed peft"),
}


@pytest.mark.parametrize("form", list(REFUSED))
def test_unmeasurable_form_is_one_line_from_every_command(tmp_path, cli, form):
    changes, reason = REFUSED[form]
    base, adapter = _adapter_with(tmp_path, **changes)
    prompts = tmp_path / "p.txt"
    prompts.write_text("1 2 3\n")
    lines = []
    for args in (("displacement", str(base), str(adapter)), ("shift", str(base), str(adapter), "--prompts",
                                                              str(prompts))):
        proc = cli(*args)
        assert_bad_input(proc)
        assert reason in proc.stderr
        lines.append(proc.stderr.strip())
    assert lines[0] == lines[1]  # the same answer from every command


def test_rewritten_base_residual_option(tmp_path):
    """PiSSA against the residual it left is the update alone: tuned - residual, each from peft."""
    base, adapter, truth, pm = _build(tmp_path, "pissa")
    residual = {n.replace("base_model.model.", "").replace(".base_layer", ""): p.detach().double()
                for n, p in pm.named_parameters() if ".base_layer.weight" in n}
    tuned = _params(copy.deepcopy(pm).double().merge_and_unload())
    rows = {r["name"]: r for r in displacement(str(base), str(adapter), against="residual").to_dict("records")}
    for name, w_res in residual.items():
        assert _close(rows[name]["delta_fro"], float((tuned[name] - w_res).norm()))
        assert _close(rows[name]["ref_fro"], float(w_res.norm()))
    assert any(not _close(rows[n]["delta_fro"], float(truth[n][0].norm())) for n in residual)  # not the default


def _kl(p_logits, q_logits):
    p, q = F.log_softmax(p_logits.double(), -1), F.log_softmax(q_logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1)


PROMPTS = ["12 + 30 = 42 and then some more", "hello", "What is 7 times 8? The answer is"]


@pytest.mark.parametrize("form", ["dora", "bias_all", "pissa", "loha"])
def test_shift_sees_the_tuned_model(tmp_path, form):
    """shift's output KL and last-layer lens KL are the merged model's own, against the original base (the forms
    whose disabled adapter does not give the base back: trained base biases, an init that rewrote the base)."""
    family, tied, make = FORMS[form]
    folder = family_folder(family, tmp_path / "base")
    from mechdiag.models import load_tokenizer

    tok = load_tokenizer(str(folder))
    base = AutoModelForCausalLM.from_pretrained(folder).eval()
    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), make())
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in pm.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    pm.save_pretrained(tmp_path / "adapter")
    tuned = copy.deepcopy(pm).merge_and_unload().eval()
    last, every = [], []
    with torch.no_grad():
        for text in PROMPTS:
            ids = torch.tensor([tok(text)["input_ids"]])
            kl = _kl(base(ids).logits[0], tuned(ids).logits[0])
            last.append(float(kl[-1]))
            every.extend(kl.tolist())
    df = shift(str(folder), str(tmp_path / "adapter"), PROMPTS, device="cpu")
    assert max(last) > 0
    assert df["logit_kl"].iloc[-1] == pytest.approx(sum(last) / len(last), rel=1e-4)
    assert df["output_kl"].iloc[0] == pytest.approx(sum(every) / len(every), rel=1e-4)
    assert math.isfinite(df["shift"].iloc[-1])


LENS_CASES = [(f, False) for f in MATRIX] + [("qwen2", True)]


@pytest.mark.parametrize(("family", "tied"), LENS_CASES, ids=[f"{f}{'-tied' if t else ''}" for f, t in LENS_CASES])
def test_last_layer_lens_is_the_models_own_next_token_kl(tmp_path, family, tied):
    """The logit lens is one definition of the model's head after its last block (final norm, head, soft cap or
    scaling): on every family of the matrix, the last layer's logit_kl equals the models' own next-token KL at the
    last position of each prompt, and output_kl their mean over every position, each prompt run alone (shift runs
    them padded in one batch)."""
    folder = family_folder(family, tmp_path / "base")
    if tied:
        model = AutoModelForCausalLM.from_pretrained(folder)
        model.config.tie_word_embeddings = True
        model.tie_weights()
        model.save_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert not tied or base.get_output_embeddings().weight is base.get_input_embeddings().weight
    torch.manual_seed(2)
    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(folder),
                        peft.LoraConfig(r=2, target_modules="all-linear", init_lora_weights=False))
    pm.save_pretrained(tmp_path / "adapter")
    from mechdiag.models import load_tokenizer

    tok = load_tokenizer(str(folder))
    last, every = [], []
    with torch.no_grad():
        for text in PROMPTS:
            ids = torch.tensor([tok(text)["input_ids"]])
            kl = _kl(base(ids).logits[0], pm(input_ids=ids).logits[0])
            last.append(float(kl[-1]))
            every.extend(kl.tolist())
    df = shift(str(folder), str(tmp_path / "adapter"), PROMPTS, device="cpu", batch_size=len(PROMPTS))
    assert max(last) > 0
    assert df["logit_kl"].iloc[-1] == pytest.approx(sum(last) / len(last), rel=1e-4, abs=1e-10)
    assert df["output_kl"].iloc[0] == pytest.approx(sum(every) / len(every), rel=1e-4, abs=1e-10)


@pytest.mark.parametrize("form", ["dora", "dora_conv1d", "lora_bias"])
def test_attribute_switches_a_module_off_to_its_base(form):
    """attribute's "module off" is the base module itself for every LoRA form it switches: B (and a lora_bias)
    zero, a DoRA magnitude set to the base's own row norms (B = 0 alone would leave m / ||W|| scaling W)."""
    from mechdiag.attribute import _switches

    family, tied, make = FORMS[form]
    base = _model(family, tied)
    ids = torch.randint(0, base.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    pm = get_peft_model(copy.deepcopy(base), make())
    with torch.no_grad():
        want = base(ids).logits
        for p in pm.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
        assert not torch.allclose(pm(ids).logits, want, atol=1e-4)
        for m in pm.modules():
            if "default" in getattr(m, "lora_B", {}):
                for w, _, off in _switches(m, "default"):
                    w.copy_(off)
        assert torch.allclose(pm(ids).logits, want, rtol=0, atol=1e-5)
