"""`flowrl calibrate RUN_DIR...`: the cost model's factors fitted on flowrl's own measured runs
(flowrl.backends.sim).

Each run directory gives, per step, what was computed (graph.json: the models and calls; lengths.jsonl: every
sample's prompt and response length) and how long each call took (metrics.jsonl: `time/NODE`). Each kind of call
is a line in the cost model's terms, all fitted together by non-negative least squares over
every step of every run, weighted by each call's mean time (they share the elementwise term, `act_bytes`, which every kind adds per token):
- generate: gen_call_s + decode_iter_s · iterations + (decode FLOPs / peak) / decode_mfu (prefill included,
  at the same efficiency: one instance decodes every sample together, as the local engine does);
- a forward: fwd_call_s + (FLOPs / peak) / forward_mfu; an update call: train_call_s per model it trains +
  optim_step_s per optimizer step + (3 · FLOPs / peak) / train_mfu; FLOPs padded to each batch's longest row, as
  flowrl's torch engine computes them.
The fit's error is reported per kind of call and for whole steps (the `serverful` policy on the one device,
which is how the local backend runs a step: every call in turn). First steps (warm-up) are left out.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from flowrl.backends.sim.costs import CostModel, Factors
from flowrl.backends.sim.hardware import Cluster, load_cluster
from flowrl.backends.sim.shapes import ModelShape
from flowrl.backends.sim.simulate import simulate
from flowrl.backends.sim.work import Call, FlowWork, controller_times, flow_work
from flowrl.backends.sim.workload import Step, read_metrics, replay
from flowrl.errors import Diagnostic, FlowError


@dataclass(frozen=True)
class Run:
    path: Path
    work: FlowWork
    steps: list[Step]
    times: list[dict[str, float]]  # per step: node -> seconds, and "step"
    unfused: frozenset[str] = frozenset()  # fused stages the backend ran one by one (run.json), by first node


def load_run(run_dir: str | Path, skip: int = 1) -> Run:
    path = Path(run_dir)
    for name in ("graph.json", "lengths.jsonl", "metrics.jsonl"):
        if not (path / name).is_file():
            raise FlowError(Diagnostic(f"calibrate: {run_dir} has no {name}",
                                       hint="pass the --out directory of a `flowrl run` (local backend)"))
    graph = json.loads((path / "graph.json").read_text(encoding="utf-8"))
    steps = replay(path)
    rows = read_metrics(path)
    times: list[dict[str, float]] = []
    for lineno, row in enumerate(rows, 1):
        try:
            times.append({"step": float(row["step_time_s"]),
                          **{k[5:]: float(v) for k, v in row.items() if k.startswith("time/")}})
        except (ValueError, KeyError, TypeError) as e:
            raise FlowError(f"{path / 'metrics.jsonl'}: row {lineno}: not a metrics row ({e})") from None
    work = controller_times(flow_work(graph, prompts=len(steps[0]) if steps else None), rows,
                            sum(len(w.responses) for w in steps[0]) if steps else 0)
    n = min(len(steps), len(times))
    info = json.loads((path / "run.json").read_text(encoding="utf-8")) if (path / "run.json").is_file() else {}
    return Run(path, work, steps[skip:n], times[skip:n], frozenset(info.get("unfused", {})))


def _decode_terms(cost: CostModel, shape: ModelShape, step: Step) -> tuple[float, float, float]:
    """(decode iterations, FLOPs / peak, elementwise seconds) of generating the step on one instance, prefill
    included (each prompt once)."""
    flops, tokens = 0.0, 0.0
    for w in step:
        flops += w.prompt_len * shape.flops_per_token(w.prompt_len / 2)
        tokens += w.prompt_len
        for n in w.responses:  # token t of a response attends to prompt + t places: prompt + n/2 on average
            flops += n * shape.flops_per_token(w.prompt_len + n / 2)
            tokens += n
    iters = float(max(n for w in step for n in w.responses))
    return iters, flops / cost.dev.flops, cost.act_s(shape, tokens)


def _forward_terms(cost: CostModel, call: Call, shape: ModelShape, step: Step, parts: int = 1) -> tuple[float, float]:
    """(FLOPs / peak, elementwise seconds) of one pass of `call`'s model over the step, in `parts` mini-batches."""
    rows = [(w.prompt_id, w.prompt_len, n) for w in step for n in w.responses]
    return cost.flops(shape, rows, call.share_prefix, parts) / cost.dev.flops, \
        cost.act_s(shape, cost.batch_tokens(rows, call.share_prefix, shape.hidden, parts))


def _fit(rows: list[list[float]], y: list[float], scale: list[float]) -> list[float]:
    """Non-negative least squares, each row divided by `scale` (the mean time of its run's call: a 5 ms call
    counts as much as a 500 ms one, and a noisy step is not pulled towards zero as dividing by its own time
    would), exactly: the optimum is the plain least-squares fit on some subset of the columns, so every subset
    (2^10 here) is tried and the best non-negative one kept. A column the runs cannot tell from the others
    (the decode iterations when every step hit max_tokens) gets 0, not a negative number that cancels another."""
    w = 1.0 / np.array(scale, dtype=float)
    a, b = np.array(rows, dtype=float) * w[:, None], np.array(y, dtype=float) * w
    best: tuple[float, list[float]] | None = None
    for mask in itertools.product((0, 1), repeat=a.shape[1]):
        cols = [i for i, m in enumerate(mask) if m]
        if not cols:
            continue
        coef = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
        if (coef < 0).any():
            continue
        full = [0.0] * a.shape[1]
        for i, c in zip(cols, coef, strict=True):
            full[i] = float(c)
        resid = float(np.sum((a @ np.array(full) - b) ** 2))
        if best is None or resid < best[0] - 1e-15:
            best = (resid, full)
    assert best is not None  # one column alone always gives a non-negative fit for positive times
    return best[1]


