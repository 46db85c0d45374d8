"""Views from a real (short) local run: the timeline from its trace.json and the timings-coloured graph."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import matplotlib.image as mpimg

import flowrl
from flowrl.cli import main

FLOW = """
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=" }
model ref : reference { source = actor }
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("data.jsonl") { batch = 2 }
use grpo(reward = correct, group = 2, max_tokens = 2)
run { steps = 3 }
"""


def test_timeline_and_timings_from_a_real_run(tmp_path: Path) -> None:
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2=", "answer": 4}\n')
    flow = tmp_path / "tiny.flow"
    flow.write_text(FLOW)
    out = tmp_path / "run"
    flowrl.run(flowrl.load(str(flow)), out_dir=out)

    png = tmp_path / "timeline.png"
    assert main(["timeline", str(out), "-o", str(png)]) == 0
    height, width = mpimg.imread(png).shape[:2]
    assert width > 400 and height > 100

    svg = tmp_path / "timed.svg"
    assert main(["viz", str(flow), "-o", str(svg), "--timings", str(out)]) == 0
    text = "".join(ET.parse(svg).getroot().itertext())
    assert "rollout" in text and "ms" in text and "%" in text
