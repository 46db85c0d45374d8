"""What the simulated steps generate (flowrl.backends.sim): per step, each prompt's id, prompt length and its
samples' response lengths.

Three sources: a replayed trace (a run directory's `lengths.jsonl`, which `flowrl run` writes, so a real run is
replayed at scale and every policy sees the same content); the flow itself (`from_flow`: its data's prompt
lengths and shared opening, its `max_tokens`, and a length distribution the user gives, `Lengths`: without
one every response runs to the cap); or a synthetic long-tailed generator (bench/sim_papers.py's settings). The generator
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
from collections.abc import Mapping, Sequence
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


LENGTH_KINDS = {"max": 0, "fixed": 1, "uniform": 2, "geometric": 1, "lognormal": 1}  # kind -> required params


@dataclass(frozen=True)
class Lengths:
    """Response lengths for a simulation without a trace (`flowrl simulate --lengths SPEC`), every one cut at
    the flow's `max_tokens`: `max` (each response runs to the cap: what the flow alone says), `fixed:N`,
    `uniform:LO:HI`, `geometric:MEAN` (each token ends the response with probability 1/MEAN: a model that has
    not learned when to stop), `lognormal:MEDIAN[:BETWEEN[:WITHIN]]` (the long tail: a prompt's scale
    log-normal across prompts with sigma BETWEEN, default 0.6, its samples around it with WITHIN, 0.4)."""

    kind: str = "max"
    params: tuple[float, ...] = ()

    def describe(self) -> str:
        return ":".join([self.kind, *(f"{p:g}" for p in self.params)])


def parse_lengths(spec: str) -> Lengths:
    kind, *raw = spec.split(":")
    if kind not in LENGTH_KINDS:
        raise FlowError(Diagnostic(f"--lengths {spec!r}: unknown distribution {kind!r}",
                                   hint="max, fixed:N, uniform:LO:HI, geometric:MEAN or lognormal:MEDIAN[:BETWEEN"
                                        "[:WITHIN]]"))
    try:
        params = tuple(float(x) for x in raw)
    except ValueError:
        raise FlowError(Diagnostic(f"--lengths {spec!r}: its parameters must be numbers",
                                   hint=f"e.g. --lengths {kind}:{':'.join(['20'] * max(1, LENGTH_KINDS[kind]))}")) \
            from None
    need = LENGTH_KINDS[kind]
    most = 3 if kind == "lognormal" else need
    if not need <= len(params) <= most or any(p <= 0 for p in params) or \
            (kind == "uniform" and params[0] > params[1]):
        raise FlowError(Diagnostic(f"--lengths {spec!r}: {kind} takes {need}{f' to {most}' if most > need else ''} "
                                   "positive numbers" + (" (LO <= HI)" if kind == "uniform" else ""),
                                   hint="e.g. --lengths lognormal:300 or --lengths uniform:8:64"))
    return Lengths(kind, params)


def data_prompts(graph: Mapping[str, Any]) -> list[str]:
    """The prompt texts of the flow's first data source when it is a JSON-lines file that exists here (else
    none): the simulator reads their lengths and their shared opening from it."""
    for d in graph.get("data", []):
        path = Path(str(d.get("path", "")))
        if d.get("kind") != "jsonl" or not path.is_file():
            return []
        key = str(d.get("options", {}).get("prompt_key", "prompt"))
        out = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line) if line.strip() else None
            except ValueError:
                return []
            if isinstance(row, dict) and isinstance(row.get(key), str):
                out.append(row[key])
        return out
    return []


def shared_prefix(texts: Sequence[str]) -> int:
    """The characters every text opens with."""
    if not texts:
        return 0
    first, n = texts[0], len(texts[0])
    for t in texts[1:]:
        n = min(n, len(t))
        while t[:n] != first[:n]:
            n -= 1
    return n


def prefix_tokens(texts: Sequence[str], min_prefix: int = 0) -> int:
    """The tokens every prompt opens with (their shared characters plus the start token), 0 when that is
    shorter than `min_prefix` (the share-prefix pass's `prefix_min_len`) or is a whole prompt."""
    if not texts:
        return 0
    n = shared_prefix(texts) + 1
    return n if n >= max(1, min_prefix) and n < min(len(t) + 1 for t in texts) else 0


def from_flow(lengths: Lengths, prompts: int, samples: int, max_tokens: int, steps: int, texts: Sequence[str] = (),
              min_prefix: int = 0, seed: int = 0) -> list[Step]:
    """Steps drawn from the flow's own data and cap: prompt lengths from `texts` (one token a character plus
    the start token: the tiny models' tokenizers; 256 without data), their shared opening as a shared prefix
    when it is at least `min_prefix` tokens, the prompts visited in shuffled epochs of the data set (8 steps'
    worth without data) and each response drawn from `lengths`."""
    rng = random.Random(seed)
    size = len(texts) or 8 * prompts
    plen = [len(t) + 1 for t in texts] or [256] * size
    prefix = prefix_tokens(texts, min_prefix)
    extra = lengths.params[1:] if lengths.kind == "lognormal" else ()
    between = extra[0] if len(extra) > 0 else 0.6
    within = extra[1] if len(extra) > 1 else 0.4
    scale = [lengths.params[0] * math.exp(rng.gauss(0.0, between)) for _ in range(size)] \
        if lengths.kind == "lognormal" else []

    def draw(p: int) -> int:
        k, a = lengths.kind, lengths.params
        if k == "fixed":
            n = a[0]
        elif k == "uniform":
            n = rng.randint(int(a[0]), int(a[1]))
        elif k == "geometric":
            n = 1 + (math.floor(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / a[0])) if a[0] > 1 else 0)
        elif k == "lognormal":
            n = scale[p] * math.exp(rng.gauss(0.0, within))
        else:
            n = max_tokens
        return max(1, min(max_tokens, int(n)))

    order: list[int] = []
    out: list[Step] = []
    for _ in range(steps):
        while len(order) < prompts:
            fresh = list(range(size))
            rng.shuffle(fresh)
            order += fresh
        ids, order = order[:prompts], order[prompts:]
        out.append(tuple(PromptWork(p, plen[p], tuple(draw(p) for _ in range(samples)), prefix) for p in ids))
    return out
