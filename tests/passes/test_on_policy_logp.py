"""on-policy-logp: when it drops the old-log-prob forward, each refusal, idempotence, and equal numbers."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from flowrl.ir.graph import Graph
from flowrl.passes.on_policy_logp import on_policy_logp

from .conftest import PPO_UPDATES, passes, run_steps

UPDATE = "actor.update(rollout, old_logp = old_logp, ref_logp = ref_logp, advantages = adv, kl_coef = 0.05{extra})"
CRITIC = "critic.update(rollout, values = values, returns = adv)"


def body(extra: str = "", before: str = "", after: str = "") -> str:
    return "\n    ".join(x for x in (before, UPDATE.format(extra=extra), CRITIC, after) if x)


def test_drops_the_forward_of_an_on_policy_update(ppo: Callable[..., Graph]) -> None:
    g, notes = on_policy_logp(ppo())
    assert "old_logp" not in [n.id for n in g.nodes]
    update = g.node("actor.update")
    assert update.input("old_logp") is None and update.attrs["old_logp"] == "detached"
    assert update.input("ref_logp") == "ref_logp" and update.input("advantages") == "adv"
    assert notes == ["actor.update: `old_logp` removed: one optimizer step on the rollout, so the old log-probs "
                     "are the update's own, detached (one forward over the rollout saved)"]


SWAPPED_ROLLOUT = """
    other    = actor.generate(prompts, n = 4, max_tokens = 16)
    other_lp = actor.logprobs(other)
    actor.update(rollout, old_logp = other_lp, ref_logp = ref_logp, advantages = adv)
    critic.update(rollout, values = values, returns = adv)"""

REFUSALS = [
    ("epochs", body(", epochs = 2"), "epochs = 2: later optimizer steps need the log-probs from before the first"),
    ("mini-batches", body(", mini_batches = 2"),
     "mini_batches = 2: later optimizer steps need the log-probs from before the first"),
    ("another model", body().replace("old_logp = old_logp", "old_logp = ref_logp"),
     "old_logp is computed by ref, not by actor, the model being trained"),
    ("another rollout", SWAPPED_ROLLOUT, "old_logp scores `other`, but the update trains on `rollout`"),
    ("read elsewhere", body(after="extra = gae(scores, old_logp)"), "`old_logp` is also read by `extra`"),
    ("not a forward", body().replace("old_logp = old_logp", "old_logp = values"),
     "old_logp comes from `values`, a values node, not a logprobs forward"),
]


@pytest.mark.parametrize(("text", "note"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refuses(ppo: Callable[..., Graph], text: str, note: str) -> None:
    g = ppo(body=text)
    out, notes = on_policy_logp(g)
    assert out == g
    assert any(n.endswith(note) for n in notes), notes


def test_nothing_to_do_without_old_logp(ppo: Callable[..., Graph]) -> None:
    g = ppo(body="actor.update(rollout, advantages = adv)\n    " + CRITIC)
    assert on_policy_logp(g) == (g, ["nothing to do: no update reads an old_logp"])


def test_idempotent(ppo: Callable[..., Graph]) -> None:
    once = passes(ppo(), "on-policy-logp")
    twice = passes(once, "on-policy-logp")
    assert twice.nodes == once.nodes
    assert [p.changed for p in twice.passes] == [True, False]


def test_a_run_computes_the_same_numbers_with_and_without_it(ppo: Callable[..., Graph]) -> None:
    g = ppo(n=4, body=PPO_UPDATES)
    off, on = run_steps(passes(g), steps=3), run_steps(passes(g, "on-policy-logp"), steps=3)
    for step, (a, b) in enumerate(zip(off, on, strict=True)):
        tol = 1e-5 if step == 0 else 1e-3  # see conftest.assert_same_numbers: AdamW magnifies 1e-7 roundings
        assert set(a.values) - set(b.values) == {"old_logp"}
        for node, batch in b.values.items():
            for key, t in batch.tensors.items():
                assert (t.float() - a.values[node].tensors[key].float()).abs().max() <= tol, (node, key)
        for k in ("reward_mean", "kl_mean", "loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy",
                  "actor/grad_norm", "critic/vf_loss"):
            assert abs(a.metrics[k] - b.metrics[k]) <= tol, k
        assert b.metrics["actor/clipfrac"] == 0.0 and b.metrics["actor/pg_ratio_mean"] == 1.0
