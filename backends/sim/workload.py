"""What the simulated steps generate (flowrl.backends.sim): per step, each prompt's id, prompt length and its
samples' response lengths.

Two sources: a replayed trace (a run directory's `lengths.jsonl`, which `flowrl run` writes, so a real run is
replayed at scale and every policy sees the same content), or a synthetic long-tailed generator. The generator
follows the long-tail statistics the seed papers report (../shared/reference/seed_papers.md §6): each prompt has
a latent length scale drawn log-normally across prompts, its samples are log-normal around it, everything is cut
at `max_tokens`, and a prompt drawn again in a later epoch has drifted a little (most prompts move by < 50
tokens), so per-prompt history predicts the next lengths about as well as it does on real tasks. Its parameters
are assumptions, said so wherever results are reported.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flowrl.errors import Diagnostic, FlowError


@dataclass(frozen=True)
class PromptWork:
    prompt_id: int
    prompt_len: int
    responses: tuple[int, ...]  # one length per sample
    prefix_len: int = 0  # prompt tokens it shares with other prompts of the step (one prefix per length)


Step = tuple[PromptWork, ...]


@dataclass(frozen=True)
class LongTail:
    """The synthetic generator's parameters (see the module docstring)."""

    prompts: int = 64  # per step
    samples: int = 8
    max_tokens: int = 2048
    median: float = 300.0  # median response length of a typical prompt
    between: float = 0.6  # log-normal sigma of prompts' scales
    within: float = 0.4  # log-normal sigma of one prompt's samples
    drift: float = 0.1  # sigma of a prompt scale's multiplicative step per epoch
    prompt_len: int = 256
    dataset: int = 0  # distinct prompts (0: 8 steps' worth)


def synthetic(tail: LongTail, steps: int, seed: int = 0) -> list[Step]:
    rng = random.Random(seed)
    size = tail.dataset or 8 * tail.prompts
    scale = [tail.median * math.exp(rng.gauss(0.0, tail.between)) for _ in range(size)]
    plen = [max(1, int(tail.prompt_len * math.exp(rng.gauss(0.0, 0.2)))) for _ in range(size)]
    order: list[int] = []
    out: list[Step] = []
    for _ in range(steps):
        if len(order) < tail.prompts:  # a new epoch: every prompt's scale drifts, a fresh shuffle
            scale = [s * math.exp(rng.gauss(0.0, tail.drift)) for s in scale]
            fresh = list(range(size))
            rng.shuffle(fresh)
            order += fresh
        ids, order = order[:tail.prompts], order[tail.prompts:]
        out.append(tuple(PromptWork(p, plen[p], tuple(
            max(1, min(tail.max_tokens, int(scale[p] * math.exp(rng.gauss(0.0, tail.within)))))
            for _ in range(tail.samples))) for p in ids))
    return out


def replay(run_dir: str | Path, node: str | None = None) -> list[Step]:
    """The steps of RUN_DIR/lengths.jsonl (of generate node `node`, or of its first one)."""
    path = Path(run_dir) / "lengths.jsonl"
    if not path.is_file():
        raise FlowError(Diagnostic(f"--trace {run_dir}: no lengths.jsonl there",
                                   hint="a `flowrl run` directory: runs write lengths.jsonl every step"))
    steps: list[Step] = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if node is None:
                node = str(row["node"])
            if row["node"] != node:
                continue
            steps.append(tuple(PromptWork(int(p), int(pl or 0), tuple(int(n) for n in rs)) for p, pl, rs in
                               zip(row["prompt_id"], row["prompt_len"], row["response_len"], strict=True)))
        except (ValueError, KeyError, TypeError) as e:
            raise FlowError(f"{path}:{lineno}: not a lengths row ({type(e).__name__}: {e})") from None
    if not steps:
        raise FlowError(f"{path}: no rows" + (f" for node {node!r}" if node else ""))
    return steps


def tile(steps: Sequence[Step], prompts: int) -> list[Step]:
    """Each step grown (or cut) to `prompts` prompts by repeating its own, the copies under new ids (copy k of
    prompt p is p + k * (largest id + 1)), so a small run's content stands for a bigger batch."""
    width = 1 + max((w.prompt_id for s in steps for w in s), default=0)
    return [tuple(replace(s[i % len(s)], prompt_id=s[i % len(s)].prompt_id + (i // len(s)) * width)
                  for i in range(prompts)) for s in steps if s]


def stretch(steps: Sequence[Step], factor: float, cap: int) -> list[Step]:
    """Response lengths times `factor`, cut at `cap` (a tiny run's shape at a real model's lengths)."""
    return [tuple(replace(w, responses=tuple(max(1, min(cap, round(n * factor))) for n in w.responses))
                  for w in s) for s in steps]


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """RUN_DIR/metrics.jsonl's rows (none when the file is missing); a row that is not JSON is a file:line error."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError as e:
                raise FlowError(f"{path}:{lineno}: not a metrics row ({e})") from None
            if not isinstance(row, dict):
                raise FlowError(f"{path}:{lineno}: not a metrics row (a JSON object per line)")
            rows.append(row)
    return rows
