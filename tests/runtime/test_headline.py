"""The headline a user reads is what the policy optimises: with an environment that returns rewards and a declared
reward, `reward_mean` and the progress bar show their sum per trajectory (as the advantages add them), and the parts
stay as `reward/NAME` and `env/return_mean`; a sample's reward is that sum too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import flowrl
from flowrl.runtime.progress import Progress

HERE = Path(__file__).resolve().parent
FLOW = """\
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 1e-3,
                       context = 64 }
model ref : reference { source = actor }
env counter = "sample_envs.Counter" { max_turns = 3, stop = "+", workers = 0, timeout = 10, limit = 3 }
reward half = "half.reward"
data prompts = jsonl("data.jsonl") { batch = 2 }
use grpo(reward = half, env = counter, group = 2, max_tokens = 3)
run { steps = 2, seed = 1, log_samples = 4 }
"""


def test_reward_mean_is_the_declared_reward_plus_the_environments_return(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.copy(HERE.parent / "envs" / "sample_envs.py", tmp_path / "sample_envs.py")
    (tmp_path / "half.py").write_text("def reward(prompt, response, **_):\n    return 0.5\n")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+"}) + "\n" for a in range(4)))
    (tmp_path / "f.flow").write_text(FLOW)
    res = flowrl.run(flowrl.load(str(tmp_path / "f.flow")), out_dir=tmp_path / "out")
    for row in res.metrics:
        # Counter pays 1, 2, 3 on its turns: every trajectory returns at least 1, so the sum differs from the parts
        assert row["env/return_mean"] >= 1.0 and row["reward/scores"] == 0.5
        assert row["reward_mean"] == pytest.approx(0.5 + row["env/return_mean"])
    with Progress(2, enabled=True, every=1) as bar:  # not a terminal here: one plain line a step
        bar.update(1, res.metrics[0])
    assert f"reward {0.5 + res.metrics[0]['env/return_mean']:.3f}" in capsys.readouterr().err
    samples = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8
    for s in samples:
        assert s["reward"] == pytest.approx(0.5 + s["env_return"]) and s["rewards"] == {"scores": 0.5}
        assert s["turn_rewards"] == [float(t + 1) for t in range(s["turns"])]  # Counter's rewards, turn by turn
        assert s["env_return"] == sum(s["turn_rewards"]) and s["tool_calls"] >= s["turns"] - 1
