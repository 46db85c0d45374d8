"""`--set ENV.KEY=VALUE` reaches `env` and `tool` blocks (issue 26): the block's own keys and an env class's options,
with the same located errors as any other override."""

from __future__ import annotations

from pathlib import Path

import pytest

import flowrl
from flowrl.errors import FlowError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _env(graph: flowrl.Graph) -> dict:
    return dict(next(n for n in graph.nodes if n.op == "generate").attrs["env"])


def test_set_overrides_a_tools_keys() -> None:
    env = _env(flowrl.load(str(EXAMPLES / "calc_tool.flow"), {"calc.max_turns": 3, "calc.timeout": 7}))
    assert env["max_turns"] == 3 and env["timeout"] == 7.0
    assert _env(flowrl.load(str(EXAMPLES / "calc_tool.flow")))["max_turns"] == 2  # as written


def test_set_overrides_an_env_class_option() -> None:
    env = _env(flowrl.load(str(EXAMPLES / "guess_number.flow"), {"game.hit": 2.0, "game.max_turns": 4}))
    assert env["max_turns"] == 4
    assert env["options"] == {"hit": 2.0, "miss": -0.05, "invalid": -0.5}


@pytest.mark.parametrize(("key", "message", "hint"), [
    ("calc.max_turnz", "unknown tool key `max_turnz`", "did you mean `max_turns`?"),
    ("calx.max_turns", "no model, data, reward or env named `calx`", "did you mean `calc`?"),
    ("calc.max_turns", "max_turns", None),  # out of its limit: 0 turns
])
def test_bad_env_overrides_are_located(key: str, message: str, hint: str | None) -> None:
    with pytest.raises(FlowError) as err:
        flowrl.load(str(EXAMPLES / "calc_tool.flow"), {key: 0 if key == "calc.max_turns" else 3})
    d = err.value.diagnostics[0]
    assert d.loc is not None and d.loc.path == "<overrides>" and message in d.message
    if hint is not None:
        assert d.hint == hint


ROOM = """
class Room:
    def __init__(self, size: int = 3) -> None:
        self.size = size
    def reset(self, row):
        return ""
    def step(self, action):
        return "", 0.0, True
"""
FLOW = """
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 16, heads = 2, charset = "0123456789+=" }
model ref : reference { source = actor }
env room = "room.Room" { max_turns = 2, workers = 0, size = 4 }
data prompts = jsonl("data.jsonl") { batch = 1 }
use grpo(env = room, group = 2, max_tokens = 2)
"""


def test_class_options_are_checked_against_the_class(tmp_path: Path) -> None:
    (tmp_path / "room.py").write_text(ROOM)
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1="}\n')
    (tmp_path / "f.flow").write_text(FLOW)
    assert _env(flowrl.load(str(tmp_path / "f.flow"), {"room.size": 6}))["options"] == {"size": 6}
    with pytest.raises(FlowError) as err:
        flowrl.load(str(tmp_path / "f.flow"), {"room.sise": 6})
    d = err.value.diagnostics[0]
    assert d.loc is not None and d.loc.path == "<overrides>" and "unknown env key `sise`" in d.message
    assert d.hint == "did you mean `size`?"
