"""The progress line's headline metric: the reward where a step scored rollouts, else a preference update's held-out
accuracy, accuracy or loss (an SFT stage printed `reward 0.000` every step before)."""

from __future__ import annotations

import pytest

from flowrl.runtime.progress import Progress, headline, summary


def test_headline_prefers_the_reward_then_held_out_accuracy_then_loss() -> None:
    assert headline({"reward_mean": 0.5, "rm/eval_accuracy": 0.9}) == ("reward", 0.5)
    assert headline({"rm/rm_loss": 0.4, "rm/rm_accuracy": 0.7, "rm/eval_accuracy": 0.9}) == ("eval_acc", 0.9)
    assert headline({"rm/rm_loss": 0.4, "rm/rm_accuracy": 0.7}) == ("acc", 0.7)
    assert headline({"actor/rewards/accuracies": 0.6, "actor/dpo_loss": 0.5}) == ("acc", 0.6)
    assert headline({"actor/sft_loss": 1.25, "loss": 1.25, "step_time_s": 0.1}) == ("sft_loss", 1.25)
    assert headline({"step_time_s": 0.1}) == ("reward", 0.0)


def test_summary_is_the_mean_of_the_last_five() -> None:
    rows = [{"actor/sft_loss": float(v)} for v in range(10)]
    assert summary(rows) == "last-5 sft_loss 7.000"
    assert summary([{"reward_mean": 0.25}, {"reward_mean": 0.75}]) == "last-2 reward 0.500"
    assert summary([]) == "no steps"


def test_the_line_shows_the_latest_evaluation_and_a_step_0_evaluation_is_no_step(
        capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"step": 0, "eval/held/mean@4": 0.25, "eval/held/pass@4": 0.5, "time/eval/held": 0.1},
            {"step": 1, "reward_mean": 0.5, "tokens_per_s": 10.0, "step_time_s": 0.5},
            {"step": 2, "reward_mean": 0.7, "tokens_per_s": 10.0, "step_time_s": 0.5, "eval/held/low/mean@4": 0.1,
             "eval/held/mean@4": 0.75}]
    with Progress(2, every=1) as bar:
        for r in rows:
            bar.update(int(r["step"]), r)
    assert capsys.readouterr().err.splitlines() == [
        "step 0/2  eval held 0.250",
        "step 1/2  reward 0.500  10 tok/s  0.50 s/step  eval held 0.250",
        "step 2/2  reward 0.700  10 tok/s  0.50 s/step  eval held 0.750"]
    assert summary(rows) == "last-2 reward 0.600"  # the step-0 row is no training step
