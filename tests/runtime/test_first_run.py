"""What a newcomer sees while a flow runs (issue 33, item 8): a preference stage's progress line (a stable headline,
its loss and latest held-out score beside it, rows/s instead of `0 tok/s`), the curve each run draws (the stage's
own headline, not an empty `reward_mean`), `flowrl compile` printing the learning rate an update trains at,
`flowrl check --set`, `flowrl show` saying what each template is, and `flowrl run` opening with what the flow
says to expect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import flowrl
from flowrl.cli import main
from flowrl.dsl import compile_flow
from flowrl.ir.printer import to_text
from flowrl.runtime.progress import Progress
from flowrl.runtime.report import plot_headline

# Pairs and demonstrations over sums, written here: the correct sum preferred; 4 pairs held out.
PAIRS = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1), "held_out": i % 4 == 0}
         for i, (a, b) in enumerate((a, b) for a in range(4) for b in range(4))]
DEMOS = [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a in range(3) for b in range(3)]
MODELS = """\
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 16, heads = 2, charset = "0123456789+=", lr = 3e-3 }
model rm : reward_model { source = actor }
"""


def write(folder: Path, flow: str) -> Path:
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    (folder / "demos.jsonl").write_text("".join(json.dumps(r) + "\n" for r in DEMOS))
    path = folder / "t.flow"
    path.write_text(flow)
    return path


RM_FLOW = MODELS + """data pairs = jsonl("pairs.jsonl") { batch = 4, held_out = "held_out" }
use reward_model(eval_every = 2)
run { steps = 4, seed = 0 }
"""
SFT_FLOW = MODELS + """data demos = jsonl("demos.jsonl") { batch = 4 }
use sft(demos = demos)
run { steps = 3, seed = 0 }
"""


def test_a_reward_model_run_draws_its_accuracy_and_a_steady_progress_line(tmp_path: Path) -> None:
    from matplotlib.image import imread

    graph = compile_flow(RM_FLOW, str(write(tmp_path, RM_FLOW)))
    out = tmp_path / "out"
    lines: list[str] = []
    with Progress(4, enabled=False) as bar:
        result = flowrl.run(graph, out_dir=out, backend="local",
                            on_step=lambda step, row: lines.append(bar.line(step, row)))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["data_rows"] for r in rows] == [4.0] * 4  # the 4 pairs a step draws
    acc = [r["rm/rm_accuracy"] for r in rows]
    assert all((a * 4).is_integer() for a in acc)  # the update's own count agrees: an accuracy over 4 pairs
    evals = {r["step"]: r["rm/eval_accuracy"] for r in rows if "rm/eval_accuracy" in r}
    assert sorted(evals) == [2, 4]
    for step, (line, row) in enumerate(zip(lines, rows, strict=True), 1):
        shown_eval = f"  eval_acc {evals[2]:.3f}" if step in (2, 3) else f"  eval_acc {evals[4]:.3f}" if step == 4 else ""
        rate = f"{4 / row['step_time_s']:.0f} rows/s"
        assert line == (f"step {step}/4  acc {acc[step - 1]:.3f}  loss {row['rm/rm_loss']:.3f}{shown_eval}  {rate}  "
                        f"{row['step_time_s']:.2f} s/step")
    assert (out / "accuracy.png").exists() and not (out / "reward.png").exists()
    image = imread(out / "accuracy.png")  # matplotlib's own reader: a drawn curve, not a blank canvas
    assert image.shape[0] > 100 and len({tuple(p) for p in image.reshape(-1, image.shape[-1])[::7]}) > 20
    again = plot_headline(result.metrics, tmp_path, "t")
    assert again is not None and (again.path.name, again.key) == ("accuracy.png", "rm/rm_accuracy")
    assert again.steps == [1, 2, 3, 4] and again.values == acc
    assert again.held_out == {"eval_acc": sorted(evals.items())}


def test_an_sft_run_draws_its_loss_and_compile_prints_the_rate_it_trains_at(tmp_path: Path) -> None:
    graph = compile_flow(SFT_FLOW, str(write(tmp_path, SFT_FLOW)))
    update = next(line for line in to_text(graph).splitlines() if "actor.update(" in line)
    assert "lr=0.003," in update and "lr=0.0," not in update
    result = flowrl.run(graph, out_dir=tmp_path / "out", backend="local")
    assert {r["actor/lr"] for r in result.metrics} == {0.003}  # the optimizer's own rate, as the engine reads it
    assert (tmp_path / "out" / "sft_loss.png").exists() and not (tmp_path / "out" / "reward.png").exists()
    plot = plot_headline(result.metrics, tmp_path, "t")
    assert plot is not None and plot.key == "actor/sft_loss"
    assert plot.values == [r["actor/sft_loss"] for r in result.metrics]


def test_a_reward_model_without_its_own_lr_prints_the_one_it_trains_at(tmp_path: Path) -> None:
    graph = compile_flow(RM_FLOW, str(write(tmp_path, RM_FLOW)), {"run.steps": "1", "use.eval_every": "0"})
    update = next(line for line in to_text(graph).splitlines() if "rm.update(" in line)
    result = flowrl.run(graph, out_dir=tmp_path / "out", backend="local")
    assert f"lr={result.metrics[0]['rm/lr']!r}," in update and result.metrics[0]["rm/lr"] == 1e-05


def test_check_takes_set_and_checks_what_will_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flow = str(write(tmp_path, SFT_FLOW.replace("batch = 4", "batch = 40")))
    assert main(["check", flow]) == 1
    assert "`batch = 40` prompts a step is more than the 9 rows" in capsys.readouterr().err
    assert main(["check", flow, "--set", "demos.batch=8"]) == 0
    assert capsys.readouterr().out == f"{flow}: ok\n"
    assert main(["check", flow, "--set", "actor.lr=-1"]) == 1
    assert capsys.readouterr().err.startswith("<overrides>:1:10: error: `lr` must be above 0")
    assert main(["check", flow, "--set", "actor.lr"]) == 1
    assert "--set expects KEY=VALUE, got 'actor.lr'" in capsys.readouterr().err


def test_show_lists_each_template_with_a_line_from_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from flowrl.dsl import templates

    assert main(["show"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == templates.stdlib_names()
    grpo = next(line for line in listed if line.startswith("grpo "))
    assert grpo == "grpo          GRPO (Shao et al., 2024): sample `group` responses per prompt, score them…"
    # a template added later is described from its own file
    for name in templates.stdlib_names():
        (tmp_path / f"{name}.flow").write_text(templates.template_source(name))
    (tmp_path / "dapo.flow").write_text("# DAPO (Yu et al., 2025): GRPO with decoupled clipping. More here.\n"
                                        + templates.template_source("grpo").replace("template grpo", "template dapo"))
    monkeypatch.setattr(templates, "STDLIB_DIR", tmp_path)
    assert main(["show"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert next(line for line in listed if line.startswith("dapo ")) == \
        "dapo          DAPO (Yu et al., 2025): GRPO with decoupled clipping."


def test_run_opens_with_what_the_flow_says_to_expect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    said = "# SFT on nine sums: sft_loss falls from ~2.6.\n#\n# (a note)\n"
    flow = str(write(tmp_path, said + SFT_FLOW))
    assert main(["run", flow, "--steps", "1", "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert err.startswith("# SFT on nine sums: sft_loss falls from ~2.6.\n#\n# (a note)\nstep 1/1  sft_loss "), err
    assert main(["run", flow, "--steps", "1", "--out", str(tmp_path / "b"), "--quiet"]) == 0
    assert "sft_loss falls" not in capsys.readouterr().err
