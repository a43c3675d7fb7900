"""Activation shift (mechdiag.probes): exactness on planted changes, padding invariance, LoRA toggling on the real
stories260K model, the trainer's in-memory API, real probe prompts from ../shared/data, and bad input."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import mechdiag.errors
from mechdiag.cli import main
from mechdiag.probes.shift import bootstrap_ci, shift, shift_inmemory
from mechdiag.tasks import REGISTRY, register
from mechdiag.tasks.base import Example, Task
from tests.helpers import assert_bad_input

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft on transformers 5
METRICS = ["shift", "ci_low", "ci_high", "shift_pooled", "cos_dist", "increment", "logit_kl"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
PROMPTS = ["Once upon a time there was a little cat.", "Lily went to the park", "The sun",
           "Tom and his dog played all day long in the big green garden near the old house.", "Hi"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_llama(n_layers=3, hidden=32, vocab=512, seed=0) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=n_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def save(model, path, tokenizer_from=None):
    model.save_pretrained(path)
    if tokenizer_from is not None:
        for f in TOKENIZER_FILES:
            shutil.copy(tokenizer_from / f, path / f)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, stories260k):
    """A tiny random Llama (3 layers, hidden 32) with the stories260K tokenizer, and a copy changed in the last
    block only."""
    root = tmp_path_factory.mktemp("tiny")
    base = tiny_llama()
    tuned = tiny_llama()
    with torch.no_grad():
        w = tuned.model.layers[-1].mlp.down_proj.weight
        w.add_(0.05 * torch.randn_like(w))
    return {"base": save(base, root / "base", stories260k), "tuned": save(tuned, root / "tuned", stories260k),
            "model": base}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, stories260k):
    """A random (non-zero) LoRA on the real stories260K model, on layers 3-4 only, and its merged checkpoint."""
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(stories260k)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                            layers_to_transform=[3, 4], init_lora_weights=False))
    peft.save_pretrained(root / "adapter")
    merged = peft.merge_and_unload()
    return {"adapter": root / "adapter", "merged": save(merged, root / "merged", stories260k)}


def direct_shift(ref, tuned, tokenizer, prompts):
    """Eq. 13 and the per-prompt mean by hand: plain forward hooks, one prompt at a time, position 0 dropped."""
    def hidden(model, ids):
        outs = []
        hooks = [layer.register_forward_hook(lambda m, a, o: outs.append(o[0] if isinstance(o, tuple) else o))
                 for layer in model.model.layers]
        with torch.no_grad():
            logits = model(ids).logits[0]
        for h in hooks:
            h.remove()
        return [o[0, 1:].double() for o in outs], logits.double()

    num, den, ratios, kl, n_kl = 0.0, 0.0, [], 0.0, 0
    for p in prompts:
        ids = torch.tensor([tokenizer(p)["input_ids"]])
        hr, lr = hidden(ref, ids)
        ht, lt = hidden(tuned, ids)
        d = np.array([((a - b) ** 2).sum().item() for a, b in zip(ht, hr, strict=True)])
        r = np.array([(b ** 2).sum().item() for b in hr])
        num, den = num + d, den + r
        ratios.append(np.sqrt(d / r))
        pr, pt = torch.log_softmax(lr, -1), torch.log_softmax(lt, -1)
        kl += (pr.exp() * (pr - pt)).sum().item()
        n_kl += ids.shape[1]
    return np.sqrt(num / den), np.mean(ratios, axis=0), kl / n_kl


def test_change_in_last_block_only_shows_at_last_layer(tiny):
    df = shift(tiny["base"], tiny["tuned"], PROMPTS, batch_size=2)
    assert list(df["layer"]) == [0, 1, 2] and not df.attrs["shared"]
    early = df.iloc[:-1]
    assert (early[METRICS].abs() <= 1e-6).all().all(), early
    last = df.iloc[-1]
    assert last["shift"] > 1e-3 and last["increment"] > 1e-3 and last["cos_dist"] > 0 and last["logit_kl"] > 0
    assert last["ci_low"] <= last["shift"] <= last["ci_high"]
    assert df["output_kl"].iloc[0] > 0


def test_identical_models_give_zeros(tiny):
    for tuned in (tiny["base"], tiny["tuned"].parent / "base"):  # the same folder, and via a second load
        df = shift(tiny["base"], tuned, PROMPTS[:3], batch_size=2)
        assert (df[METRICS + ["output_kl"]].abs() <= 1e-12).all().all(), df


def test_matches_hand_computation_with_forward_hooks(tiny, stories260k):
    ref = AutoModelForCausalLM.from_pretrained(tiny["base"]).eval()
    tun = AutoModelForCausalLM.from_pretrained(tiny["tuned"]).eval()
    pooled, mean, out_kl = direct_shift(ref, tun, AutoTokenizer.from_pretrained(stories260k), PROMPTS)
    df = shift(tiny["base"], tiny["tuned"], PROMPTS, batch_size=3)
    np.testing.assert_allclose(df["shift_pooled"], pooled, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(df["shift"], mean, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(df["output_kl"].iloc[0], out_kl, rtol=1e-4)


def test_lora_adapter_on_stories260k_toggles_one_model(stories260k, adapter):
    df = shift(stories260k, adapter["adapter"], PROMPTS, batch_size=4)
    assert df.attrs["shared"] and len(df) == 5
    assert (df.loc[df["layer"] < 3, METRICS].abs() <= 1e-6).all().all(), df  # LoRA only on layers 3, 4
    assert (df.loc[df["layer"] >= 3, "shift"] > 1e-3).all()
    merged = shift(stories260k, adapter["merged"], PROMPTS, batch_size=4)  # a second model in memory
    assert not merged.attrs["shared"]
    np.testing.assert_allclose(merged[METRICS + ["output_kl"]], df[METRICS + ["output_kl"]], rtol=1e-4, atol=1e-5)


def test_adapter_as_base_switches_adapters_on_one_model(stories260k, adapter):
    same = shift(adapter["adapter"], adapter["adapter"], PROMPTS[:3])  # both sides adapters on one base
    assert same.attrs["shared"] and (same[METRICS + ["output_kl"]].abs() <= 1e-12).all().all(), same
    rev = shift(adapter["adapter"], stories260k, PROMPTS[:3])  # reference = adapter on, tuned = plain base
    assert rev.attrs["shared"]
    assert (rev.loc[rev["layer"] < 3, METRICS].abs() <= 1e-6).all().all()
    assert (rev.loc[rev["layer"] >= 3, "shift"] > 1e-3).all()


def test_batched_equals_one_by_one(stories260k, adapter):
    prompts = PROMPTS + ["A", "The bird sang a song to the moon and the stars."]
    one = shift(stories260k, adapter["adapter"], prompts, batch_size=1)
    many = shift(stories260k, adapter["adapter"], prompts, batch_size=4)
    cols = METRICS + ["output_kl", "n_tokens", "n_prompts"]
    np.testing.assert_allclose(many[cols].to_numpy(), one[cols].to_numpy(), rtol=1e-5, atol=1e-5)


def test_keep_bos_counts_position_zero(stories260k, adapter):
    a = shift(stories260k, adapter["adapter"], PROMPTS, batch_size=5)
    b = shift(stories260k, adapter["adapter"], PROMPTS, batch_size=5, keep_bos=True)
    assert (b["n_tokens"] - a["n_tokens"] == len(PROMPTS)).all()
    assert not np.allclose(a.loc[a["layer"] >= 3, "shift"], b.loc[b["layer"] >= 3, "shift"])


def _without_bos(folder):
    """The same model with a tokenizer that adds no BOS (no template post-processor, add_bos_token false)."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": False}))
    return folder


