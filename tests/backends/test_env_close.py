"""Backends close the environment pools their workers hold when the run ends (issue 26): no environment process
of a run is left once `flowrl.run` has returned — on the local backend (in-process workers, closed by the backend's
shutdown, not at garbage collection) and the process backend (each rank closes its pools when told to stop)."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import psutil
import pytest

import flowrl
from flowrl import backends

ROOT = Path(__file__).resolve().parents[2]
FLOW = f"""
flow env_close
model actor : policy {{ source = "tiny:llama", layers = 1, dim = 16, heads = 2, charset = "0123456789*=();", context = 32 }}
model ref : reference {{ source = actor }}
tool calc = "envs.calc.calc" {{ call = "(", end = ")", max_turns = 2, workers = 2, timeout = 5 }}
reward correct = "envs.calc.final_answer"
data prompts = jsonl("{ROOT / 'examples' / 'data' / 'calc.jsonl'}") {{ batch = 2 }}
use grpo(reward = correct, env = calc, group = 2, max_tokens = 2)
run {{ steps = 1, seed = 0 }}
"""


def _env_processes(mark: str) -> list[psutil.Process]:
    """Environment host processes (flowrl.envs.host) whose environment carries `mark` (children inherit it)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if "flowrl.envs.host" in " ".join(proc.cmdline()) and proc.environ().get("FLOWRL_TEST_MARK") == mark:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return [p for p in found if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("backend", ["local", "process"])
def test_no_environment_process_outlives_the_run(backend: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    mark = uuid.uuid4().hex
    monkeypatch.setenv("FLOWRL_TEST_MARK", mark)
    flow = tmp_path / "env_close.flow"
    flow.write_text(FLOW)
    (tmp_path / "envs").mkdir()
    shutil.copy(ROOT / "examples" / "envs" / "calc.py", tmp_path / "envs" / "calc.py")  # beside the flow
    be = backends.make(backend)  # held here: its groups and workers stay referenced, so nothing closes at GC
    result = flowrl.run(flowrl.load(str(flow)), backend=be, out_dir=tmp_path / "out")
    assert result.steps == 1 and "env/tool_calls_mean" in result.metrics[-1]  # the tool's processes did run
    assert [(p.pid, p.cmdline()[:3], p.ppid()) for p in _env_processes(mark)] == []
