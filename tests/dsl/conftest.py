"""Fixtures for the language tests: compile flow text next to `tests/dsl/flows/` (so `data/arith.jsonl`
resolves) under the path `t.flow`, and get the full rendered error of a bad flow."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from flowrl.dsl import compile_flow
from flowrl.errors import FlowError
from flowrl.ir.graph import Graph

FLOWS = Path(__file__).parent / "flows"

@pytest.fixture
def in_flows(monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(FLOWS)
    return FLOWS


@pytest.fixture
def compile_ok(in_flows: Path) -> Callable[..., Graph]:
    def run(text: str, overrides: Mapping[str, str] | None = None, path: str = "t.flow") -> Graph:
        return compile_flow(text, path, overrides)

    return run


@pytest.fixture
def compile_error(in_flows: Path) -> Callable[..., str]:
    """The rendered FlowError of a flow that must not compile."""

    def run(text: str, overrides: Mapping[str, str] | None = None, path: str = "t.flow") -> str:
        with pytest.raises(FlowError) as info:
            compile_flow(text, path, overrides)
        return info.value.render()

    return run