def test_position_zero_is_dropped_only_when_it_is_bos(tiny, tmp_path):
    """A tokenizer that adds no BOS: position 0 is a real token and counts; the output says which happened."""
    nobos = {k: _without_bos(shutil.copytree(tiny[k], tmp_path / k)) for k in ("base", "tuned")}
    tok = AutoTokenizer.from_pretrained(nobos["base"])
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    assert all(i[0] != tok.bos_token_id for i in ids)
    df = shift(nobos["base"], nobos["tuned"], PROMPTS, batch_size=2)
    assert (df["n_tokens"] == sum(map(len, ids))).all()  # nothing dropped
    assert df.attrs["bos_dropped"] == 0
    with_bos = shift(tiny["base"], tiny["tuned"], PROMPTS, batch_size=2)  # the stories260K tokenizer adds BOS
    assert (with_bos["n_tokens"] == sum(map(len, ids))).all() and with_bos.attrs["bos_dropped"] == len(PROMPTS)
    # by hand, every position counted: the last block's pooled shift over all tokens
    ref = AutoModelForCausalLM.from_pretrained(nobos["base"]).eval()
    tun = AutoModelForCausalLM.from_pretrained(nobos["tuned"]).eval()
    num = den = 0.0
    def last_block(model, i):
        out = []
        hook = model.model.layers[-1].register_forward_hook(lambda m, a, o: out.append(o[0] if isinstance(o, tuple)
                                                                                      else o))
        with torch.no_grad():
            model(torch.tensor([i]))
        hook.remove()
        return out[0].double()

    for i in ids:
        hr, ht = last_block(ref, i), last_block(tun, i)
        num, den = num + ((ht - hr) ** 2).sum().item(), den + (hr ** 2).sum().item()
    assert df["shift_pooled"].iloc[-1] == pytest.approx((num / den) ** 0.5, rel=1e-4)
    proc = invoke("shift", nobos["base"], nobos["tuned"], "--prompts", _probe(tmp_path), "--format", "json")
    assert proc.returncode == 0 and "no prompt starts with BOS: every position counted" in proc.stderr
    proc = invoke("shift", tiny["base"], tiny["tuned"], "--prompts", _probe(tmp_path), "--format", "json")
    assert proc.returncode == 0 and "position 0 (BOS) left out of the norms in 2 of 2 prompts" in proc.stderr