def calibrate(run_dirs: Sequence[str | Path], cluster: Cluster | None = None) -> tuple[Factors, dict[str, Any]]:
    cluster = cluster or load_cluster("cpu")
    runs = [load_run(d) for d in run_dirs]
    base = CostModel(cluster, replace(Factors(), pad_to_longest=True))
    # one design over every call: columns 0-2 generate (call, iterations, FLOPs), 3-4 forward (call, FLOPs),
    # 5-7 update (models, optimizer steps, FLOPs), 8 the elementwise traffic and 9 the rows all three share
    x: list[list[float]] = []
    y: list[float] = []
    kinds: list[str] = []

    groups: list[tuple[str, str]] = []

    def row(kind: str, cols: dict[int, float], seconds: float, node: str) -> None:
        x.append([cols.get(i, 0.0) for i in range(10)])
        y.append(seconds)
        kinds.append(kind)
        groups.append((str(r.path), node))

    for r in runs:
        for step, t in zip(r.steps, r.times, strict=True):
            rows = float(sum(len(w.responses) for w in step))
            g = r.work.generate
            if g.node in t:
                iters, flops, act = _decode_terms(base, r.work.shapes[g.model], step)
                row("generate", {0: 1.0, 1: iters, 2: flops, 8: act, 9: rows}, t[g.node], g.node)
            for f in r.work.forwards:
                if f.node in t:
                    flops, act = _forward_terms(base, f, r.work.shapes[f.model], step)
                    row("forward", {3: 1.0, 4: flops, 8: act, 9: rows}, t[f.node], f.node)
            for call in r.work.update_calls():
                if all(u.node in t for u in call):
                    # a fused stage reports its whole time for each member; run one by one (the backend declined
                    # the fusion and said so in run.json), each reports its own
                    times = [t[u.node] for u in call]
                    seconds = sum(times) if call[0].node in r.unfused else times[0]
                    terms = [_forward_terms(base, u, r.work.shapes[u.model], step,
                                            u.mini_batches if u.mini_batches > 1 or u.epochs > 1 else 1)
                             for u in call]
                    row("update", {5: float(len(call)), 6: float(sum(u.epochs * u.mini_batches for u in call)),
                                   7: sum(3 * u.epochs * tx[0] for u, tx in zip(call, terms, strict=True)),
                                   8: sum(3 * u.epochs * tx[1] for u, tx in zip(call, terms, strict=True)),
                                   9: rows * sum(u.epochs for u in call)},
                        seconds, call[0].node)
    if {"generate", "forward", "update"} - set(kinds):
        raise FlowError(Diagnostic("calibrate: the runs need generate, forward and update calls with times",
                                   hint="runs of a PPO or GRPO flow with at least two steps"))
    mean = {g: float(np.mean([yr for yr, gr in zip(y, groups, strict=True) if gr == g])) for g in set(groups)}
    c = _fit(x, y, [mean[g] for g in groups])
    factors = replace(base.f, gen_call_s=c[0], decode_iter_s=c[1], decode_mfu=_inv(c[2]), prefill_mfu=_inv(c[2]),
                      fwd_call_s=c[3], forward_mfu=_inv(c[4]), train_call_s=c[5], optim_step_s=c[6],
                      train_mfu=_inv(c[7]), act_bytes=base.f.act_bytes * c[8], row_s=c[9])
    err = {k: _error([xr for xr, kr in zip(x, kinds, strict=True) if kr == k],
                     [yr for yr, kr in zip(y, kinds, strict=True) if kr == k], c)
           for k in ("generate", "forward", "update")}
    model = CostModel(cluster, factors)
    steps = {}
    for r in runs:
        res = simulate("serverful", model, r.work, [r.steps[0], *r.steps]) if r.steps else None
        if res is not None:
            measured = sum(t["step"] for t in r.times) / len(r.times)
            steps[str(r.path)] = {"measured_s": measured, "predicted_s": res.step_s,
                                  "error": res.step_s / measured - 1}
    return factors, {"calls": err, "steps": steps, "cluster": cluster.name}


def _inv(coef: float) -> float:
    """An efficiency from a fitted seconds-per-(FLOP/peak): a zero coefficient (the work term explained nothing)
    becomes an efficiency so high the term vanishes."""
    return 1.0 / coef if coef > 0 else 1e12


def _error(x: list[list[float]], y: list[float], coef: list[float]) -> float:
    """Mean absolute relative error of the fitted line."""
    pred = np.array(x) @ np.array(coef)
    return float(np.mean(np.abs(pred - np.array(y)) / np.array(y)))


def save(factors: Factors, info: dict[str, Any], out: str | Path) -> Path:
    path = Path(out)
    path.write_text(json.dumps({"factors": factors.to_json(), **info}, indent=2), encoding="utf-8")
    return path
