"""Serverless instances give their devices back while tools run (issue 26 item 5).

A multi-turn generate on a serverless pool runs in rounds of instance tasks. An instance runs the decode loop
(flowrl.engines.turns) against the run's `EnvHost` (env_host.py), and each time every live trajectory waits on its
environment it asks `flowrl.elastic.should_release` whether the soonest answer is predicted (from the step
latencies seen, as lengths are predicted) further away than giving the device back and getting one again costs
(`Policy.env_release_s`, or what a warm round costs beyond its method as the driver measures it: scheduling,
arguments, start, loading, the result's way back). If so it stops: it returns the trajectories that
finished, as rollout chunks, and the waiting ones parked (`Parked`: token ids so far, random-stream keys and step,
turn count; their pending calls stay on the host), and its task ends, so its device goes back. The driver waits,
holding nothing, until one of the parked rows' outcomes is back on the host, then starts a resume task on any
instance (`resume_turns`: each row's history prefilled once, counted in `prefill_tokens`; the same samples as
without release). The rollout is the rounds' chunks in sample order.

Device-seconds: every round is an instance task, held as the cluster counts it (held.py, the cost report); what
each task spent waiting on environments with its device held (its decode loop's idle seconds) goes to the metric
`cost/env_wait_held_s`, and the parks, resumes and rows re-prefilled to `env/parks`, `env/resumes`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
import torch

from flowrl.backends.serverless.env_host import RemoteEnvs, remote_env_host
from flowrl.elastic.env_wait import EnvWaitPredictor, should_release
from flowrl.elastic.plan import start_overhead
from flowrl.engines.turns import Parked, Suspended, TurnChunk, resume_turns, stream_turns
from flowrl.errors import Diagnostic, ExecutionError
from flowrl.ir.attrs import GenerateAttrs
from flowrl.runtime.batch import Batch
from flowrl.runtime.chunks import assemble
from flowrl.runtime.env_rollout import env_spec_of, rollout_batch
from flowrl.runtime.protocol import Usage
from flowrl.runtime.worker import ModelWorker, prompt_slots, prompt_texts

if TYPE_CHECKING:  # the group holds an EnvRelease (and imports this module)
    from flowrl.backends.serverless.group import ServerlessGroup

GENERATE = "env_generate_parking"  # instance-side task names (instance.TASKS)
RESUME = "env_resume_parked"
CLOSE_S = 60.0  # how long a host may take to close its environments' processes before it is killed anyway


@dataclass
class EnvPart:
    """What one instance task of a released generation returns."""

    chunks: list[Batch] = field(default_factory=list)  # finished trajectories, rollout chunks with `sample`
    parked: list[Parked] = field(default_factory=list)  # still waiting on environments
    idle_s: float = 0.0  # seconds its loop had nothing to do while environments were pending, device held
    wall_s: float = 0.0  # seconds its loop ran
    seconds: list[float] = field(default_factory=list)  # the environment calls' latencies it saw


def _loop_args(attrs: Mapping[str, Any]) -> dict[str, Any]:
    spec = env_spec_of(attrs)
    assert spec is not None
    a = GenerateAttrs.of(attrs)
    return dict(n=a.n, max_tokens=a.max_tokens, max_turns=spec.max_turns, stop=spec.stop, min_tokens=a.min_tokens,
                temperature=a.temperature, top_p=a.top_p, overlap=spec.overlap, decode_batch=spec.decode_batch)


def _drain(items: Any, worker: ModelWorker, model: str, prompts: Batch, attrs: Mapping[str, Any],
           seen: list[float]) -> EnvPart:
    tok = worker.models[model].tokenizer
    a = GenerateAttrs.of(attrs)
    part = EnvPart(seconds=seen)
    for item in items:
        if isinstance(item, Suspended):
            part.parked, part.idle_s, part.wall_s = list(item.rows), part.idle_s + item.idle_s, part.wall_s + item.wall_s
            continue
        assert isinstance(item, TurnChunk)
        out = rollout_batch(item.out, tok, prompts, a.temperature)
        sample = torch.tensor(item.rows, dtype=torch.long)
        out.tensors.update(sample=sample, pad=torch.full((out.size,), tok.pad_id))
        part.chunks.append(out)
        part.idle_s += item.out.idle_s
        part.wall_s += item.out.wall_s
    return part


def _park(history: Sequence[float], seen: list[float], cost_s: float, min_history: int) -> Any:
    def park(waits: list[float]) -> bool:
        predictor = EnvWaitPredictor(min_history=min_history)
        predictor.observe([*history, *seen])
        return should_release(waits, predictor, cost_s)

    return park


def generate_parking(worker: ModelWorker, model: str, prompts: Batch, attrs: Mapping[str, Any], *, step_seed: int,
                     host: Any, cost_s: float, history: Sequence[float], min_history: int) -> EnvPart:
    """An instance's first round: the whole call's trajectories from their prompts (one instance: the samples'
    streams are keyed by prompt slot, so any split samples alike)."""
    loaded = worker.models[model]
    a = GenerateAttrs.of(attrs)
    ids = worker.prompt_encoder(model).ids(prompt_texts(prompts, loaded.tokenizer), a.max_tokens)
    rows = [dict(r) for r in prompts.meta["row"]] if "row" in prompts.meta else \
        [{k: v[i] for k, v in prompts.meta.items()} for i in range(prompts.size)]
    seen: list[float] = []
    envs = RemoteEnvs(host, step_seed, seen)
    items = stream_turns(loaded.module, loaded.tokenizer, ids, rows, envs, seed=step_seed,
                         prompt_slots=prompt_slots(prompts), max_total=int(attrs.get("max_total") or 0) or None,
                         device=str(worker.device), park=_park(history, seen, cost_s, min_history), **_loop_args(attrs))
    return _drain(items, worker, model, prompts, attrs, seen)


def resume_parked(worker: ModelWorker, model: str, prompts: Batch, attrs: Mapping[str, Any], *, step_seed: int,
                  rows: Sequence[Parked], host: Any, cost_s: float, history: Sequence[float],
                  min_history: int) -> EnvPart:
    """A later round: parked rows go on here, their pending calls' outcomes from the host."""
    loaded = worker.models[model]
    seen: list[float] = []
    envs = RemoteEnvs(host, step_seed, seen)
    pending = [envs.pending(p.key, len(p.step_s)) for p in rows]  # step_s: one per call answered so far
    items = resume_turns(loaded.module, loaded.tokenizer, rows, pending, envs, device=str(worker.device),
                         park=_park(history, seen, cost_s, min_history), **_loop_args(attrs))
    return _drain(items, worker, model, prompts, attrs, seen)


