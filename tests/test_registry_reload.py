"""Two flows in one process, each with its own reward module of the same name next to it, each get their own."""

from __future__ import annotations

from pathlib import Path

import flowrl

FLOW = """\
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 16, heads = 2, charset = "0123456789+=", lr = 1e-3 }
model ref : reference { source = actor }
reward score = "samename.reward"
data prompts = jsonl("data.jsonl") { batch = 2 }
use grpo(reward = score, group = 2, max_tokens = 2)
"""


def _flow(folder: Path, value: float) -> Path:
    folder.mkdir()
    (folder / "samename.py").write_text(f"def reward(prompt, response, **_):\n    return {value}\n")
    (folder / "data.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": "2+2="}\n')
    (folder / "f.flow").write_text(FLOW)
    return folder / "f.flow"


def test_a_reward_module_is_the_one_next_to_the_flow_not_the_first_of_its_name_imported(tmp_path: Path) -> None:
    means = []
    for value in (1.0, 2.0):
        flow = _flow(tmp_path / f"flow{int(value)}", value)
        result = flowrl.run(flowrl.load(str(flow), {"run.steps": 1}), out_dir=str(tmp_path / f"run{int(value)}"))
        means.append(result.metrics[-1]["reward_mean"])
    assert means == [1.0, 2.0]
