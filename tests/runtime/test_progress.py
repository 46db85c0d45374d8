"""The progress line's headline metric: the reward where a step scored rollouts, else a preference update's held-out
accuracy, accuracy or loss (an SFT stage printed `reward 0.000` every step before)."""

from __future__ import annotations

from flowrl.runtime.progress import headline, summary


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
