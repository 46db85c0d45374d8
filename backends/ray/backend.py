"""`RayBackend`: each worker group of the compiled graph becomes N Ray actors in a placement group.

`start` sizes the groups (`cluster.group_specs`), reserves one placement group per worker group, starts every
rank at once and waits for all of them (each placement group's life, from Ray's grant (the GCS's time its last
bundle was placed) to its removal (on a cluster flowrl joined: when Ray counts its resources free again), is kept
in `reserved`: the device-time the cluster held for the fixed pools, what the cost report charges
(`reservations()`, flowrl.runtime.cost) and bench/serverless.py sets against the serverless pools' held time); `after_update` is the controller's hook for split placement's weight
sync; `shutdown` stops the actors, frees the placement groups (waiting until Ray counts their resources free
again, so a run started next in the same cluster can size its groups) and stops Ray if it was started here. It
is safe to call `shutdown` at any point (after Ctrl-C, after an error, twice).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from flowrl.backends.ray.cluster import Session, group_specs
from flowrl.backends.ray.group import GroupSpec, RankLost, RayWorkerGroup, WorkerLostError
from flowrl.backends.ray.sync import WeightSync
from flowrl.errors import Diagnostic, FlowError
from flowrl.ir.graph import Graph
from flowrl.runtime.cost import Reservation
from flowrl.runtime.protocol import WorkerGroup

log = logging.getLogger("flowrl.ray")
RELEASE_TIMEOUT_S = 10.0  # how long `shutdown` waits for removed placement groups' resources to be free again


class RayBackend:
    """`address`: a cluster to join (default: `RAY_ADDRESS`, else start a local instance, or reuse the one this
    process already started). `log_dir`: where Ray's logs go (the run directory's `ray/`). `num_cpus`: CPUs of a
    local instance (default: all). `snapshot_every`: state-changing calls (updates, weight loads) between two
    snapshots of a group's weights for restarting dead ranks (1: after every update). `crash_on_call`:
    test-only fault injection, `{group: {rank: n}}` makes that rank's first process exit at its n-th model call."""

    name = "ray"

    def __init__(self, address: str | None = None, log_dir: str | Path | None = None, *,
                 num_cpus: int | None = None, start_timeout_s: float = 120.0, snapshot_every: int = 10,
                 crash_on_call: Mapping[str, Mapping[int, int | tuple[str, int]]] | None = None):
        self.session = Session(address, log_dir, num_cpus)
        self.start_timeout_s = start_timeout_s
        self.crash_on_call = crash_on_call
        self.snapshot_every = snapshot_every
        self.groups: dict[str, RayWorkerGroup] = {}
        self.sync: WeightSync | None = None
        self._pgs: list[PlacementGroup] = []
        self.reserved: list[Reservation] = []  # every placement group this backend created, in order
        self._free_before: dict[str, float] = {}  # CPU/GPU free when `start` reserved ours

    def start(self, graph: Graph, *, seed: int, device: str) -> dict[str, WorkerGroup]:
        self.session.open()
        free = ray.available_resources()
        self._free_before = {k: float(free[k]) for k in ("CPU", "GPU") if k in free}
        specs = group_specs(graph, seed=seed, device=device, resources=free,
                            crash_on_call=self.crash_on_call, snapshot_every=self.snapshot_every)
        holders: dict[str, list[str]] = {}
        for wg in graph.worker_groups:
            for m in wg.models:
                holders.setdefault(m, []).append(wg.name)
        # An asynchronous run's generating model is synced by the controller's snapshots, at the version each
        # batch is generated with (flowrl.runtime.ahead), never pulled newest-first.
        manual = {str(n.model) for n in graph.nodes if n.op == "generate" and n.attrs.get("max_staleness")}
        self.sync = WeightSync(holders, manual=manual)
        pgs = {s.name: self._reserve(s) for s in specs}
        self._await_placement(specs, pgs)
        self._granted(pgs)
        for s in specs:  # every rank of every group starts at once; then wait for them all
            self.groups[s.name] = RayWorkerGroup(s, pgs[s.name], self.sync)
        self.sync.groups = self.groups
        for g in self.groups.values():
            try:
                g.setup()
            except RankLost as e:
                raise WorkerLostError(f"worker group {g.name} failed to start: {e}") from None
        return dict(self.groups)

    def begin_step(self, step: int) -> None:
        pass  # fixed pools: nothing to start ahead

    def after_update(self, model: str, group: str) -> float:
        """Called by the controller after `model.update` ran in `group`: seconds spent sending the new weights to
        the other groups that hold `model` (split placement); 0.0 when none does (colocated: already in place)."""
        if self.sync is None or not self.sync.shared(model):
            return 0.0
        return self.sync.push(model)

    why_not_async = ""  # every rank holds its own copy of its models

    def snapshot(self, model: str, group: str) -> Any:
        """Rank 0's weights of `model` in `group`, now, put in the object store once."""
        return ray.put(self.groups[group].call("weights", model, packed=True, dispatch="rank0").result())

    def load_snapshot(self, model: str, group: str, weights: Any) -> float:
        began = time.perf_counter()
        futures = [g.call("load_weights", model, weights, dispatch="broadcast")
                   for name, g in sorted(self.groups.items()) if name != group and model in g.models]
        for f in futures:
            f.result()
        return time.perf_counter() - began

    def metrics(self) -> dict[str, float]:
        return {}

    def usage(self) -> None:
        return None  # fixed pools: every device held from start to shutdown

    def reservations(self) -> list[Reservation]:
        """Every placement group this backend created, with its grant and (once removed) removal: what the cost
        report charges (flowrl.runtime.cost.Reserving)."""
        return list(self.reserved)

    def shutdown(self) -> None:
        for g in self.groups.values():
            g.kill()
        self.groups = {}
        removed = 0
        for pg in self._pgs:
            try:
                remove_placement_group(pg)
                removed += 1
            except Exception:  # Ray already stopping: the placement group goes with it
                pass
        self._pgs = []
        if removed and not self.session.owned:
            self._await_release()
        # the reservations end once removed (on a cluster flowrl joined: once Ray counts them free again)
        now = time.time()
        self.reserved = [r if r.removed is not None else replace(r, removed=now) for r in self.reserved]
        self.session.close()

    def _await_release(self) -> None:
        """Removing a placement group is asynchronous: wait (at most RELEASE_TIMEOUT_S) until the cluster has as
        much free as before `start`, else the next run in this cluster (a test session's, a notebook's) sees its
        CPUs still taken and cannot size its groups. Someone else taking them meanwhile only costs the wait."""
        deadline = time.monotonic() + RELEASE_TIMEOUT_S
        while time.monotonic() < deadline and ray.is_initialized():
            free = ray.available_resources()
            if all(free.get(k, 0.0) >= v - 1e-6 for k, v in self._free_before.items()):
                return
            time.sleep(0.05)

    # ---- placement groups ---------------------------------------------------------------------------
    def _reserve(self, spec: GroupSpec) -> PlacementGroup:
        self.reserved.append(Reservation(spec.name, spec.world, time.time()))
        pg = placement_group([dict(spec.bundle) for _ in range(spec.world)], strategy="PACK",
                             name=f"flowrl-{spec.name}-{uuid.uuid4().hex[:8]}")
        self._pgs.append(pg)
        return pg

    def _granted(self, pgs: Mapping[str, PlacementGroup]) -> None:
        """Each reservation's start moved to when Ray granted it: the GCS's time its last bundle was placed
        (before that, the cluster held nothing for it; a busy cluster may have kept it waiting)."""
        from ray.core.generated import gcs_pb2

        accessor = ray._private.state.state._connect_and_get_accessor()  # what ray.util.placement_group_table reads
        granted = {}
        for name, pg in pgs.items():
            raw = accessor.get_placement_group_info(pg.id)
            if raw is not None:
                info = gcs_pb2.PlacementGroupTableData.FromString(raw)  # type: ignore[attr-defined]
                at = info.placement_group_final_bundle_placement_timestamp_ms
                if at > 0:
                    granted[name] = at / 1e3
        self.reserved = [replace(r, created=granted[r.group]) if r.removed is None and r.group in granted else r
                         for r in self.reserved]

    def _await_placement(self, specs: list[GroupSpec], pgs: Mapping[str, PlacementGroup]) -> None:
        refs = [pgs[s.name].ready() for s in specs]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.start_timeout_s)
        if len(ready) == len(refs):
            return
        waiting = [s for s, r in zip(specs, refs, strict=True) if r not in ready]
        asked = "; ".join(f"{s.name}: {s.world} x {dict(s.bundle)}" for s in waiting)
        raise FlowError(Diagnostic(
            f"the Ray cluster cannot place worker group(s) {asked} within {self.start_timeout_s:.0f}s "
            f"(free: {ray.available_resources()})",
            hint="lower `replicas` or `gpus` in the flow, or join a bigger cluster (--address)"))
