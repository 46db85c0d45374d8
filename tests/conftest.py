"""Shared pytest options and fixtures."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import flowrl
from flowrl.ir.graph import Graph

# Every Ray head a test starts (ray.init here, `ray start --head` in a subprocess) waits up to 120 s for its GCS to
# come up, as flowrl's own local instance does (backends/ray/cluster.py): Ray's 30 s ran out on a busy CI machine.
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")

# Under `make test` each of the two pytest-xdist workers has one of the machine's cores: torch's default, a thread per
# core in each, would have four threads share two cores. (Ranks and Ray workers set their own counts.)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The order the tests run in: tests marked `ray` (runs that start Ray workers, which mostly wait on Ray's
    processes) first, then the files with a `slow` test (end-to-end training runs), then the rest, each file's tests
    in their order. `make test` runs the suite on two pytest-xdist workers, which take the tests one at a time from
    the front of this order: a long test taken last would leave one worker running it alone at the end. Tests
    marked `autoscaling` shut this process's Ray down and start an autoscaling cluster whose nodes are processes of
    this machine: when collected with the others, they run last."""
    slow_files = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def rank(item: pytest.Item) -> tuple[bool, int]:
        return (item.get_closest_marker("autoscaling") is not None,
                0 if item.get_closest_marker("ray") else 1 if item.nodeid.split("::")[0] in slow_files else 2)

    items.sort(key=rank)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite tests/golden/*.txt from the current output instead of comparing")


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    """True when the run was started with --update-golden."""
    return bool(request.config.getoption("--update-golden"))


# GRPO on split pools (generation on `gen`, the update and the reference on `train`), a tiny GPT-2 with a learning
# rate high enough that consecutive weight versions differ, and a reward that scores digits: it differs within a
# group from the first step (arith_exact is 0 for an untrained policy, so the first updates would change nothing).
SPLIT_GRPO = """
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 3e-3 }}
model ref : reference {{ source = actor }}
reward scored = "{reward}"
data prompts = jsonl("data.jsonl") {{ batch = 4 }}
use grpo(reward = scored, group = 4, max_tokens = 3, kl_coef = 0.01{use})
placement {{
    pool gen   {{ gpus = {gen} }}
    pool train {{ gpus = 1 }}
    actor.generate -> gen
    actor.update, ref -> train
}}
run {{ steps = {steps}, seed = 5, max_staleness = {k}{run} }}
"""


@pytest.fixture
def split_grpo(tmp_path: Path) -> Callable[..., Graph]:
    """Writes SPLIT_GRPO (as f.flow), its digits reward and its 16 prompts into tmp_path and loads it."""

    def make(*, k: int = 0, steps: int = 4, gen: str = "1", reward: str = "digits.reward", use: str = "",
             run: str = "") -> Graph:
        (tmp_path / "digits.py").write_text("def reward(prompt, response, **_):\n"
                                            "    return float(sum(c.isdigit() for c in response))\n")
        rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(4) for b in range(4)]
        (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp_path / "f.flow").write_text(SPLIT_GRPO.format(k=k, steps=steps, gen=gen, reward=reward, use=use,
                                                           run=run))
        return flowrl.load(str(tmp_path / "f.flow"))

    return make


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """One local Ray instance (4 logical CPUs, 4 device slots: the serverless backend's) for every test that asks for
    it, started by the first and kept to the session's end; the backends reuse it instead of starting their own."""
    import ray  # the ray extra is part of the test set-up: a missing Ray fails, it is not skipped
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # as flowrl's Session does: the serverless cost report reads each step's task events as the step ends
    os.environ.setdefault("RAY_task_events_report_interval_ms", "20")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, resources={"device_slot": 4}, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING, namespace="flowrl-tests")  # device slots: the serverless backend
    yield ray
    if started:
        ray.shutdown()
