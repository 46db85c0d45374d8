"""Rollout samples as rows (`run { log_samples = K }`): what the policy wrote, and how it was scored.

`step_samples` takes the first K samples of a step's rollout (deterministic: the rollout's order, which the seed
fixes) as plain dicts; `runtime.sinks` appends them to OUT/samples.jsonl and hands them to the trackers (a wandb
Table, an MLflow artifact). An evaluation's samples come through the same sink with their own `kind`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flowrl.ir.graph import Graph
from flowrl.runtime.batch import Batch
from flowrl.runtime.controller import step_returns, step_rollout

SAMPLES = "samples.jsonl"
TRAIN = "train"  # the kind of a training step's samples (an evaluation's: "eval/NAME")


def step_samples(graph: Graph, values: Mapping[str, Batch], step: int, k: int) -> list[dict[str, Any]]:
    """The first `k` samples of the step's rollout: `prompt`, `response`, `reward` (what the policy optimises: the
    first reward's score plus the environment's return), `rewards` (each declared reward's score), the data set's
    name and row (`data`, `row_id`: the row's position among the data's training rows, which is its line, from 0,
    when no `held_out` column splits the file), and for a rollout with an environment `env_return`, `turns`,
    `tool_calls` and `turn_rewards` (each turn's reward)."""
    gen = next((n for n in graph.nodes if n.op == "generate" and n.id in values), None)
    rollout = step_rollout(graph, values)
    if k <= 0 or gen is None or rollout is None:
        return []
    returns = step_returns(graph, values)
    scored = [n.id for n in graph.nodes if n.op in ("reward", "score") and n.id in values]
    meta = rollout.meta
    mask = rollout.tensors.get("loss_mask", rollout.tensors.get("response_mask"))
    out: list[dict[str, Any]] = []
    for i in range(min(k, rollout.size)):
        row: dict[str, Any] = {
            "step": step, "kind": TRAIN, "index": i, "data": gen.input("prompts"),
            "row_id": _plain(meta["prompt_id"][i]) if "prompt_id" in meta else None,
            "prompt": str(meta.get("prompt", [""] * rollout.size)[i]),
            "response": str(meta.get("response", [""] * rollout.size)[i]),
            "reward": float(returns[i]) if returns is not None else None,
            "rewards": {name: float(values[name]["scores"][i]) for name in scored},
        }
        if mask is not None:
            row["response_tokens"] = int(mask[i].sum())  # generated tokens (an environment's observations not)
        if "env_return" in rollout.tensors:
            row.update(_env_fields(rollout, i))
        out.append(row)
    return out


def _env_fields(rollout: Batch, i: int) -> dict[str, Any]:
    turns = int(rollout["env_turns"][i])
    per_turn = [0.0] * turns
    index, rewards = rollout["turn_index"][i].tolist(), rollout["turn_rewards"][i].tolist()  # (T,) each
    for t, r in zip(index, rewards, strict=True):
        if 0 <= t < turns:
            per_turn[t] += float(r)
    return {"env_return": float(rollout["env_return"][i]), "turns": turns, "tool_calls": int(rollout["env_calls"][i]),
            "turn_rewards": per_turn}


def _plain(value: Any) -> Any:
    return value if isinstance(value, (int, str, float)) or value is None else str(value)


def with_kind(kind: str, rows: Sequence[Mapping[str, Any]], step: int) -> list[dict[str, Any]]:
    """`rows` with their `step` and `kind` (an evaluation's rows need not carry them)."""
    return [{"step": step, "kind": kind, **{k: v for k, v in r.items() if k not in ("step", "kind")}} for r in rows]


def append_samples(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    with path.open("a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, default=str) + "\n")


def truncate_samples(path: Path, last_step: int) -> None:
    """Drop the samples of steps after `last_step` (a resumed run takes them again)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and int(json.loads(line)["step"]) <= last_step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
