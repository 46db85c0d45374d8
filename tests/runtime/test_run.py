"""End-to-end runs on the local backend: outputs, determinism, resume, overrides and error paths."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import flowrl
from flowrl import run
from flowrl.cli import main
from flowrl.errors import FlowError, RewardError

TINY = """
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 1e-3 }}
model ref : reference {{ source = actor }}
{critic}
reward correct = "{reward}"
data prompts = jsonl("data.jsonl") {{ batch = 4 }}
use {algo}(reward = correct, {group} = 4, max_tokens = 3, kl_coef = 0.01)
run {{ steps = 4, seed = 3, checkpoint_every = 2 }}
"""


def write_flow(tmp: Path, algo: str = "grpo", reward: str = "flowrl.rewards.arith_exact") -> Path:
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(3) for b in range(3)]
    (tmp / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    critic = 'model critic : critic { source = actor }' if algo == "ppo" else ""
    group = "n" if algo in ("ppo", "reinforce_pp") else "group"
    path = tmp / f"{algo}.flow"
    path.write_text(TINY.format(critic=critic, reward=reward, algo=algo, group=group))
    return path


def strip_times(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "cost/")) and k not in ("step_time_s", "tokens_per_s")}
            for r in rows]


@pytest.mark.parametrize("algo", ["grpo", "ppo", "rloo", "reinforce_pp"])
def test_every_stdlib_algorithm_runs(tmp_path: Path, algo: str) -> None:
    res = run(flowrl.load(str(write_flow(tmp_path, algo))), out_dir=tmp_path / "out", steps=2)
    assert [r["step"] for r in res.metrics] == [1, 2]
    row = res.metrics[-1]
    for key in ("reward_mean", "response_len_mean", "kl_mean", "loss", "step_time_s", "gen_tokens",
                "time/rollout", "time/ref_logp", "time/actor.update"):
        assert key in row, key
    if algo == "reinforce_pp":  # its advantages read old_logp (the KL in the reward): the forward stays
        assert "time/old_logp" in row
    else:  # one optimizer step per rollout: on-policy-logp dropped the forward; the update measures kl_mean
        assert "time/old_logp" not in row and row["kl_mean"] == row["actor/kl_mean"]
    if algo == "ppo":
        assert "critic/vf_loss" in row and "time/values" in row


def test_run_directory_has_everything(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run(flowrl.load(str(write_flow(tmp_path))), out_dir=out)
    for name in ("metrics.jsonl", "trace.json", "graph.txt", "graph.json", "reward.png", "run.json"):
        assert (out / name).stat().st_size > 0, name
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002.pt", "step_000004.pt"]
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    nodes = {e["name"] for e in spans}
    assert {"prompts", "rollout", "ref_logp", "scores", "adv", "actor.update"} <= nodes
    assert len(spans) == 4 * len(nodes)  # one span per node per step
    assert {e["args"]["name"] for e in trace if e["name"] == "thread_name"} >= {"controller", "colocated"}


def test_same_seed_same_metrics(tmp_path: Path) -> None:
    graph = flowrl.load(str(write_flow(tmp_path)))
    a = run(graph, out_dir=tmp_path / "a").metrics
    b = run(graph, out_dir=tmp_path / "b").metrics
    assert strip_times(a) == strip_times(b)
    c = run(graph, out_dir=tmp_path / "c", seed=4).metrics
    assert strip_times(a) != strip_times(c)


def test_resume_continues_exactly(tmp_path: Path) -> None:
    graph = flowrl.load(str(write_flow(tmp_path)))
    full = run(graph, out_dir=tmp_path / "full").metrics
    part = tmp_path / "part"
    run(graph, out_dir=part, steps=2)  # stops after the step-2 checkpoint
    resumed = run(graph, out_dir=part, resume=True).metrics
    assert strip_times(resumed) == strip_times(full)
    spans = [e for e in json.loads((part / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert sorted({e["args"]["step"] for e in spans}) == [1, 2, 3, 4]


def test_resume_after_losing_later_steps(tmp_path: Path) -> None:
    """A crash after step 3 (checkpoint at 2) resumes from 2 and recomputes 3 and 4."""
    graph = flowrl.load(str(write_flow(tmp_path)))
    out = tmp_path / "crash"
    run(graph, out_dir=out)
    (out / "checkpoints" / "step_000004.pt").unlink()
    resumed = run(graph, out_dir=out, resume=True).metrics
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]


def test_existing_run_is_never_silently_replaced(tmp_path: Path) -> None:
    graph = flowrl.load(str(write_flow(tmp_path)))
    out = tmp_path / "once"
    run(graph, out_dir=out, steps=2)
    with pytest.raises(FlowError, match="already holds a run"):
        run(graph, out_dir=out, steps=2)
    again = run(graph, out_dir=out, steps=1, overwrite=True)
    assert [r["step"] for r in again.metrics] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001.pt"]


def test_cli_run_with_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flow = write_flow(tmp_path)
    out = tmp_path / "cli"
    code = main(["run", str(flow), "--steps", "2", "--out", str(out), "--quiet",
                 "--set", "actor.lr=5e-4", "--set", "prompts.batch=2", "--set", "use.group=2"])
    assert code == 0, capsys.readouterr().err
    graph = json.loads((out / "graph.json").read_text())
    assert graph["models"][0]["lr"] == 5e-4
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["gen_tokens"] <= 2 * 2 * 3  # 2 prompts x 2 samples x at most 3 tokens
    assert "done: 2 steps" in capsys.readouterr().out


def test_cli_resume_without_checkpoints_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(write_flow(tmp_path)), "--out", str(tmp_path / "none"), "--resume"]) == 1
    assert "--resume: no checkpoints in" in capsys.readouterr().err


def test_failing_reward_names_node_and_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad_reward.py").write_text(
        "import flowrl\n\n@flowrl.reward('boom')\ndef boom(prompt, response, answer):\n"
        "    raise ZeroDivisionError('no reward for ' + prompt)\n"
    )
    flow = write_flow(tmp_path, reward="boom")
    flow.write_text('import "bad_reward"\n' + flow.read_text())
    with pytest.raises(RewardError) as err:
        run(flowrl.load(str(flow)), out_dir=tmp_path / "out", steps=1)
    text = err.value.render()
    assert "while executing scores = reward(rollout)" in text
    assert "reward 'correct' raised ZeroDivisionError: no reward for" in text and "sample 0" in text  # the flow's name
    assert main(["run", str(flow), "--steps", "1", "--out", str(tmp_path / "o2"), "--quiet"]) == 1
    err_text = capsys.readouterr().err
    assert "Traceback" not in err_text and "reward 'correct' raised" in err_text


def test_bad_data_line_is_reported_at_check_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flow = write_flow(tmp_path)
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": 3\n')
    assert main(["check", str(flow)]) == 1
    err = capsys.readouterr().err
    assert "data.jsonl:2:" in err and "invalid JSON" in err and "Traceback" not in err
    with pytest.raises(FlowError):
        flowrl.load(str(flow))


def test_hf_checkpoint_source_runs(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """`source = "hf:PATH"` loads a local Hugging Face checkpoint and tokenizer — the path real models take —
    without transformers' own progress bars in flowrl's output."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate("0123456789+=")} | {"<pad>": 12, "<eos>": 13, "<unk>": 14}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    ckpt = tmp_path / "ckpt"
    fast.save_pretrained(ckpt)
    GPT2LMHeadModel(GPT2Config(vocab_size=15, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                               eos_token_id=13, pad_token_id=12)).save_pretrained(ckpt)
    flow = write_flow(tmp_path)
    text = flow.read_text().replace(
        'source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 1e-3',
        'source = "hf:ckpt", lr = 1e-3')
    flow.write_text(text)
    capfd.readouterr()  # what saving the checkpoint printed
    res = run(flowrl.load(str(flow)), out_dir=tmp_path / "out", steps=2)
    assert res.metrics[-1]["gen_tokens"] > 0
    out, err = capfd.readouterr()
    assert "Loading weights" not in out + err and "Writing model shards" not in out + err
    shutil.rmtree(ckpt)


