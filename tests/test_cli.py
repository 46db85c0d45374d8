"""`flowrl run` on a flow whose mistake only shows at run time, and on a flowrl bug (through `flowrl.cli.main`).

A run-time error names the node, its line (a template's line and the user's `use` line), and, as the hint, the
line of the user's code that raised, never a path inside flowrl. A flowrl bug is an internal error whose
traceback goes to a new file in the run's directory, never the working directory, never over an earlier one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import flowrl
from flowrl.cli import main
from flowrl.errors import user_frame_hint

ROWS = "".join(json.dumps({"prompt": f"{a}+{b}=", "answer": a + b}) + "\n" for a in range(2) for b in range(2))
MODELS = """\
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 16, heads = 2, charset = "0123456789+=" }
model ref : reference { source = actor }
data prompts = jsonl("data.jsonl") { batch = 2 }
"""


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "data.jsonl").write_text(ROWS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_reward_that_raises_names_the_template_line_and_the_use(folder: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (folder / "cli_raising_rewards.py").write_text("def bad(prompt, response, **row):\n    return 1 / 0\n")
    (folder / "f.flow").write_text(MODELS + 'reward r = "cli_raising_rewards.bad"\nuse grpo(reward = r, group = 2, '
                                            "max_tokens = 2)\n")
    assert main(["run", "f.flow", "--steps", "1", "--quiet", "--out", "out"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "error: while executing scores = reward(rollout)  # <stdlib>/grpo.flow:11, used at f.flow:5"
    assert "Traceback" not in err and "flowrl/" not in err


def test_a_user_function_that_raises_is_hinted_at_its_own_line(folder: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    (folder / "cli_raising_fns.py").write_text("import flowrl\n\n\n@flowrl.function()\ndef boom(scores):\n"
                                      "    raise ValueError('no baseline today')\n")
    (folder / "g.flow").write_text('import "cli_raising_fns"\n' + MODELS + 'reward r = "flowrl.rewards.arith_exact"\n'
                                   "step {\n    rollout = actor.generate(prompts, n = 2, max_tokens = 2)\n"
                                   "    scores = r(rollout)\n    adv = boom(scores)\n"
                                   "    actor.update(rollout, advantages = adv)\n}\n")
    assert main(["run", "g.flow", "--steps", "1", "--quiet", "--out", "out"]) == 1
    assert capsys.readouterr().err == ("error: while executing adv = boom(scores)  # g.flow:9: ValueError: no "
                                       "baseline today\nhint: raised at cli_raising_fns.py:6 in boom\n")


def test_a_traceback_inside_flowrl_alone_names_no_path() -> None:
    from flowrl.data.jsonl import PromptLoader

    try:
        PromptLoader(rows=[], batch=1, shuffle=False, seed=0).next_batch()  # no rows: fails inside flowrl
    except IndexError as e:
        tb = e.__traceback__
        assert tb is not None
        hint = user_frame_hint(tb.tb_next)  # from the frame that raised on (this test's own frame left out)
    assert hint == "no code of yours raised it: if the flow is right, this is a flowrl bug; please report it"


def test_a_flowrl_bug_leaves_its_log_in_the_run_directory_a_new_one_each_time(
        folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The bug is injected (flowrl.run raising): what is tested is where the CLI puts what it knows."""
    (folder / "f.flow").write_text(MODELS + 'reward r = "flowrl.rewards.arith_exact"\nuse grpo(reward = r, '
                                            "group = 2, max_tokens = 2)\n")

    def bug(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a flowrl bug")

    monkeypatch.setattr(flowrl, "run", bug)
    logs = []
    for _ in range(2):
        assert main(["run", "f.flow", "--quiet", "--out", "out"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("flowrl: internal error: RuntimeError: a flowrl bug\n(details in ")
        logs.append(Path(err.split("(details in ", 1)[1].split(";", 1)[0]))
    assert logs[0] != logs[1] and all(p.parent == folder / "out" and p.is_file() for p in logs)
    assert "RuntimeError: a flowrl bug" in logs[0].read_text()
    assert not list(folder.glob("*crash*"))  # nothing in the working directory
    assert sys.modules["flowrl"].run is bug


ASYNC = Path(__file__).resolve().parents[1] / "examples" / "grpo_arith_async.flow"


def test_check_warns_of_an_asynchronous_flow_on_a_backend_that_cannot_overlap(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(ASYNC), "--backend", "threads"]) == 0
    out = capsys.readouterr()
    assert out.out == f"{ASYNC}: ok\n"
    assert out.err.startswith(f"{ASYNC}: warning: run {{ max_staleness = 1 }} is not applied on the threads backend, "
                              "the run is synchronous: the threads backend's groups share each model's one copy")
    assert out.err.endswith("hint: run it with --backend process, ray or serverless\n")


def test_check_notes_where_an_asynchronous_flow_runs_synchronously(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(ASYNC)]) == 0
    assert capsys.readouterr().err == (
        f"{ASYNC}: note: run {{ max_staleness = 1 }} overlaps generation with training on the process, ray, "
        "serverless backends; on local and threads the run is synchronous (`flowrl check --backend NAME` says "
        "which applies)\n")
    assert main(["check", str(ASYNC), "--backend", "process"]) == 0
    assert capsys.readouterr().err == ""
