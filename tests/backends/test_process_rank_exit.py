"""A process-backend rank that ends without answering (killed, or crashed outside a call) is an error naming it:
the parent holds no copy of the rank's end of the pipe, so the rank's exit is an EOF there. (Before, a call to a
dead rank was a bare BrokenPipeError, and a rank that died during a call left the parent reading a pipe whose other
end it held itself: a full suite's run waited on a zombie rank in test_zero3_ranks until it was killed.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import flowrl
from backends.process.group import ProcessRanks

ROOT = Path(__file__).resolve().parents[2]
FLOW = """
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 16, heads = 2, charset = "0123456789+=", lr = 1e-3 }
model ref : reference { source = actor }
reward r = "flowrl.rewards.arith_exact"
data prompts = jsonl("examples/data/arith.jsonl")
use grpo(reward = r, group = 2, max_tokens = 2)
"""


def test_a_call_to_a_rank_that_died_raises_naming_it() -> None:
    graph = flowrl.compile_flow(FLOW.replace("examples/", f"{ROOT}/examples/"), "/flows/rank_exit.flow")
    ranks = ProcessRanks("colocated", [graph.model("actor")], graph.models, 1, seed=0)
    try:
        assert ranks.on_rank(0, "pad_id", "actor") == ranks.pads["actor"]  # alive: it answers
        os.kill(ranks.procs[0].pid, signal.SIGKILL)
        ranks.procs[0].join(timeout=60)
        with pytest.raises(RuntimeError, match=r"rank 0 of worker group `colocated` ended \(exit code -9\) before it "
                                               r"answered"):
            ranks.on_rank(0, "pad_id", "actor")
    finally:
        for proc in ranks.procs:
            proc.kill()
