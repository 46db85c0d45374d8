"""One TRL `GRPOTrainer` run on the benchmark shape (bench/), timed per step; runs in the TRL venv only.

`grpo_vs_trl.py` starts it with `bench/.venv-trl/bin/python` (TRL is never installed in the main venv). The
config mirrors `run_flowrl.py`'s flow: one generation batch of 16 prompts x 8 = 128 rows per optimizer step,
exactly 32 completion tokens (`min_new_tokens`), beta 0.04, clip 0.2, constant LR, AdamW, fp32 on CPU, no vLLM,
no logging. A callback stamps each optimizer step's end; the step time is the gap between consecutive stamps
(generation, scoring, reference forward, loss, backward and the optimizer step all fall inside it). The
trainer's rollout phase and its `model.generate` call are timed by wrapping the two methods.
Run alone: `bench/.venv-trl/bin/python bench/run_trl.py [--json OUT.json]`.
"""

from __future__ import annotations

import argparse
import functools
import time
import warnings
from collections.abc import Callable
from typing import Any

import grpo_shape as shape
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def reward_fn(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """TRL's batched reward signature around the same per-sample reward flowrl calls."""
    return [shape.reward(p, c, answer=a) for p, c, a in zip(prompts, completions, answer, strict=True)]


class StepClock(TrainerCallback):
    """Stamps the start of training and the end of every optimizer step."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, float, float]] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.marks = [shape.cpu_mark()]

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.marks.append(shape.cpu_mark())


def timed(spans: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spans.append(time.perf_counter() - start)

    return wrapper


def config(out_dir: str, steps: int) -> GRPOConfig:
    return GRPOConfig(
        output_dir=out_dir,
        # One generation batch = one optimizer step: 128 rows, no accumulation, one pass over the samples.
        per_device_train_batch_size=shape.ROWS,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=shape.GROUP,
        num_iterations=1,
        max_steps=steps,
        # Fixed completion length: EOS cannot end a sample before COMPLETION tokens.
        max_completion_length=shape.COMPLETION,
        generation_kwargs={"min_new_tokens": shape.COMPLETION},
        temperature=shape.TEMPERATURE, top_p=1.0, top_k=0,
        # Loss: PPO clip with KL (k3) to the reference, token-mean over the batch, group-normalised advantages.
        beta=shape.BETA, epsilon=shape.CLIP, loss_type="dapo", scale_rewards="group",
        # Optimizer: plain AdamW at a constant LR, grad-norm clip 1.0 (flowrl's TrainEngine).
        learning_rate=shape.LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=shape.MAX_GRAD_NORM,
        # fp32 on CPU, no vLLM, no logging, no checkpoints, no workers.
        use_cpu=True, bf16=False, fp16=False, use_vllm=False, disable_dropout=True,
        report_to="none", logging_steps=10**9, save_strategy="no", disable_tqdm=True, log_completions=False,
        dataloader_num_workers=0, dataloader_pin_memory=False,
        seed=shape.SEED,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--steps", type=int, default=shape.STEPS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    data = Dataset.from_list(shape.prompt_rows())
    trainer = GRPOTrainer(
        model=str(shape.CKPT),
        reward_funcs=reward_fn,
        args=config(str(shape.OUT / "trl_run"), args.steps),
        train_dataset=data,
    )
    rollout_spans: list[float] = []
    generate_spans: list[float] = []
    trainer._generate_and_score_completions = timed(rollout_spans, trainer._generate_and_score_completions)
    trainer._generate_single_turn = timed(generate_spans, trainer._generate_single_turn)
    clock = StepClock()
    trainer.add_callback(clock)
    model = trainer.model
    assert model is not None
    dtype = str(next(model.parameters()).dtype)
    trainer.train()

    steps = [b[0] - a[0] for a, b in zip(clock.marks, clock.marks[1:], strict=False)]
    result = {
        "system": "trl",
        "torch_threads": torch.get_num_threads(),
        "dtype": dtype,
        "step_s": steps,
        "others_cores": shape.others_cores(clock.marks),
        "cpu_s": shape.cpu_seconds(clock.marks),
        # Per step: model.generate, the rest of the rollout phase (decode, reward, ref log-probs, advantages,
        # metrics), and the rest of the step (loss forward + backward, clip, AdamW, Trainer bookkeeping).
        "phases": {
            "model.generate": generate_spans,
            "rest of rollout (score, ref logp, ...)": [r - g for r, g in zip(rollout_spans, generate_spans, strict=True)],
            "loss + backward + AdamW + trainer": [s - r for s, r in zip(steps, rollout_spans, strict=True)],
        },
    }
    shape.write_result(args.json, result)
    print(f"trl: median step {shape.median(shape.steady(steps)):.3f} s over {len(steps)} steps ({dtype})")


if __name__ == "__main__":
    main()
