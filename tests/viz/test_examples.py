"""Every example flow draws in every stage (real once `examples/*.flow` and the front end land)."""

from __future__ import annotations

import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

from flowrl.viz import render
from flowrl.viz.views import STAGES

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.flow"))
SVG = "{http://www.w3.org/2000/svg}"


PLACED_PPO = """
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, trainable = true, lr = 1e-4 }
model ref : reference { source = actor }
model critic : critic { source = actor, lr = 5e-5 }
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("arith.jsonl") { batch = 4 }
use ppo(reward = correct, max_tokens = 8)
placement {
    pool rollout { gpus = 2..16, elastic = true }
    pool train   { gpus = 8 }
    actor.generate -> rollout
    actor.update, ref, critic -> train
}
"""


def test_examples_render(tmp_path: Path) -> None:
    assert EXAMPLES, "examples/*.flow found none"
    _render_all(EXAMPLES, tmp_path)


def test_a_placed_flow_renders(tmp_path: Path) -> None:
    """A flow through the real front end, with a placement block (pools, an elastic range)."""
    rows = "".join(f'{{"prompt": "{a}+1=", "answer": "{a + 1}"}}\n' for a in range(4))  # one per prompt of a batch
    (tmp_path / "arith.jsonl").write_text(rows, encoding="utf-8")
    flow = tmp_path / "placed_ppo.flow"
    flow.write_text(PLACED_PPO, encoding="utf-8")
    _render_all([flow], tmp_path)


def _render_all(flows: list[Path], tmp_path: Path) -> None:
    from flowrl.compiler import compile_any
    from flowrl.dsl.stages import Pipeline

    fmt = "svg" if shutil.which("dot") else "dot"
    for flow in flows:
        compiled = compile_any(str(flow))
        # a pipeline's stages are drawn side by side, each stage's names in its cluster (`cluster_STAGE/GROUP`)
        graphs = ([(f"{s.name}/", s.graph) for s in compiled.stages] if isinstance(compiled, Pipeline)
                  else [("", compiled)])
        for stage in STAGES:
            out = render(str(flow), tmp_path / f"{flow.stem}_{stage}.{fmt}", stage=stage)
            if fmt == "dot":
                assert out.read_text(encoding="utf-8").startswith("digraph"), (flow.name, stage)
                continue
            root = ET.parse(out).getroot()
            words = {t.text.strip() for t in root.iter(f"{SVG}text") if t.text}
            for prefix, graph in graphs:
                missing = [n.id for n in graph.nodes if n.id not in words]
                assert not missing, (flow.name, stage, missing)
                if stage == "placed":
                    titles = [g.findtext(f"{SVG}title") for g in root.iter(f"{SVG}g") if g.get("class") == "cluster"]
                    for w in graph.worker_groups:
                        assert titles.count(f"cluster_{prefix}{w.name}") == 1, (flow.name, w.name)
