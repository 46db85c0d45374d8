"""`flowrl simulate`: a flow's steps on a described cluster under one policy (flowrl.backends.sim).

Runs the workload's steps one after another through the policy (`policies.py`, by name: `registry.py`), then reports the mean step time,
device-seconds held and busy per pool, money at the cluster's price, and writes the steps' spans as a trace.json
that `flowrl timeline` draws (one row per pool, generation instances on their own rows).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowrl.backends.sim.costs import CostModel
from flowrl.backends.sim.policies import Options, StepResult
from flowrl.backends.sim.registry import make
from flowrl.backends.sim.work import FlowWork
from flowrl.backends.sim.workload import Step


@dataclass(frozen=True)
class SimResult:
    policy: str
    cluster: str
    devices: int
    steps: tuple[StepResult, ...]
    price_device_hour: float

    @property
    def measured(self) -> tuple[StepResult, ...]:
        """The steps a mean is taken over: all but the first when there are several (the first pays the cold
        starts a long run pays once)."""
        return self.steps[1:] if len(self.steps) > 1 else self.steps

    @property
    def step_s(self) -> float:
        return sum(s.time for s in self.measured) / len(self.measured)

    @property
    def held_s(self) -> float:
        return sum(s.held for s in self.measured) / len(self.measured)

    def pool(self, name: str, what: str) -> float:
        return sum(getattr(s.pools[name], what) for s in self.measured if name in s.pools) / len(self.measured)

    def note(self, key: str) -> float:
        vals = [s.notes[key] for s in self.measured if key in s.notes]
        return sum(vals) / len(vals) if vals else float("nan")

    def summary(self) -> dict[str, Any]:
        pools = sorted({p for s in self.steps for p in s.pools})
        return {"policy": self.policy, "cluster": self.cluster, "devices": self.devices,
                "steps": len(self.steps), "step_s": self.step_s, "device_s": self.held_s,
                "money_per_step": self.held_s / 3600 * self.price_device_hour,
                "pools": {p: {"held_s": self.pool(p, "held"), "busy_s": self.pool(p, "busy"),
                              "starting_s": self.pool(p, "starting")} for p in pools},
                "notes": {k: self.note(k) for k in sorted({k for s in self.steps for k in s.notes})}}


def simulate(policy: str, cost: CostModel, work: FlowWork, steps: Sequence[Step],
             opts: Options | None = None) -> SimResult:
    runner = make(policy, cost, work, opts or Options())
    return SimResult(policy, cost.cluster.name, cost.cluster.devices, tuple(runner.step(s) for s in steps),
                     cost.cluster.price_device_hour)


def report(result: SimResult, work: FlowWork) -> str:
    s = result.summary()
    lines = [work.describe(),
             f"policy {result.policy} on {result.cluster} ({result.devices} devices), {len(result.steps)} steps "
             f"(means over {len(result.measured)})",
             f"step time {s['step_s']:.3f} s   device-seconds {s['device_s']:.1f} a step" +
             (f"   money {s['money_per_step']:.4f} a step ({s['money_per_step'] * 3600 / s['step_s']:.2f} an hour)"
              if result.price_device_hour else ""),
             f"{'pool':<12}{'held dev-s':>12}{'busy dev-s':>12}{'busy':>7}{'starting':>10}"]
    for name, p in s["pools"].items():
        share = p["busy_s"] / p["held_s"] if p["held_s"] else 0.0
        lines.append(f"{name:<12}{p['held_s']:>12.1f}{p['busy_s']:>12.1f}{share:>7.0%}{p['starting_s']:>10.1f}")
    notes = ", ".join(f"{k} {v:.3g}" for k, v in s["notes"].items())
    lines.append(f"per step: {notes}")
    return "\n".join(lines)


def write_trace(result: SimResult, out: str | Path) -> Path:
    """RUN_DIR-style trace.json (Chrome "X" events, microseconds) of every simulated step, back to back."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tracks: dict[str, int] = {}
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0,
                                     "args": {"name": f"flowrl simulate ({result.policy})"}}]
    t0 = 0.0
    for k, step in enumerate(result.steps, 1):
        for sp in step.spans:
            if sp.end <= sp.start:
                continue
            tid = tracks.setdefault(sp.track, len(tracks) + 1)
            events.append({"name": sp.name, "cat": sp.op, "ph": "X", "pid": 1, "tid": tid,
                           "ts": (t0 + sp.start) * 1e6, "dur": (sp.end - sp.start) * 1e6,
                           "args": {"step": k, "group": sp.track}})
        t0 += step.time
    events += [{"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}}
               for name, tid in tracks.items()]
    path = out / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}), encoding="utf-8")
    (out / "simulation.json").write_text(json.dumps(result.summary(), indent=2), encoding="utf-8")
    return path
