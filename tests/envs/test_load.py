"""flowrl.envs.load: a declaration's class or tool function found from the flow's folder, and each way it can be
wrong said in one sentence (what `flowrl check` shows at the declaration)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flowrl.envs import EnvLoadError, EnvSpec, load_env_class

HERE = str(Path(__file__).resolve().parent)


def spec(target: str, kind: str = "env", **keys: Any) -> EnvSpec:
    return EnvSpec("calc", target, kind=kind, folder=HERE, **keys)


def test_a_class_with_both_methods_loads() -> None:
    cls = load_env_class(spec("sample_envs.Counter", options={"limit": 2}))
    env = cls(limit=2)
    assert env.reset({"name": "n"}) == "start n"
    assert env.step("a")[2] is False and env.step("a")[2] is True


def test_async_methods_and_imports_are_accepted() -> None:
    assert load_env_class(spec("sample_envs.AsyncOk", imports=("sample_envs",))).__name__ == "AsyncOk"


def test_a_tool_becomes_an_environment_class() -> None:
    cls = load_env_class(spec("sample_envs.calc", kind="tool", call="<calc>", stop=("</calc>",)))
    env = cls()
    assert env.reset({"prompt": "p"}) == ""
    assert env.step("so <calc>6*7</calc>") == ("42", 0.0, False)


@pytest.mark.parametrize(("target", "kind", "keys", "problem"), [
    ("no_such_module_xyz.Calc", "env", {},
     "env 'calc': cannot import module 'no_such_module_xyz': ModuleNotFoundError: "
     "No module named 'no_such_module_xyz'"),
    ("sample_envs.Nope", "env", {}, "module 'sample_envs' has no class 'Nope'"),
    ("Calc", "env", {}, "env 'calc': 'Calc' is not a dotted path"),
    ("sample_envs.calc", "env", {}, "env 'calc': 'sample_envs.calc' is a function, not a class"),
    ("sample_envs.NoStep", "env", {}, "NoStep has no method step(self, action) -> (observation, reward, done)"),
    ("sample_envs.TwoArgStep", "env", {},
     "TwoArgStep.step does not take one argument: it should be step(self, action) -> (observation, reward, done)"),
    ("sample_envs.Counter", "env", {"options": {"size": 3}},
     "Counter(limit=3) cannot be made from the block's other keys (size)"),
    ("sample_envs.Nope", "tool", {"call": "<c>"}, "module 'sample_envs' has no function 'Nope'"),
    ("sample_envs.NOT_CALLABLE", "tool", {"call": "<c>"},
     "tool 'calc': 'sample_envs.NOT_CALLABLE' is a int, not a function"),
    ("sample_envs.Counter", "tool", {"call": "<c>"}, "tool 'calc': 'sample_envs.Counter' is a type, not a function"),
    ("sample_envs.no_args", "tool", {"call": "<c>"},
     "tool 'calc': no_args() does not take the arguments' text: it should be fn(args: str, **row) -> str"),
    ("sample_envs.calc", "tool", {}, "tool 'calc' has no call marker"),
    ("sample_envs.calc", "tool", {"call": "<c>", "options": {"size": 1}}, "tool 'calc' takes no key 'size'"),
    ("sample_envs.calc", "game", {}, "'calc' is of kind 'game', not 'env' or 'tool'"),
])
def test_what_is_wrong_is_said(target: str, kind: str, keys: dict[str, Any], problem: str) -> None:
    with pytest.raises(EnvLoadError) as caught:
        load_env_class(spec(target, kind, **keys))
    assert caught.value.problem == problem
    assert str(caught.value).startswith(f"error: {problem}")


def test_a_module_that_raises_on_import() -> None:
    with pytest.raises(EnvLoadError) as caught:
        load_env_class(spec("sample_envs_broken.Env"))
    assert caught.value.problem == ("env 'calc': cannot import module 'sample_envs_broken': "
                                    "ZeroDivisionError: integer division or modulo by zero")