class EnvRelease:
    """A serverless pool's released multi-turn generations: its env hosts and latency history (driver side).
    Each round's instance is started and collected through the group's public methods, as its plain calls are."""

    def __init__(self, group: ServerlessGroup):
        self.group = group
        self.hosts: dict[str, tuple[Any, Any]] = {}  # env name -> (its spec, its EnvHost actor)
        self.history: list[float] = []  # the latest environment call latencies (the predictor's)
        self.overhead_s: float | None = None  # a warm task's time beyond its run: releasing costs it again

    def host(self, attrs: Mapping[str, Any]) -> Any:
        spec = env_spec_of(attrs)
        assert spec is not None
        held = self.hosts.get(spec.name)
        if held is not None and held[0] == spec:
            return held[1]
        if held is not None:  # the flow's env changed (a new spec): its pool goes
            _stop([held[1]])
        host = remote_env_host.remote(spec)
        self.hosts[spec.name] = (spec, host)
        return host

    def generate(self, model: str, prompts: Batch, attrs: Mapping[str, Any], *, step_seed: int) -> Batch:
        group, policy = self.group, self.group.policy
        host = self.host(attrs)
        cost = policy.env_release_s if policy.env_release_s is not None else self.overhead_s
        # no release until it costs something known (a warm task measured)
        kw = dict(step_seed=step_seed, host=host, cost_s=float("inf") if cost is None else cost,
                  min_history=policy.env_min_history)
        parts, parks, resumed, idle = [], 0, 0, 0.0
        how, extra = GENERATE, dict[str, Any]()
        while True:
            sent = time.perf_counter()
            group.room(1)  # idle pre-warmed instances of other pools make way
            first, warm = group.take_warm(1, "generate")  # a pre-warmed (or kept-warm floor) instance
            boxes = [w.box for w in warm]
            try:
                refs, token = group.submit(warm, how, (model, prompts, dict(attrs)),
                                           {**kw, **extra, "history": list(self.history[-512:])})
                (part,), used = group.collect("generate", [refs], [token], first)
            finally:
                group.close_boxes(boxes)
                group.refill()  # the lower bounds let go for this round are kept warm again
            self._learn(time.perf_counter() - sent, used)
            parts.append(part)
            self.history += part.seconds
            idle += part.idle_s
            if not part.parked:
                break
            parks += 1
            # the device is back: wait, holding none, until a parked row's outcome is there
            ray.get(host.ready.remote([((step_seed, p.key), len(p.step_s)) for p in part.parked]))
            how, extra = RESUME, {"rows": part.parked}
            resumed += len(part.parked)
        failed = ray.get(host.failed.remote())
        if failed is not None:  # on_error = "raise" (or a class that could not start): a run error naming the env
            spec = env_spec_of(attrs)
            assert spec is not None
            where = str(attrs.get("env_at") or "")
            raise ExecutionError(Diagnostic(f"{spec.kind} `{spec.name}`{f' (declared at {where})' if where else ''}: "
                                            f"{failed}", hint='on_error = "observe" shows the policy the error and '
                                            '"end" ends the trajectory; the run goes on'))
        chunks = [c for p in parts for c in p.chunks]
        out = assemble(chunks, [c["sample"] for c in chunks])
        out.tensors["group_id"] = torch.arange(out.size) // GenerateAttrs.of(attrs).n
        # the chunks share their loops' seconds; a round's seconds after its last chunk (until it parked) too
        wall = sum(p.wall_s for p in parts)
        for key, total in (("gen_idle_s", idle), ("gen_wall_s", wall)):
            out.tensors[key] = out[key] + (total - float(out[key].sum())) / max(out.size, 1)
        group.note({"env/parks": float(parks), "env/resumed_rows": float(resumed), "env/rounds": float(len(parts))})
        return out

    def _learn(self, round_s: float, used: Sequence[Usage]) -> None:
        """What giving the device back and getting one again costs, as the driver sees a warm round: its wall
        time less the method's own (scheduling, arguments, start, loading, the result's way back), averaged."""
        warm = [round_s - u.run_s for u in used if not u.cold]
        if warm:
            seen = start_overhead([(w, False) for w in warm])
            self.overhead_s = seen if self.overhead_s is None else (self.overhead_s + seen) / 2

    def close(self) -> None:
        """The run's env hosts end: each closes its environments' processes, then its actor is killed, so no
        actor of the run stays on the cluster (an autoscaler removes only nodes that hold none)."""
        hosts, self.hosts = [host for _, host in self.hosts.values()], {}
        _stop(hosts)


def _stop(hosts: Sequence[Any]) -> None:
    """Close `hosts` (their environments' worker processes end with them; at most CLOSE_S for all of them: a
    host that hangs or died is killed all the same), then kill their actors."""
    if not hosts:
        return
    closing = [h.close.remote() for h in hosts]
    ray.wait(closing, num_returns=len(closing), timeout=CLOSE_S)
    for h in hosts:
        ray.kill(h, no_restart=True)

