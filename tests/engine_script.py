"""A user's own TRL script under a multi-process engine: GRPOTrainer + LoRA + MechdiagCallback, launched by torchrun.

    torchrun --nproc_per_node 2 -m tests.engine_script ENGINE OUT_DIR   # ENGINE: one of tests.engines.ENGINES
    torchrun --nproc_per_node 2 -m tests.engine_script ENGINE OUT_DIR STEPS   # bench/engines.py: defaults

TRL's output_dir is OUT_DIR (checkpoint-2/ at the last step, the adapter saved by save_model), the callback's run
in OUT_DIR/mechdiag/, and OUT_DIR/ranks/RANK.json each rank's view of the world (rank, world size, the engine the
Accelerator ran), written by each rank into its own file so a test can assert two processes ran.
"""

from __future__ import annotations

import sys
from pathlib import Path

from datasets import Dataset
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

from mechdiag import config as C
from mechdiag import models, tasks
from mechdiag.integrations.trl import MechdiagCallback, save_adapter, task_reward_funcs
from tests import engines

STEPS = 2


def main(engine: str, out: str, steps: int = STEPS, bench: bool = False) -> None:
    """bench: the callback at its defaults (displacement every 10 steps and at the end, no evaluation), for
    bench/engines.py; rank 0's ranks file then has train_runtime and recorder_s."""
    engines.allow_cpu_engine(engine)
    cfg = C.load(None, ["eval_n=4", "threads=1", f"max_steps={steps}", "max_completion_tokens=8"])
    tasks.resolve_rewards(cfg)
    model, tok = models.load_model_and_tokenizer(cfg.model.name_or_path, cfg.model.dtype)
    task = tasks.get_task(cfg.task.name, cfg.task.path, **cfg.task.options)
    train = task.examples("train", n=16, seed=1)
    data = Dataset.from_list([{"prompt": task.prompt(ex, tok), "example_id": ex.id} for ex in train])
    funcs, weights = task_reward_funcs(task, train, cfg.rewards.weights)

    def spread(completions=None, **_):  # differs within a group, so the advantages and the LoRA updates are not 0
        return [sum(map(ord, c)) % 7 / 7 for c in completions]

    funcs, weights = [*funcs, spread], [*weights, 1.0]
    args = GRPOConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=cfg.max_completion_tokens, logging_steps=1, save_strategy="no",
                      learning_rate=5e-3, beta=0.0, temperature=1.5, report_to=[], seed=1, reward_weights=weights,
                      top_k=0, remove_unused_columns=False, disable_tqdm=True, **engines.trainer_args(engine))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM",
                      init_lora_weights=False)  # B != 0: the displacement is non-zero from the start
    cb = MechdiagCallback(config=cfg) if bench else \
        MechdiagCallback(config=cfg, evaluate="heldout", displacement_every=1, shift_prompts=["1+1=", "2+3="],
                         forget_prompts=["Once upon a time"], forget_tokens=4)
    trainer = GRPOTrainer(model=model, reward_funcs=funcs, args=args, train_dataset=data, processing_class=tok,
                          peft_config=lora, callbacks=[cb])
    result = trainer.train()
    save_adapter(trainer, Path(out) / "final")  # a collective under FSDP and ZeRO-3: every rank
    engines.record_rank(Path(out), trainer.accelerator, train_runtime=result.metrics["train_runtime"],
                        recorder_s=cb.recorder_s, recorder_once_s=cb.recorder_once_s)
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *([int(sys.argv[3]), True] if len(sys.argv) > 3 else []))
