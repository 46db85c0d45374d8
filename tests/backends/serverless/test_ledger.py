"""A serverless pool's ledger (backends/serverless/ledger.py): finished tasks recorded with their tokens and taken
whole once a step, the attempts a lost process left (worked values), and an instance's stats as its usage."""

from __future__ import annotations

import threading

import pytest

from flowrl.backends.serverless.ledger import Ledger, lost_attempts, usage_of
from flowrl.runtime.protocol import Usage

STATS = {"pid": 7, "began": 100.0, "start_s": 1.5, "load_s": 0.25, "run_s": 2.0, "cold": True, "wait_s": 0.0,
         "prewarmed": False, "ready_first": False, "served": True}


def test_an_instance_s_stats_become_its_usage() -> None:
    u = usage_of("gen", "actor", {**STATS, "device": "cuda:1", "models_on": "cuda:1", "gpu_ids": ["7"],
                                  "kept_on_device": False, "mem_floor": 1024.0, "mem_after": 1536.0})
    assert (u.pool, u.pid, u.held_s, u.device, u.gpu, u.left_bytes) == ("gen", 7, 3.75, "cuda:1", "7", 512.0)
    plain = usage_of("gen", "actor", STATS)  # a CPU instance: no GPU, no device memory read
    assert (plain.device, plain.gpu, plain.kept_on_device, plain.left_bytes) == ("", "", False, 0.0)


def test_a_lost_attempt_held_its_slot_until_its_retry_began() -> None:
    kept = usage_of("gen", "actor", STATS)
    lost = lost_attempts({"t": [(9, 90.0), (7, 100.0)], "u": [(7, 100.0)]}, {"t": kept, "u": kept})
    assert lost == [Usage("gen", "actor", 9, 90.0, 0.0, 0.0, 0.0, True, lost_s=10.0)]


def test_calls_finishing_on_another_thread_are_taken_whole() -> None:
    """The rollout thread records while the controller takes: every task is taken once, with its token."""
    ledger, n = Ledger(), 2000
    u = usage_of("gen", "actor", STATS)
    taken: list[Usage] = []
    finished: dict[str, Usage] = {}
    go = threading.Event()

    def record() -> None:
        go.wait()
        for i in range(n):
            ledger.record([u], [f"task-{i}"])
            ledger.note({"scale/gen/instances": float(i)})

    t = threading.Thread(target=record)
    t.start()
    go.set()
    while t.is_alive():
        taken += ledger.take_usage()
        finished.update(ledger.take_finished())
    t.join()
    taken += ledger.take_usage()
    finished.update(ledger.take_finished())
    assert len(taken) == n and sorted(finished) == sorted(f"task-{i}" for i in range(n))
    assert ledger.take_metrics() == {"scale/gen/instances": float(n - 1)} and ledger.take_metrics() == {}


@pytest.mark.parametrize("tokens", [[], ["a"]])
def test_a_record_without_tokens_still_counts_its_usage(tokens: list[str]) -> None:
    ledger = Ledger()
    u = usage_of("gen", "actor", STATS)
    ledger.record([u, u], tokens)
    assert len(ledger.take_usage()) == 2 and list(ledger.take_finished()) == tokens
