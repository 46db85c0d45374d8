"""flowrl.ir.printer: a pool's serverless keys (`gpu_fraction`, `keep_warm`) are printed by `flowrl compile`, text
and JSON, and a pool without them prints as before."""

from __future__ import annotations

import shutil
from pathlib import Path

import flowrl
from flowrl.ir import to_json, to_text

ROOT = Path(__file__).resolve().parents[2]

FLOW = """
model actor : policy { source = "tiny:gpt2", charset = "0123456789+=" }
model ref : reference { source = actor }
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("arith.jsonl") { batch = 4 }
use grpo(reward = correct, group = 2, max_tokens = 2)
placement {
    pool gen   { gpus = 0..2, elastic = true, gpu_fraction = 0.5, keep_warm = "device" }
    pool train { gpus = 1 }
    actor.generate -> gen
    actor.update, ref -> train
}
"""


def test_a_pools_serverless_keys_are_printed(tmp_path: Path) -> None:
    shutil.copy(ROOT / "examples" / "data" / "arith.jsonl", tmp_path / "arith.jsonl")
    graph = flowrl.compile_flow(FLOW, str(tmp_path / "pools.flow"))
    lines = to_text(graph).splitlines()
    assert 'pool gen {gpus=0..2, elastic=true, gpu_fraction=0.5, keep_warm="device"}' in lines
    assert "pool train {gpus=1, elastic=false}" in lines
    assert to_json(graph)["pools"] == [
        {"name": "gen", "gpus": "0..2", "elastic": True, "gpu_fraction": 0.5, "keep_warm": "device"},
        {"name": "train", "gpus": 1, "elastic": False},
    ]