def _probe(tmp_path):
    p = tmp_path / "probe.txt"
    p.write_text("Once upon a time\nThe cat sat.\n")
    return p


def test_shift_inmemory_matches_saved_adapter(stories260k, adapter):
    torch.manual_seed(1)
    tok = AutoTokenizer.from_pretrained(stories260k)
    model = AutoModelForCausalLM.from_pretrained(stories260k)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                            layers_to_transform=[3, 4], init_lora_weights=False, lora_dropout=0.5))
    peft.train()
    ids = torch.tensor([tok(PROMPTS[0])["input_ids"]])
    peft.eval()
    with torch.no_grad():
        before = peft(input_ids=ids).logits
    peft.train()
    rows = shift_inmemory(peft, tok, PROMPTS, batch_size=2, step=7)
    again = shift_inmemory(peft, tok, PROMPTS, batch_size=3, step=8)
    assert peft.training  # training mode restored
    assert [r["layer"] for r in rows] == [0, 1, 2, 3, 4] and {r["step"] for r in rows} == {7}
    want = {"step", "layer", "shift", "ci_low", "ci_high", "cos_dist", "increment", "logit_kl", "output_kl"}
    assert want <= set(rows[0])
    got = pd.DataFrame(rows)
    np.testing.assert_allclose(pd.DataFrame(again)[METRICS], got[METRICS], rtol=1e-5, atol=1e-6)
    saved = shift(stories260k, adapter["adapter"], PROMPTS)  # same seed, same LoRA init as the fixture
    np.testing.assert_allclose(got[METRICS + ["output_kl"]], saved[METRICS + ["output_kl"]], rtol=1e-5, atol=1e-6)
    peft.eval()
    with torch.no_grad():
        torch.testing.assert_close(peft(input_ids=ids).logits, before)  # adapter active again, nothing left hooked
    with pytest.raises(mechdiag.errors.UserError, match="PEFT"):
        shift_inmemory(tiny_llama(), tok, PROMPTS)


