"""A serverless pool's ledger: the instance tasks that finished (their `Usage`, for the cost report), the token
each ran under (for the attempts lost on the way) and the pool's own figures (scaling, migration, prefill).

Calls finish on whichever thread waits for them: the controller's, or an asynchronous run's rollout thread
(flowrl.runtime.ahead), while the controller takes a step's usage and metrics. Everything here is under one
lock, so a task is recorded with its token at once and a take gets whole records, never half of one.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from flowrl.runtime.protocol import Usage


def usage_of(pool: str, group: str, st: Mapping[str, Any]) -> Usage:
    """An instance task's stats (instance.serve / prewarm) as the usage the cost report reads."""
    gpus, floor, after = st.get("gpu_ids") or [""], st.get("mem_floor"), st.get("mem_after")
    return Usage(pool, group, int(st["pid"]), float(st["began"]), float(st["start_s"]), float(st["load_s"]),
                 float(st["run_s"]), bool(st["cold"]), float(st["wait_s"]), bool(st["prewarmed"]),
                 bool(st["ready_first"]), bool(st["served"]), str(st.get("models_on", st.get("device", ""))),
                 str(gpus[0]), bool(st.get("kept_on_device", False)),
                 max(0.0, float(after) - float(floor)) if after is not None and floor is not None else 0.0)


def lost_attempts(attempts: Mapping[str, Sequence[tuple[int, float]]], finished: Mapping[str, Usage]) -> list[Usage]:
    """Attempts whose process was lost (Ray re-ran their task), from the Mailbox's records (token -> (pid,
    start) of each attempt) and the usage each task's returning attempt reported: each lost one held its slot
    from its start to the next attempt's start, and forced a replacement to start (counted as a cold start)."""
    out = []
    for token, tried in attempts.items():
        kept = finished[token]
        ordered = sorted(tried, key=lambda a: a[1])
        for (pid, began), (_, retried) in zip(ordered, ordered[1:], strict=False):
            if pid != kept.pid:
                out.append(Usage(kept.pool, kept.group, pid, began, 0.0, 0.0, 0.0, True, lost_s=retried - began))
    return out


class Ledger:
    """What a pool's finished tasks leave for the controller to take once a step."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._usage: list[Usage] = []
        self._finished: dict[str, Usage] = {}  # task token -> the usage its finished attempt reported
        self._metrics: dict[str, float] = {}

    def record(self, used: Sequence[Usage], tokens: Sequence[str]) -> None:
        """Finished tasks, each with its token (the Mailbox keys its attempts by it)."""
        with self.lock:
            self._usage.extend(used)
            self._finished.update(zip(tokens, used, strict=False))

    def note(self, metrics: Mapping[str, float]) -> None:
        with self.lock:
            self._metrics.update(metrics)

    def take_usage(self) -> list[Usage]:
        with self.lock:
            out, self._usage = self._usage, []
        return out

    def take_finished(self) -> dict[str, Usage]:
        with self.lock:
            out, self._finished = self._finished, {}
        return out

    def take_metrics(self) -> dict[str, float]:
        with self.lock:
            out, self._metrics = self._metrics, {}
        return out
