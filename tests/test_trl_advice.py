"""Advice in the TRL user's own terms: a vanilla GRPOTrainer run that mechdiag did not start is read with its real
GRPOConfig (training_args.bin through a restricted unpickler) and LoRA config (adapter_config.json), and
recommend states each change from those values and as GRPOConfig/LoraConfig fields."""

from __future__ import annotations

import ast
import json
import os
import pickle
import zipfile

import pytest
import torch
from click.testing import CliRunner

from mechdiag import config as C
from mechdiag.cli import main
from mechdiag.errors import UserError
from mechdiag.integrations.trl_args import read_training_args

torch.set_num_threads(1)
# 8 steps: the rules judge from 8 train records (too_few_records); a budget of 6 tokens: every completion is cut
STEPS, BUDGET = 8, 6


def _length(prompts=None, completions=None, **_):
    return [min(len(c), 40) / 40 for c in completions]


@pytest.fixture(scope="module")
def vanilla(stories260k, tmp_path_factory):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    out = tmp_path_factory.mktemp("vanilla") / "out"
    tok = AutoTokenizer.from_pretrained(stories260k)
    tok.pad_token_id = 0
    data = Dataset.from_list([{"prompt": f"Once upon a time, story {i}"} for i in range(16)])
    args = GRPOConfig(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=BUDGET, logging_steps=1, save_steps=STEPS, bf16=False, use_cpu=True,
                      gradient_checkpointing=False, learning_rate=3e-3, beta=0.0, temperature=0.9, report_to=[],
                      seed=7, disable_tqdm=True)
    GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(stories260k), reward_funcs=[_length], args=args,
                train_dataset=data, processing_class=tok,
                peft_config=LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                       task_type="CAUSAL_LM")).train()
    return out


def test_real_grpo_config_is_recovered(vanilla, tmp_path):
    fields = read_training_args(vanilla / f"checkpoint-{STEPS}" / "training_args.bin")
    assert (fields["max_completion_length"], fields["learning_rate"], fields["num_generations"]) == (BUDGET, 3e-3, 4)
    result = CliRunner().invoke(main, ["recommend", str(vanilla), "--out", str(tmp_path / "refined.yaml")])
    assert result.exit_code == 0, result.output
    text = result.stdout
    records = json.loads(CliRunner().invoke(main, ["recommend", str(vanilla), "--format", "json"]).stdout)
    changes = [r["change"] for r in records if r.get("kind") == "finding"]
    assert f"max_completion_tokens: {BUDGET} -> " in " ".join(changes), changes  # from the run's 6, not our default
    refined = C.load(tmp_path / "refined.yaml")
    assert refined.learning_rate == 3e-3 and refined.temperature == 0.9 and refined.lora.r == 2  # the run's own
    assert refined.max_completion_tokens > BUDGET
    snippet = (tmp_path / "refined.trl.py").read_text()
    ast.parse(snippet)  # a pasteable Python snippet
    assert f"max_completion_length={refined.max_completion_tokens}" in snippet and "GRPOConfig" in snippet
    assert "as TRL settings" in text and "max_completion_length=" in text


def test_hostile_training_args_never_run(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    bad = tmp_path / "training_args.bin"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("training_args/data.pkl", pickle.dumps(Evil()))
    with pytest.raises(UserError, match="refused"):
        read_training_args(bad)
    assert not marker.exists()
    bad.write_bytes(b"not a zip")
    with pytest.raises(UserError, match="torch.save"):
        read_training_args(bad)
