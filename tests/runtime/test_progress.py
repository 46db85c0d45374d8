"""The progress line's headline metric: the reward where a step scored rollouts, else a preference update's training
accuracy or loss (an SFT stage printed `reward 0.000` every step before); the same on every step of a stage, the
held-out score beside it (it switched the headline to `eval_acc` on the steps that evaluated)."""

from __future__ import annotations

import pytest

from flowrl.runtime.progress import Progress, details, headline, held_out, rate, summary


def test_headline_prefers_the_reward_then_training_accuracy_then_loss() -> None:
    assert headline({"reward_mean": 0.5, "rm/eval_accuracy": 0.9}) == ("reward", 0.5)
    assert headline({"rm/rm_loss": 0.4, "rm/rm_accuracy": 0.7, "rm/eval_accuracy": 0.9}) == ("acc", 0.7)
    assert headline({"rm/rm_loss": 0.4, "rm/rm_accuracy": 0.7}) == ("acc", 0.7)
    assert headline({"actor/rewards/accuracies": 0.6, "actor/dpo_loss": 0.5}) == ("acc", 0.6)
    assert headline({"actor/eval/rewards/accuracies": 0.9, "actor/rewards/accuracies": 0.6}) == ("acc", 0.6)
    assert headline({"actor/sft_loss": 1.25, "loss": 1.25, "step_time_s": 0.1}) == ("sft_loss", 1.25)
    assert headline({"actor/eval/sft_loss": 0.5, "actor/sft_loss": 1.25}) == ("sft_loss", 1.25)
    assert headline({"step_time_s": 0.1}) == ("reward", 0.0)


def test_beside_the_headline_a_preference_step_shows_its_loss_held_out_score_and_rows_per_second() -> None:
    dpo = {"actor/rewards/accuracies": 0.6, "actor/dpo_loss": 0.5, "actor/eval/rewards/accuracies": 0.75,
           "actor/eval/loss": 0.4, "data_rows": 8.0, "step_time_s": 0.5, "tokens_per_s": 0.0}
    assert details(dpo) == {"loss": 0.5} and held_out(dpo) == {"eval_acc": 0.75}
    assert rate(dpo) == "16 rows/s"
    assert held_out({"rm/eval_accuracy": 0.9}) == {"eval_acc": 0.9}
    assert held_out({"actor/eval/sft_loss": 0.3}) == {"eval_loss": 0.3} and details({"actor/sft_loss": 1.0}) == {}
    assert rate({"gen_tokens": 100.0, "tokens_per_s": 812.4, "data_rows": 16.0}) == "812 tok/s"


def test_the_latest_held_out_score_stays_on_the_line() -> None:
    bar = Progress(3, enabled=False)
    rows = [{"rm/rm_accuracy": 0.5, "rm/rm_loss": 0.7, "data_rows": 4.0, "step_time_s": 0.5},
            {"rm/rm_accuracy": 0.75, "rm/rm_loss": 0.6, "rm/eval_accuracy": 0.625, "data_rows": 4.0, "step_time_s": 1.0},
            {"rm/rm_accuracy": 1.0, "rm/rm_loss": 0.5, "data_rows": 4.0, "step_time_s": 0.25}]
    assert [bar.line(i, r) for i, r in enumerate(rows, 1)] == [
        "step 1/3  acc 0.500  loss 0.700  8 rows/s  0.50 s/step",
        "step 2/3  acc 0.750  loss 0.600  eval_acc 0.625  4 rows/s  1.00 s/step",
        "step 3/3  acc 1.000  loss 0.500  eval_acc 0.625  16 rows/s  0.25 s/step",
    ]
    rl = Progress(1, enabled=False).line(1, {"reward_mean": 0.25, "gen_tokens": 10.0, "tokens_per_s": 20.0,
                                            "step_time_s": 0.5})
    assert rl == "step 1/1  reward 0.250  20 tok/s  0.50 s/step"  # an RL step's line as before


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
        "step 1/2  reward 0.500  eval held 0.250  10 tok/s  0.50 s/step",
        "step 2/2  reward 0.700  eval held 0.750  10 tok/s  0.50 s/step"]
    assert summary(rows) == "last-2 reward 0.600"  # the step-0 row is no training step
