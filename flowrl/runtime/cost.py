"""Device-seconds per pool and step: what a run holds, what it uses, what it spends starting (the cost report).

A pool's devices are its worker groups' ranks (on a machine without GPUs a rank stands for the device it would
hold). Three ways of counting what a pool held, by what the backend can tell:
- A backend whose pools the cluster reserves (`Reserving`: the Ray backend's placement groups) is charged what
  the cluster held, each reservation's ranks times its life: from Ray's grant (start-up to the first step
  included: `starting`, with one cold start per rank) through every step's wall time (checkpoint writes
  included) to its removal; what comes after the last step (the final checkpoint, the teardown) is the row
  `ended` gives, in the whole-run totals only (`cost/stopping_s`).
- The local, threads and process backends have no cluster to ask: every device is held from the moment their
  groups start to the end of the run, so per step `held` is the pool's devices times the wall time since the
  previous step ended, and `starting` the time the backend took to start its groups (charged to the first
  step). Their teardown is not charged.
- An elastic backend's (`usage` not None) instance tasks, each held as the cluster counted it where the
  cluster's records came (`Usage.measured`; where the backend measures, `cost/measured_s` and `cost/timed_s`,
  the rest, charged by the tasks' own timers, and `measured_frac`, the first's share of both), plus what the
  report adds itself: a process that kept a group's models on its device (`Usage.kept_on_device`) holds that
  device until it gives them up (`cost/kept_s`, see `DeviceKeeps`).
`busy` is the devices times the union of the pool's nodes' spans, `idle` what is left. Metrics: `cost/held_s`,
`cost/busy_s`, `cost/idle_s`, `cost/starting_s`, `cost/cold_starts` over all pools and `cost/POOL/held_s`,
`cost/POOL/busy_s` per pool; `summary` totals them from metrics.jsonl and `ended`'s row for the end-of-run table
(`cost.json`), so a resumed run reports its whole history (but for an earlier session's teardown).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from flowrl.ir.graph import Graph
from flowrl.runtime.controller import Span
from flowrl.runtime.protocol import Usage, WorkerGroup

PREFIX = "cost/"


def union_s(intervals: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by at least one of `intervals` (start, end)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@dataclass(frozen=True)
class Reservation:
    """What a cluster reserves for a fixed worker group (a Ray placement group): `ranks` devices from `created`
    (when the cluster granted it) to `removed` (when it had them back; None while it lives), wall clock
    (time.time())."""

    group: str
    ranks: int
    created: float
    removed: float | None = None

    def held_s(self, now: float | None = None) -> float:
        """Device-seconds held: ranks times its life (until `now` while it lives)."""
        end = self.removed if self.removed is not None else (time.time() if now is None else now)
        return self.ranks * max(0.0, end - self.created)

    def within_s(self, lo: float, hi: float) -> float:
        """Device-seconds held between `lo` and `hi` (wall clock; a live reservation counts to `hi`)."""
        end = hi if self.removed is None else min(hi, self.removed)
        return self.ranks * max(0.0, end - max(lo, self.created))


@runtime_checkable
class Reserving(Protocol):
    """A backend whose pools the cluster reserves whole (the Ray backend): what it reserved, so far."""

    def reservations(self) -> Sequence[Reservation]: ...


@dataclass(frozen=True)
class Pool:
    name: str
    groups: tuple[str, ...]
    devices: int


def pools_of(graph: Graph, groups: Mapping[str, WorkerGroup]) -> list[Pool]:
    """Each pool with the groups placed on it and the ranks they run (a group without a pool is its own)."""
    found: dict[str, list[str]] = {}
    for g in graph.worker_groups:
        found.setdefault(g.pool or g.name, []).append(g.name)
    return [Pool(name, tuple(names), sum(groups[n].world for n in names if n in groups))
            for name, names in found.items()]


class DeviceKeeps:
    """The devices an elastic backend's processes hold between tasks, which no cluster counter sees: a task that
    kept its group's models on its device (`Usage.kept_on_device`) leaves its process (`pid`) holding that device
    for its pool from the task's end until the process gives them up, while the cluster counts the device free.

    Given up at the process's next task of the same group (which holds the device itself from then on; when that
    task found the models gone, a cold start, they went at the last build of another group's models in that
    process before it, an eviction, or else at its own start), at the process's loss, or at the run's end (the
    last `charge`, after the backend shut down). A task's own hold is placed at [began, began + held_s]: the
    cluster's figure from the task's start (the part Ray counts before the task body, milliseconds, shifts it).
    Charged as time passes: `charge(usage, now)` gives the kept seconds per pool up to `now`, so a step's figure
    is what was kept during it (an eviction learnt later is not taken back)."""

    def __init__(self) -> None:
        self.open: dict[tuple[int, str], tuple[str, float, float]] = {}  # (pid, group) -> (pool, since, charged to)
        self.builds: dict[int, list[float]] = {}  # pid -> when its tasks built their models (cold starts)

    def charge(self, usage: Sequence[Usage], now: float) -> dict[str, float]:
        """The tasks that returned since the last call, and the wall-clock time now -> kept seconds per pool."""
        out: dict[str, float] = {}

        def close(key: tuple[int, str], at: float) -> None:
            pool, _, charged = self.open.pop(key)
            out[pool] = out.get(pool, 0.0) + max(0.0, at - charged)

        for u in sorted(usage, key=lambda u: u.began):
            if u.lost_s > 0:  # its process was lost, and every model it kept with it
                for key in [k for k in self.open if k[0] == u.pid]:
                    close(key, u.began)
                continue
            key = (u.pid, u.group)
            if key in self.open:
                since = self.open[key][1]
                evicted = [b for b in self.builds.get(u.pid, []) if since <= b < u.began] if u.cold else []
                close(key, max(evicted) if evicted else u.began)
            if u.cold:
                self.builds.setdefault(u.pid, []).append(u.began)
            if u.kept_on_device:
                self.open[key] = (u.pool, u.began + u.held_s, u.began + u.held_s)
        for key, (pool, since, charged) in list(self.open.items()):
            out[pool] = out.get(pool, 0.0) + max(0.0, now - charged)
            self.open[key] = (pool, since, max(charged, now))
        return out


class CostMeter:
    """Per-step device-seconds of a run (see the module docstring). `reserving`: the backend, where the cluster
    reserves its pools; `wall`: time.time() minus time.perf_counter() (reservations and instance tasks are on
    the wall clock, steps on perf_counter)."""

    def __init__(self, pools: Sequence[Pool], *, starting_s: float, clock: float, reserving: Reserving | None = None,
                 wall: float = 0.0):
        self.pools = list(pools)
        self.starting_s = starting_s  # the backend's start, charged to the first step this meter sees
        self.last = clock  # perf_counter when the previous step ended (or the groups were up)
        self.first = True
        self.reserving = reserving
        self.wall = wall
        self.keeps = DeviceKeeps()

    def step(self, spans: Sequence[Span], now: float, usage: Sequence[Usage] | None = None) -> dict[str, float]:
        """The step's figures; `usage`: an elastic backend's instance tasks in the step (`Backend.usage()`),
        None for fixed pools."""
        began, wall = self.last, now - self.last
        self.last = now
        if usage is not None:
            return self._elastic(usage, now + self.wall)
        if self.reserving is not None:
            return self._reserved(spans, began + self.wall, now + self.wall)
        out: dict[str, float] = {}
        totals = {"held_s": 0.0, "busy_s": 0.0, "starting_s": 0.0, "cold_starts": 0.0}
        for p in self.pools:
            busy = union_s((s.start, s.start + s.dur) for s in spans if s.group in p.groups) * p.devices
            starting = self.starting_s * p.devices if self.first else 0.0
            held = wall * p.devices + starting
            out[f"{PREFIX}{p.name}/held_s"] = held
            out[f"{PREFIX}{p.name}/busy_s"] = min(busy, held)
            totals["held_s"] += held
            totals["busy_s"] += min(busy, held)
            totals["starting_s"] += starting
            totals["cold_starts"] += p.devices if self.first else 0.0
        totals["idle_s"] = max(0.0, totals["held_s"] - totals["busy_s"] - totals["starting_s"])
        out.update({PREFIX + k: v for k, v in totals.items()})
        self.first = False
        return out

    def ended(self, now: float, usage: Sequence[Usage] | None) -> list[dict[str, float]]:
        """After the backend shut down: what was held after the last step's row, as one row for the whole-run
        totals ([] when nothing was): reservations from the last step's end to their removal (`stopping_s`), an
        elastic backend's tasks since (`usage`) and the devices its processes kept until the run's end."""
        if self.reserving is not None:
            return [self._stopped()]
        if usage or self.keeps.open:
            return [self.step([], now, list(usage or []))]
        return []

    def _reserved(self, spans: Sequence[Span], lo: float, hi: float) -> dict[str, float]:
        """A step of reserved pools (wall clock `lo` to `hi`): each pool's reservations' ranks times their life
        within it; the first step also from each one's grant (`starting`)."""
        out: dict[str, float] = {}
        totals = dict.fromkeys(("held_s", "busy_s", "starting_s", "cold_starts"), 0.0)
        reserved = list(self.reserving.reservations()) if self.reserving is not None else []
        for p in self.pools:
            mine = [r for r in reserved if r.group in p.groups]
            starting = sum(r.within_s(float("-inf"), lo) for r in mine) if self.first else 0.0
            held = starting + sum(r.within_s(lo, hi) for r in mine)
            busy = min(held, union_s((s.start, s.start + s.dur) for s in spans if s.group in p.groups) * p.devices)
            out[f"{PREFIX}{p.name}/held_s"], out[f"{PREFIX}{p.name}/busy_s"] = held, busy
            totals["held_s"] += held
            totals["busy_s"] += busy
            totals["starting_s"] += starting
            totals["cold_starts"] += sum(r.ranks for r in mine) if self.first else 0.0
        totals["idle_s"] = max(0.0, totals["held_s"] - totals["busy_s"] - totals["starting_s"])
        out.update({PREFIX + k: v for k, v in totals.items()})
        self.first = False
        return out

    def _stopped(self) -> dict[str, float]:
        """Reserved pools after the last step: from its end to each reservation's removal, all idle."""
        lo = self.last + self.wall
        reserved = list(self.reserving.reservations()) if self.reserving is not None else []
        out: dict[str, float] = {}
        total = 0.0
        for p in self.pools:
            held = sum(r.within_s(lo, time.time()) for r in reserved if r.group in p.groups)
            out[f"{PREFIX}{p.name}/held_s"] = held
            total += held
        out.update({f"{PREFIX}held_s": total, f"{PREFIX}stopping_s": total, f"{PREFIX}idle_s": total})
        return out

    def _elastic(self, usage: Sequence[Usage], now: float) -> dict[str, float]:
        """Elastic pools hold a device only while an instance runs: held = the instances' task time (building
        the models on a cold start, loading newer weights, a pre-warmed instance's wait for its call, running),
        busy = running, idle = the waits. `prewarmed_s`: what pre-warmed instances held before their call came;
        `cold_starts_waited`: cold starts a call waited for (not pre-warmed, or pre-warmed too late);
        `prewarm_ready|late|unused`: pre-warmed instances ready before their call, not ready, not needed;
        `lost_s`, `lost_instances`: attempts whose process was lost (each also a cold start: its replacement);
        `kept_on_device`: tasks that left their models on the device when they gave it back (`keep_warm =
        "device"`, or an engine that places its own memory): their process still holds that device, counted in
        `held_s` until it gives them up (`DeviceKeeps`; `kept_s`, and `POOL/kept_s`, the part of `held_s` that is
        the report's own: no cluster counter sees it); `device_left_bytes`: the most device memory a task left allocated
        above what it found (0 where every instance gave its device back clean, and off CUDA); where the backend
        measures its tasks (`Usage.measured` not None): `measured_s`, the held that the cluster's records counted,
        `timed_s`, the held of tasks whose records never came (their own timers'), `measured_frac` the first's
        share."""
        out: dict[str, float] = {}
        totals = dict.fromkeys(("held_s", "busy_s", "starting_s", "loading_s", "waiting_s", "prewarmed_s",
                                "lost_s", "cold_starts", "warm_starts", "cold_starts_waited", "prewarm_ready",
                                "prewarm_late", "prewarm_unused", "lost_instances", "kept_on_device",
                                "kept_s", "device_left_bytes"), 0.0)
        counted = dict.fromkeys(("measured_s", "timed_s"), 0.0)
        kept = self.keeps.charge(usage, now)
        names = list(dict.fromkeys([p.name for p in self.pools] + [u.pool for u in usage] + list(kept)))
        for name in names:  # the declared pools, an elastic backend's stage-kind pools
            mine = [u for u in usage if u.pool == name]
            held, busy = sum(u.held_s for u in mine) + kept.get(name, 0.0), sum(u.run_s for u in mine)
            out[f"{PREFIX}{name}/held_s"], out[f"{PREFIX}{name}/busy_s"] = held, busy
            if name in kept:
                out[f"{PREFIX}{name}/kept_s"] = kept[name]
                totals["kept_s"] += kept[name]
            out[f"{PREFIX}{name}/instances"] = float(len({u.pid for u in mine}))
            totals["held_s"] += held
            totals["busy_s"] += busy
            totals["starting_s"] += sum(u.start_s for u in mine)
            totals["loading_s"] += sum(u.load_s for u in mine)
            totals["waiting_s"] += sum(u.wait_s for u in mine)
            totals["prewarmed_s"] += sum(u.ahead_s for u in mine)
            totals["cold_starts"] += sum(1 for u in mine if u.cold)
            totals["warm_starts"] += sum(1 for u in mine if not u.cold)
            totals["cold_starts_waited"] += sum(1 for u in mine if u.cold and u.served and not u.ready_first)
            totals["prewarm_ready"] += sum(1 for u in mine if u.ready_first)
            totals["prewarm_late"] += sum(1 for u in mine if u.prewarmed and u.served and not u.ready_first)
            totals["prewarm_unused"] += sum(1 for u in mine if not u.served)
            totals["lost_s"] += sum(u.lost_s for u in mine)
            totals["lost_instances"] += sum(1 for u in mine if u.lost_s > 0)
            counted["measured_s"] += sum(u.held_s for u in mine if u.measured)
            counted["timed_s"] += sum(u.held_s for u in mine if u.measured is False)
            totals["kept_on_device"] += sum(1 for u in mine if u.kept_on_device)
            totals["device_left_bytes"] = max([totals["device_left_bytes"], *(u.left_bytes for u in mine)])
        totals["idle_s"] = max(0.0, totals["held_s"] - totals["busy_s"] - totals["starting_s"] - totals["loading_s"]
                               - totals["lost_s"])
        if any(u.measured is not None for u in usage):
            totals.update(counted, measured_frac=_measured_frac(counted))
        out.update({PREFIX + k: v for k, v in totals.items()})
        self.first = False
        return out