def test_lr_warmup_ramps_linearly(tmp_path: Path) -> None:
    flow = write_flow(tmp_path)
    graph = flowrl.load(str(flow), overrides={"actor.warmup_steps": "4"})
    lrs = [r["actor/lr"] for r in run(graph, out_dir=tmp_path / "out").metrics]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])


def test_deepspeed_engine_trains_like_torch(tmp_path: Path) -> None:
    """`engine = "deepspeed"` (ZeRO-0 and ZeRO-2 on CPU/gloo) follows the torch engine's trajectory."""
    flow = str(write_flow(tmp_path))
    torch_run = run(flowrl.load(flow), out_dir=tmp_path / "torch", steps=3).metrics
    for stage in ("0", "2"):
        graph = flowrl.load(flow, overrides={"actor.engine": '"deepspeed"', "actor.zero_stage": stage})
        ds_run = run(graph, out_dir=tmp_path / f"ds{stage}", steps=3).metrics
        for a, b in zip(torch_run, ds_run, strict=True):
            assert a["reward_mean"] == b["reward_mean"]
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)


def test_unavailable_engine_is_a_clear_error(tmp_path: Path) -> None:
    graph = flowrl.load(str(write_flow(tmp_path)), overrides={"actor.engine": '"vllm"'})
    with pytest.raises(FlowError) as err:
        run(graph, out_dir=tmp_path / "out", steps=1)
    text = err.value.render()
    assert 'engine "vllm"' in text and "Traceback" not in text


def test_the_scripting_api_runs_the_default_passes_like_the_cli(tmp_path: Path) -> None:
    path = str(write_flow(tmp_path))
    graph = flowrl.load(path)
    assert [p.name for p in graph.passes][:1] == ["on-policy-logp"] and not graph.has_node("old_logp")
    assert flowrl.load(path, passes=False).has_node("old_logp")
    assert "on-policy-logp" not in [p.name for p in flowrl.load(path, no_pass=["on-policy-logp"]).passes]
    with pytest.raises(FlowError, match="unknown pass 'nope'"):
        flowrl.load(path, no_pass=["nope"])


def test_a_closed_output_pipe_stops_the_run_quietly(tmp_path: Path) -> None:
    """`flowrl run x.flow 2>&1 | head`: once the reader is gone, the run stops with SIGPIPE's status (141), no
    'internal error' or crash log, and what it wrote so far is kept."""
    import subprocess
    import sys

    flow, out = write_flow(tmp_path), tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "flowrl", "run", str(flow), "--out", str(out), "--steps", "2000",
                             "--set", "run.log_every=1", "--set", "run.checkpoint_every=1"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    first = proc.stderr.readline()
    proc.stderr.close()  # the reader leaves after one line
    assert proc.wait(timeout=300) == 141, first
    assert first.startswith(b"step 1/2000")
    assert not (tmp_path / "flowrl-crash.log").exists()
    assert (out / "metrics.jsonl").read_text().strip()  # the steps it ran are on disk
