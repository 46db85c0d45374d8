"""TRL's DPOTrainer or RewardTrainer on the preference benchmark shape (bench/), timed per step; TRL venv only.

`preference_vs_trl.py` starts it with `bench/.venv-trl/bin/python`. Same checkpoint, same pairs in the same order
(a sequential sampler: the first step sees the first BATCH pairs, as flowrl's run does), BATCH pairs per optimizer
step, constant LR, AdamW, fp32 on CPU (TRL's configs default to bf16: switched off), the same torch threads. A callback stamps each optimizer step's end; a
step's time is the gap between consecutive stamps (forwards, loss, backward, optimizer step).
Run alone: `bench/.venv-trl/bin/python bench/run_trl_preference.py dpo|rm [--steps N] [--json OUT.json]`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from typing import Any

import preference_shape as shape
import torch
from datasets import Dataset
from torch.utils.data import SequentialSampler
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    TrainerCallback,
)
from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer


class StepClock(TrainerCallback):
    def __init__(self) -> None:
        self.marks: list[tuple[float, float]] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.marks:
            self.marks.append((time.perf_counter(), time.process_time()))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.marks.append((time.perf_counter(), time.process_time()))


def _in_order(cls: type) -> type:
    """The trainer with a sequential sampler: pairs in file order, as flowrl's run takes them."""

    class InOrder(cls):  # type: ignore[misc, valid-type]
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return SequentialSampler(self.train_dataset)

    return InOrder


def common(out: str, steps: int) -> dict[str, Any]:
    return dict(output_dir=out, per_device_train_batch_size=shape.BATCH, learning_rate=shape.LR,
                lr_scheduler_type="constant", max_steps=steps, max_grad_norm=shape.MAX_GRAD_NORM, logging_steps=1,
                report_to=[], save_strategy="no", use_cpu=True, seed=shape.SEED, dataloader_num_workers=0,
                disable_tqdm=True, max_length=256, bf16=False, fp16=False)  # fp32: TRL defaults to bf16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["dpo", "rm"])
    ap.add_argument("--steps", type=int, default=shape.STEPS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(shape.THREADS)
    data = Dataset.from_list(shape.read_pairs())
    tok = AutoTokenizer.from_pretrained(shape.CKPT)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        if args.kind == "dpo":
            model = AutoModelForCausalLM.from_pretrained(shape.CKPT)
            config = DPOConfig(**common(out, args.steps), beta=shape.BETA, loss_type=["sigmoid"])
            trainer = _in_order(DPOTrainer)(model=model, args=config, train_dataset=data, processing_class=tok,
                                            callbacks=[clock])
        else:
            model = AutoModelForSequenceClassification.from_pretrained(shape.RM_CKPT, num_labels=1)
            config = RewardConfig(**common(out, args.steps))
            trainer = _in_order(RewardTrainer)(model=model, args=config, train_dataset=data, processing_class=tok,
                                               callbacks=[clock])
        trainer.train()
    losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
    times = [b[0] - a[0] for a, b in zip(clock.marks, clock.marks[1:], strict=False)]
    cpu = [b[1] - a[1] for a, b in zip(clock.marks, clock.marks[1:], strict=False)]
    result = {"times": times, "cpu": cpu, "losses": losses}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f)
    else:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