def test_bootstrap_interval():
    rng = np.random.default_rng(3)
    x = rng.normal(1.0, 0.2, size=(400, 2))
    lo, hi = bootstrap_ci(x, n_boot=2000, seed=0)
    half = 1.96 * x.std(0) / np.sqrt(len(x))
    np.testing.assert_allclose(hi - lo, 2 * half, rtol=0.15)
    assert ((lo < x.mean(0)) & (x.mean(0) < hi)).all()
    lo, hi = bootstrap_ci(np.full((10, 1), 0.3))
    assert lo[0] == pytest.approx(0.3) and hi[0] == pytest.approx(0.3)


def test_api_probe_file(tmp_path, tiny):
    probe = tmp_path / "p.jsonl"
    probe.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    from_file = shift(tiny["base"], tiny["tuned"], probe)
    np.testing.assert_allclose(from_file["shift"], shift(tiny["base"], tiny["tuned"], PROMPTS[:3])["shift"])
    with pytest.raises(mechdiag.errors.UserError, match="list of strings"):
        shift(tiny["base"], tiny["tuned"], str(probe))


# ---- CLI -------------------------------------------------------------------------------------------------------
def invoke(*args: str) -> subprocess.CompletedProcess:
    """Run the CLI in-process (torch is already imported) and shape the result like a subprocess."""
    result = CliRunner().invoke(main, [str(a) for a in args], env={"COLUMNS": "160"})  # tables fit COLUMNS
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def arc_questions(data_dir, n):
    path = data_dir / "arc_challenge" / "ARC-Challenge-Test.ai2format.partial.jsonl"
    lines = path.read_text().splitlines()[:n]
    return [json.loads(ln)["question"]["stem"] for ln in lines]


def test_cli_arc_questions_json_and_html(cli, tmp_path, stories260k, adapter, data_dir, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    questions = arc_questions(data_dir, 12)
    probe = tmp_path / "arc.jsonl"
    probe.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in questions))
    html = tmp_path / "shift.html"
    proc = cli("shift", str(stories260k), str(adapter["adapter"]), "--prompts", str(probe), "--n", "10",
               "--batch-size", "4", "--format", "json", "--html", str(html))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    records = json.loads(proc.stdout)
    assert [r["layer"] for r in records] == [0, 1, 2, 3, 4]
    for r in records:
        assert {"layer", "shift", "ci_low", "ci_high", "cos_dist", "increment", "logit_kl", "output_kl"} <= set(r)
        assert r["n_prompts"] == 10 and r["ci_low"] <= r["shift"] <= r["ci_high"]
    assert records[0]["shift"] < 1e-6 < records[4]["shift"]
    assert html.stat().st_size > 10_000 and "plotly" in html.read_text()[:100_000].lower()


def test_cli_mbpp_texts_plain_lines_csv_and_parquet(tmp_path, stories260k, adapter, data_dir):
    texts = [json.loads(ln)["text"] for ln in (data_dir / "mbpp" / "mbpp.jsonl").read_text().splitlines()[10:18]]
    probe = tmp_path / "mbpp.txt"
    probe.write_text("\n".join(texts) + "\n")
    out = tmp_path / "rows.csv"
    proc = invoke("shift", stories260k, adapter["adapter"], "--prompts", probe, "--format", "csv", "--out", out)
    assert proc.returncode == 0, proc.stderr
    csv = pd.read_csv(out)
    assert len(csv) == 5 and (csv["n_prompts"] == 8).all()
    pq = tmp_path / "rows.parquet"
    assert invoke("shift", stories260k, adapter["adapter"], "--prompts", probe, "--format", "parquet",
                  "--out", pq).returncode == 0
    np.testing.assert_allclose(pd.read_parquet(pq)["shift"], csv["shift"], rtol=1e-9)
    table = invoke("shift", stories260k, adapter["adapter"], "--prompts", probe, "--n", "3")
    assert table.returncode == 0 and "3 prompts" in table.stdout and "logit_kl" in table.stdout