def summary(rows: Sequence[Mapping[str, Any]], pools: Sequence[Pool], gpu_hour: float = 0.0,
            cpu_hour: float = 0.0) -> dict[str, Any]:
    """The whole run's device-seconds per pool and in all, from its metrics rows; with prices (`run { gpu_hour,
    cpu_hour }`) also money: each pool's held device-seconds at `gpu_hour`, and the controller's host for the
    run's stepping time (the sum of its steps' times) at `cpu_hour`."""

    def total(key: str) -> float:
        return float(sum(float(r.get(key, 0.0)) for r in rows))

    out: dict[str, Any] = {"pools": []}
    devices = {p.name: p.devices for p in pools}
    found = [k[len(PREFIX):-len("/held_s")] for r in rows for k in r if k.startswith(PREFIX) and k.endswith("/held_s")]
    for name in dict.fromkeys(found or devices):  # the pools the rows name (an elastic backend's stage kinds too)
        held, busy = total(f"{PREFIX}{name}/held_s"), total(f"{PREFIX}{name}/busy_s")
        if not held:  # a declared pool an elastic backend never used under that name
            continue
        out["pools"].append({"pool": name, "devices": devices.get(name, 0), "held_s": held, "busy_s": busy,
                             "utilization": busy / held if held else 0.0})
    keys: tuple[str, ...] = ("held_s", "busy_s", "idle_s", "starting_s", "loading_s", "prewarmed_s", "lost_s",
                             "cold_starts", "warm_starts", "cold_starts_waited", "prewarm_ready", "lost_instances",
                             "kept_on_device")
    # what only some backends report: reserved pools' teardown, the devices elastic processes kept
    # and multi-turn runs' device-seconds held while environments ran (flowrl.runtime.controller.env_metrics)
    keys += tuple(k for k in ("stopping_s", "kept_s", "env_wait_held_s", "measured_s", "timed_s")
                  if any(PREFIX + k in r for r in rows))
    for key in keys:
        out[key] = total(PREFIX + key)
    if "measured_s" in out:  # an elastic backend's: how much of its tasks' held the cluster's records measured
        out["measured_frac"] = _measured_frac(out)
    out["utilization"] = out["busy_s"] / out["held_s"] if out["held_s"] else 0.0
    if gpu_hour or cpu_hour:
        for p in out["pools"]:
            p["money"] = p["held_s"] / 3600.0 * gpu_hour
        wall = total("step_time_s")
        out["money"] = {"devices": out["held_s"] / 3600.0 * gpu_hour, "controller": wall / 3600.0 * cpu_hour,
                        "gpu_hour": gpu_hour, "cpu_hour": cpu_hour}
        out["money"]["total"] = out["money"]["devices"] + out["money"]["controller"]
    return out


