"""The serverless backend (`flowrl run FLOW --backend serverless`): every worker group is an elastic pool of
instances that hold a device slot only while they run a call (RLHFless; backends/serverless/instance.py).

A device is a GPU (or a pool's `gpu_fraction` of one) where the flow asks for GPUs or the cluster has them, else
the Ray custom resource `device_slot` (backends/serverless/devices.py): a local Ray instance started here gets one
slot per CPU (or `slots`), a cluster declares them per node (`ray start --resources '{"device_slot": 8}'`), so the
autoscaler adds nodes when tasks wait for devices and removes idle ones. A pool's upper size is its `placement`
pool's `gpus` (the top of a range), else the devices the cluster has; without `placement`, a group's calls count
in one elastic pool per stage kind (generation, inference, training) in the cost report. Weight sync between
groups hands over a version in the object store (no copy); an asynchronous run's snapshots are those versions too. `usage()` gives the
instance tasks that ran since it was last called, for the cost report (flowrl.runtime.cost), each held for as
long as Ray had its device reserved (its task events: backends/serverless/held.py); what runs after the
last step (the final checkpoint, instances released at shutdown) is the `usage()` after `shutdown`, and
`held_total_s` the whole run's held device-seconds, of which `measured_frac` as the cluster counted them.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray

from flowrl.backends.ray.cluster import Session
from flowrl.backends.serverless.devices import group_devices
from flowrl.backends.serverless.group import ServerlessGroup
from flowrl.backends.serverless.held import TaskClock
from flowrl.backends.serverless.instance import SLOT, Build, remote_mailbox
from flowrl.backends.serverless.ledger import lost_attempts
from flowrl.backends.serverless.scaling import Policy
from flowrl.backends.serverless.slots import Acquire, Slots
from flowrl.errors import Diagnostic, FlowError
from flowrl.ir.graph import Graph, Range
from flowrl.runtime.protocol import Usage, WorkerGroup

ABLATE = ("predict", "assign", "dedup", "migrate", "scale", "prewarm", "late", "env_release")


class ServerlessBackend:
    name = "serverless"
    why_not_async = ""  # each group's weights are versions in the object store

    def __init__(self, address: str | None = None, log_dir: str | Path | None = None, *, slots: int | None = None,
                 crash_on_call: Mapping[str, tuple[str, int, str]] | None = None, ablate: Iterable[str] = (),
                 late: float | None = None):
        """`crash_on_call` (tests only): group -> (method, n, marker file): that group's n-th `method` call loses
        its first instance mid-call (see instance.serve). `ablate`: mechanisms switched off, for the ablation
        (`predict`, `assign`, `dedup` (deduplicated prefill), `migrate`, `scale`, `prewarm`, `late` (a fused
        stage's forward instances started with the first chunk, not after their learned slack)); `late`: that
        start's share of the slack (the benchmark's; default `Policy.late`)."""
        unknown = set(ablate) - set(ABLATE)
        if unknown:
            raise ValueError(f"ablate: unknown mechanisms {sorted(unknown)}; known: {', '.join(ABLATE)}")
        self.ablate = frozenset(ablate)
        self.late = late
        self.slots = slots or os.cpu_count() or 1
        self.crash_on_call = dict(crash_on_call or {})
        self.session = Session(address, log_dir, resources={SLOT: float(self.slots)})
        self.groups: dict[str, ServerlessGroup] = {}
        self.mailbox: Any = None  # the Ray actor that hands over calls, tails and chunks, and keeps the ledger
        self.clock: TaskClock | None = None  # this run's instance tasks as Ray's task events tell them
        self.unmeasured = 0  # tasks whose events never came (charged by their own timers)
        self.tail: list[Usage] = []  # what shutdown found after the last step's usage
        # the whole run's held device-seconds, each task's as the cluster counted it where its events came (that
        # part: held_measured_s), else as its own timers did; summed as usage is read, complete after shutdown
        self.held_total_s = 0.0
        self.held_measured_s = 0.0
        self.shared_slots: Slots | None = None  # the run's device slots, shared by its pools

    def start(self, graph: Graph, *, seed: int, device: str) -> dict[str, WorkerGroup]:
        self.session.open()
        cluster = ray.cluster_resources()
        pools = {p.name: p for p in graph.pools}
        # A cluster flowrl joined (an address) may grow: demand for devices is what makes its autoscaler add
        # nodes, so a declared pool is sized by its upper `gpus`, not by the devices there now (none, on a
        # cluster scaled to zero). A local instance flowrl started has what it has.
        joined = self.session.address is not None
        devices = group_devices(graph, cluster, device, joined)
        if not all(devices[wg.name].capacity(cluster) >= 1 or (joined and wg.pool in pools)
                   for wg in graph.worker_groups):
            raise FlowError(Diagnostic(
                f"the Ray cluster has no GPU and no `{SLOT}` resource: serverless instances take one each",
                hint=f"start its nodes with --resources '{{\"{SLOT}\": N}}' (N devices a node), give every "
                     "worker group a placement pool with `gpus` (an autoscaling cluster then adds nodes on "
                     "demand), or let flowrl start a local Ray instance"))
        run = uuid.uuid4().hex[:8]
        self.clock = TaskClock(f"{run}/")  # instance tasks are named by their ledger token, `RUN/GROUP/...`
        keep_warm = bool(graph.run.get("keep_warm", True))
        mailbox = self.mailbox = remote_mailbox.remote()
        policy = self._policy(graph.run)
        slots = self.shared_slots = Slots()  # the cluster's devices as they are at each decision: waiting
        # instances never hold what their peers need
        acquire = None
        if joined:  # a cluster may lack what a pool needs: fail within `acquire_timeout`, naming the pool
            acquire = Acquire(float(str(graph.run.get("acquire_timeout", 60.0))), self.clock, pools)
            acquire.lower_bounds({wg.pool: devices[wg.name].asks() for wg in graph.worker_groups
                                  if wg.pool is not None})  # what one instance of each pool takes
        for wg in graph.worker_groups:
            decl = pools.get(wg.pool or "")
            mine = devices[wg.name]
            upper = (decl.gpus.hi if isinstance(decl.gpus, Range) else int(decl.gpus)) if decl is not None \
                else mine.capacity(cluster)
            size = upper if joined and decl is not None else min(upper, mine.capacity(cluster))
            on_device = decl is not None and decl.options.get("keep_warm") == "device"
            floor = decl.gpus.lo if decl is not None and isinstance(decl.gpus, Range) else 0
            trains = tuple(sorted({str(n.model) for n in graph.nodes if n.op == "update"
                                   and n.worker_group == wg.name}))
            build = Build(tuple(graph.model(m) for m in wg.models), graph.models, seed, device, keep_warm, trains,
                          on_device)
            self.groups[wg.name] = ServerlessGroup(wg.name, wg.pool, build, max(1, size), run,
                                                   crash_on_call=self.crash_on_call.get(wg.name),
                                                   policy=policy, mailbox=mailbox, slots=slots, floor=floor,
                                                   acquire=acquire, devices=mine, track=self.clock.track)
        for g in self.groups.values():
            g.start()
        return dict(self.groups)

    def _policy(self, r: Mapping[str, Any]) -> Policy:
        """The pools' elastic policy from `run { ... }`, less the mechanisms this backend was asked to ablate."""
        policy = Policy(cost_weight=float(str(r.get("cost_weight", 0.5))), prewarm=bool(r.get("prewarm", True)),
                        margin_s=float(str(r.get("prewarm_margin", 0.05))), tau=float(str(r.get("migrate_at", 0.7))),
                        predict="predict" not in self.ablate, assign="assign" not in self.ablate,
                        scale="scale" not in self.ablate,
                        dedup="off" if "dedup" in self.ablate else str(r.get("dedup_prefill", "auto")))
        if "migrate" in self.ablate:
            policy = replace(policy, tau=1.0)
        if "prewarm" in self.ablate:
            policy = replace(policy, prewarm=False)
        if self.late is not None:
            policy = replace(policy, late=self.late)
        if "late" in self.ablate:
            policy = replace(policy, late=0.0)
        if "env_release" in self.ablate:  # multi-turn instances hold their devices through environment waits
            policy = replace(policy, env_release=False)
        return policy

    def begin_step(self, step: int) -> None:
        """Each pool pre-warms, from its step history, the instances its first call of this step will want."""
        began = time.perf_counter()
        for g in self.groups.values():
            g.begin_step(began)

    def after_update(self, model: str, group: str) -> float:
        """The other holders of `model` now want the version `group` just trained: a reference, loaded by their
        instances when they next run (that load is timed in the cost report as `loading`)."""
        self.load_snapshot(model, group, self.snapshot(model, group))
        return 0.0

    def snapshot(self, model: str, group: str) -> Any:
        return self.groups[group].state[model]

    def load_snapshot(self, model: str, group: str, weights: Any) -> float:
        for name, g in self.groups.items():
            if name != group and model in g.models:
                g.state[model] = weights
        return 0.0

    def usage(self) -> list[Usage]:
        """The instance tasks since the last call, with the attempts lost on the way (one ledger read a step),
        each charged what the cluster counted (`Usage.outside_s`); after `shutdown`, what it found after the
        last step."""
        if not self.groups:
            out, self.tail = self.tail, []
            return out
        used = [u for g in self.groups.values() for u in g.take_usage()]
        finished = {t: u for g in self.groups.values() for t, u in g.take_finished().items()}
        tried = ray.get(self.mailbox.take_attempts.remote(list(finished))) if finished and self.mailbox else {}
        lost = {t: lost_attempts({t: a}, finished) for t, a in tried.items()}
        return self._as_counted(used, finished, lost)

    def _as_counted(self, used: list[Usage], finished: Mapping[str, Usage],
                    lost: Mapping[str, list[Usage]]) -> list[Usage]:
        """`used` and the lost attempts, each charged what the cluster counted from Ray's task events: a lost
        attempt its attempt's reservation (`lost_s`), a returned task the part of its last attempt's beyond its
        own timers (`outside_s`); a task whose events did not come keeps its timers' figures."""
        gone = [replace(u, measured=False) for us in lost.values() for u in us]
        if self.clock is None or not finished:
            return [replace(u, measured=False) for u in used] + gone
        held, missing = self.clock.held(list(finished))
        self.unmeasured += len(missing)
        token = {id(u): t for t, u in finished.items()}
        out = []
        for u in used:
            t = token.get(id(u))
            if t is None or t not in held:
                out.append(replace(u, measured=False))
                continue
            out.append(replace(u, outside_s=held[t][-1] - u.held_s, measured=True))
        for t, us in lost.items():  # the attempts before the last, in order
            counted = held.get(t, [])[:-1]
            if len(counted) == len(us):
                out += [replace(u, lost_s=s, measured=True) for u, s in zip(us, counted, strict=True)]
            else:  # attempts Ray's events and the ledger count differently: each ledger attempt as timed
                out += [replace(u, measured=False) for u in us]
        self.held_total_s += sum(u.held_s for u in out)
        self.held_measured_s += sum(u.held_s for u in out if u.measured)
        return out

    @property
    def measured_frac(self) -> float:
        """The share of `held_total_s` that Ray's task events measured (the rest: tasks' own timers); 1.0 for a
        run that held nothing."""
        return self.held_measured_s / self.held_total_s if self.held_total_s > 0 else 1.0

    def metrics(self) -> dict[str, float]:
        """Each pool's scaling decisions since the last call (`scale/GROUP/...`), and `cost/unmeasured_tasks`:
        instance tasks whose task events had not come when their usage was read (charged by their own timers;
        none where the driver reports its events every 20 ms), when there were any."""
        out = {k: v for g in self.groups.values() for k, v in g.take_metrics().items()}
        if self.unmeasured:
            out["cost/unmeasured_tasks"], self.unmeasured = float(self.unmeasured), 0
        return out

    def shutdown(self) -> None:
        """Release the waiting instances; once every task has returned, keep what ran after the last step's
        usage (`usage()` gives it), which completes `held_total_s`. Then
        leave nothing of the run on the cluster: the Mailbox actor ends and every object reference the pools
        held is dropped, so on a cluster the driver stays connected to (a notebook, a script that goes on) no
        node keeps an actor or a pinned object of the run, and an autoscaler can remove the nodes it added."""
        for g in self.groups.values():
            g.close()
        try:
            if self.clock is not None and ray.is_initialized():
                for g in self.groups.values():
                    g.drain()
                self.tail = self.usage()
        finally:
            for g in self.groups.values():
                g.forget()
            if self.shared_slots is not None:
                self.shared_slots.forget()
            if self.mailbox is not None and ray.is_initialized():
                ray.kill(self.mailbox, no_restart=True)
            self.groups, self.mailbox, self.shared_slots = {}, None, None
            self.session.close()