def test_cli_truncates_long_prompts_and_reports_count(tmp_path, stories260k, adapter):
    probe = tmp_path / "long.txt"
    probe.write_text("Once upon a time " * 200 + "\nThe cat sat.\n")  # ~800 tokens > the 512-token context
    proc = invoke("shift", stories260k, adapter["adapter"], "--prompts", probe, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert "1 of 2 prompts truncated to 512 tokens" in proc.stderr
    rec = json.loads(proc.stdout)[0]
    n_short = len(AutoTokenizer.from_pretrained(stories260k)("The cat sat.")["input_ids"])
    assert rec["n_tokens"] == (512 - 1) + (n_short - 1)  # position 0 dropped from each prompt
    short = invoke("shift", stories260k, adapter["adapter"], "--prompts", probe, "--max-length", "6")
    assert "2 of 2 prompts truncated to 6 tokens" in short.stderr


class ToyTask(Task):
    name = "toy_shift"

    def __init__(self, path=None, **options):
        self.path = path

    def examples(self, split, n=None, seed=0):
        qs = ["What is two plus two?", "Name a colour.", "Where do fish live?"]
        return [Example(id=str(i), question=q, answer="") for i, q in enumerate(qs)][:n]

    def prompt(self, example, tokenizer=None):
        assert tokenizer is not None  # tasks format with the model's tokenizer (its chat template if any)
        return f"Question: {example.question}\nAnswer:"


def test_cli_task_prompts(stories260k, adapter):
    register("toy_shift", "tests.test_shift:ToyTask")
    try:
        proc = invoke("shift", stories260k, adapter["adapter"], "--task", "toy_shift", "--n", "2", "--format",
                      "json")
    finally:
        REGISTRY.pop("toy_shift")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)[0]["n_prompts"] == 2
    assert_bad_input(invoke("shift", stories260k, adapter["adapter"], "--task", "no_such_task"))


def test_bad_input_subprocess(cli, tmp_path, stories260k, adapter, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    proc = cli("shift", str(stories260k), str(adapter["adapter"]), "--prompts", str(empty))
    assert_bad_input(proc)
    assert "no prompts" in proc.stderr


def test_bad_input(tmp_path, tiny, stories260k, adapter):
    good = tmp_path / "p.txt"
    good.write_text("Once upon a time\n")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81garbage")
    nofield = tmp_path / "x.jsonl"
    nofield.write_text('{"text": "hi"}\n')
    vocab = save(tiny_llama(vocab=600), tmp_path / "vocab600")
    deeper = save(tiny_llama(n_layers=4), tmp_path / "deeper")
    gpt2 = save(GPT2LMHeadModel(GPT2Config(vocab_size=512, n_embd=32, n_layer=3, n_head=4, n_positions=128)),
                tmp_path / "gpt2")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(tiny["base"] / "config.json", pickled / "config.json")
    torch.save(tiny["model"].state_dict(), pickled / "pytorch_model.bin")
    cases = [
        ((tiny["base"], vocab, "--prompts", good), "vocabulary"),
        ((tiny["base"], deeper, "--prompts", good), "number of layers"),
        ((tiny["base"], gpt2, "--prompts", good), "architecture"),
        ((tiny["base"], stories260k, "--prompts", good), "differ"),
        ((tiny["base"], pickled, "--prompts", good), "pickle"),
        ((tiny["base"], tiny["tuned"], "--prompts", tmp_path / "missing.txt"), "not found"),
        ((tiny["base"], tiny["tuned"], "--prompts", tmp_path), "cannot read"),
        ((tiny["base"], tiny["tuned"], "--prompts", binary), "cannot read"),
        ((tiny["base"], tiny["tuned"], "--prompts", nofield), "prompt"),
        ((tiny["base"], tiny["tuned"]), "exactly one of"),
        ((tiny["base"], tmp_path / "nope", "--prompts", good), "not found"),
        ((tiny["base"], tiny["tuned"], "--prompts", good, "--format", "parquet"), "--out"),
    ]
    for args, needle in cases:
        proc = invoke("shift", *args)
        assert_bad_input(proc)
        assert needle in proc.stderr, (args, proc.stderr)