def _measured_frac(totals: Mapping[str, float]) -> float:
    """The share of the instance tasks' held device-seconds that the cluster's records counted (the rest: their
    own timers'); 1.0 when they held nothing."""
    both = totals["measured_s"] + totals.get("timed_s", 0.0)
    return totals["measured_s"] / both if both > 0 else 1.0


def instance_spans(usage: Sequence[Usage], step: int, t0_wall: float) -> list[Span]:
    """An elastic backend's instance tasks as trace spans, one track per pool (`POOL instances`): where device
    time goes, beside the nodes' own spans."""
    return [Span(f"instance {u.pid}" + (" (lost)" if u.lost_s else " (cold)" if u.cold else "") +
                 (" (pre-warmed)" if u.prewarmed else "") + (f" on {u.device}" if u.device else "") +
                 (f", GPU {u.gpu}" if u.gpu else ""),
                 "held", f"{u.pool} instances", step, u.began - t0_wall, u.held_s) for u in usage]


def table(report: Mapping[str, Any]) -> str:
    """The summary as the text table printed at the end of `flowrl run`."""
    money = report.get("money")
    lines = [f"{'pool':<12} {'devices':>7} {'held dev-s':>11} {'busy dev-s':>11} {'busy':>6}" +
             (f" {'money':>10}" if money else "")]
    for p in report["pools"]:
        lines.append(f"{p['pool']:<12} {p['devices'] or 'elastic':>7} {p['held_s']:>11.1f} {p['busy_s']:>11.1f} "
                     f"{p['utilization']:>6.0%}" + (f" {p['money']:>10.4f}" if money else ""))
    lines.append(f"{'all':<12} {'':>7} {report['held_s']:>11.1f} {report['busy_s']:>11.1f} "
                 f"{report['utilization']:>6.0%}" + (f" {money['devices']:>10.4f}" if money else "") +
                 f"   (starting {report['starting_s']:.1f} dev-s, "
                 + (f"stopping {report['stopping_s']:.1f} dev-s, " if "stopping_s" in report else "")
                 + f"{int(report['cold_starts'])} cold starts"
                 + (f", {int(report.get('prewarm_ready', 0))} pre-warmed ahead of their stage"
                    if report.get("prewarm_ready") else "") + ")")
    if report.get("kept_on_device"):
        lines.append(f"{int(report['kept_on_device'])} instance tasks kept their models on the device after giving "
                     "it back (keep_warm = \"device\"): their processes held those devices "
                     f"{report.get('kept_s', 0.0):.1f} dev-s between tasks, counted in held dev-s (the report's "
                     "own figure: the cluster counts them free)")
    if report.get("measured_frac", 1.0) < 1.0:  # some tasks' records never came: say what the figure rests on
        lines.append(f"{report['measured_frac']:.1%} of the instance tasks' held dev-s is the cluster's own count; "
                     "the rest, tasks whose task events Ray did not keep, is their own timers' (it misses "
                     "scheduling and result transfer)")
    if money:
        lines.append(f"money: {money['total']:.4f} = devices {money['devices']:.4f} at {money['gpu_hour']:g} a "
                     f"device-hour + controller {money['controller']:.4f} at {money['cpu_hour']:g} an hour")
    return "\n".join(lines)
