"""A process-backend rank makes its own rendezvous, whatever the parent's environment says. (Before, a spawned rank
inherited the MASTER_PORT an in-process DeepSpeed engine of the parent had set, and its store still listened there:
a one-rank group's DeepSpeed failed with EADDRINUSE, as test_zero3_ranks' resume on one rank did in the full suite.
Two ranks now meet at a store the parent listens on before they start, never at a port found free and then handed
over.)"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

import flowrl
from backends.process.group import ProcessRanks

ROOT = Path(__file__).resolve().parents[2]
FLOW = """
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 16, heads = 2, charset = "0123456789+=", lr = 1e-3,
                       engine = "deepspeed" }
model ref : reference { source = actor }
reward r = "flowrl.rewards.arith_exact"
data prompts = jsonl("examples/data/arith.jsonl")
use grpo(reward = r, group = 2, max_tokens = 2)
"""


@pytest.fixture
def taken_port(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """The parent's own rendezvous, as an in-process DeepSpeed engine leaves it: its port in the environment, and
    something listening there."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = int(sock.getsockname()[1])
        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                           ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            monkeypatch.setenv(key, value)
        yield port


@pytest.mark.parametrize("world", [1, 2])
def test_ranks_start_whatever_rendezvous_the_parent_holds(taken_port: int, world: int) -> None:
    graph = flowrl.compile_flow(FLOW.replace("examples/", f"{ROOT}/examples/"), "/flows/rendezvous.flow")
    ranks = ProcessRanks("colocated", [graph.model("actor")], graph.models, world, seed=0)
    try:
        assert [ranks.on_rank(r, "pad_id", "actor") for r in range(world)] == [ranks.pads["actor"]] * world
    finally:
        ranks.close()
