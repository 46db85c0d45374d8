"""How long a process-backend worker group of two ranks takes to start (until both ranks answer), twice in one
driver: the first start, and a later one (a second group, a split placement's other pool, the next run in the
same process, the test suite). Run it from each tree to compare, alternating:

    PYTHONPATH=/path/to/tree .venv/bin/python bench/rank_start.py

Measured 2026-11-28 on the 2-core CPU machine, quiet, 3 alternated runs each (seconds: first, later):
spawned ranks (8b2e0c8) 3.44/3.64, 3.43/3.58, 3.56/3.52; ranks forked from the preloaded server (785f292)
3.50/1.78, 3.55/1.85, 3.87/1.89. The first start is the same (the server imports torch and transformers once, as
a spawned rank did); every later start is about half.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import flowrl
from flowrl.backends.process.group import ProcessRanks

ROOT = Path(__file__).resolve().parents[1]
FLOW = f"""
model actor : policy {{ source = "tiny:gpt2", layers = 2, dim = 64, heads = 4, charset = "0123456789+=", lr = 1e-3 }}
model ref : reference {{ source = actor }}
reward r = "flowrl.rewards.arith_exact"
data prompts = jsonl("{ROOT}/examples/data/arith.jsonl")
use grpo(reward = r, group = 2, max_tokens = 2)
"""


def main() -> None:
    graph = flowrl.compile_flow(FLOW, "/flows/rank_start.flow")
    starts = []
    for _ in range(2):
        t = time.perf_counter()
        ranks = ProcessRanks("colocated", [graph.model("actor")], graph.models, 2, seed=0)
        assert [ranks.on_rank(r, "pad_id", "actor") for r in range(2)] == [ranks.pads["actor"]] * 2
        starts.append(round(time.perf_counter() - t, 2))
        ranks.close()
    print(json.dumps({"start_s": starts}))


if __name__ == "__main__":
    main()
