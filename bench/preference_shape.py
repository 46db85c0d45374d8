"""The shared preference benchmark shape (bench/): one tiny checkpoint, one set of prompt-heavy pairs, for flowrl's
DPO and reward-model steps and TRL's DPOTrainer and RewardTrainer.

`preference_vs_trl.py` writes the inputs once under bench/out/preference/; `run_trl_preference.py` (TRL venv) reads
them. Pairs are prompt-heavy, as preference data with system prompts or few-shot context is: a prompt of FEWSHOT
solved additions before the question (~135 tokens), the correct sum chosen over a wrong one (3-5 tokens each), so
a pair's two rows share almost all of their tokens. The checkpoint is bench/grpo_shape.py's GPT-2 (2 layers,
width 128) plus, for the reward model, a GPT2ForSequenceClassification with a seeded one-output score head, so
both systems start from the same weights and the first step's losses can be compared.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

BENCH = Path(__file__).resolve().parent
OUT = BENCH / "out" / "preference"
CKPT = OUT / "ckpt"
RM_CKPT = OUT / "ckpt_rm"
PAIRS_FILE = OUT / "pairs.jsonl"

FEWSHOT, N_PAIRS, SEED = 10, 256, 0
BATCH = 16  # pairs per optimizer step (32 rows)
BETA, LR, MAX_GRAD_NORM = 0.1, 1e-5, 1.0
STEPS, WARMUP = 8, 2
THREADS = 1  # torch threads on both sides (CPU seconds per step then measure the work, whatever the load)


def pair_rows() -> list[dict[str, str]]:
    rng = random.Random(SEED)
    rows = []
    for _ in range(N_PAIRS):
        shots = "".join(f"{x}+{y}={x + y} " for x, y in
                        ((rng.randrange(100, 1000), rng.randrange(100, 1000)) for _ in range(FEWSHOT)))
        a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
        wrong = a + b + rng.choice([-100, -10, -1, 1, 10, 100])
        rows.append({"prompt": f"{shots}{a}+{b}=", "chosen": str(a + b), "rejected": str(wrong)})
    return rows


def write_inputs() -> None:
    """The checkpoints and the pairs (the same bytes every time)."""
    import sys

    import torch
    from transformers import GPT2ForSequenceClassification

    sys.path.insert(0, str(BENCH))
    import grpo_shape

    OUT.mkdir(parents=True, exist_ok=True)
    PAIRS_FILE.write_text("".join(json.dumps(r) + "\n" for r in pair_rows()), encoding="utf-8")
    grpo_shape.write_checkpoint(CKPT)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        rm = GPT2ForSequenceClassification.from_pretrained(CKPT, num_labels=1)
        torch.nn.init.normal_(rm.score.weight, std=0.02)
    rm.config.pad_token_id = rm.config.pad_token_id  # kept: the classifier finds the last non-pad token with it
    rm.save_pretrained(RM_CKPT)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(CKPT).save_pretrained(RM_CKPT)


def read_pairs() -> list[dict[str, str]]:
    return [json.loads(line) for line in PAIRS_FILE.read_text(encoding="utf-8").splitlines()]
