"""Preference updates in the language (issue 27): `loss = "sft" | "dpo"` on a policy, `"bradley_terry"` on a
reward model, over data nodes; the checks `flowrl check` makes on them (rendered in full), a reward model made
trainable by its update, the held-out column, and the templates `sft`, `reward_model`, `dpo`."""

from __future__ import annotations

from collections.abc import Callable
from textwrap import dedent

import pytest

from flowrl.algos.preference import DPO_KINDS as ALGO_DPO_KINDS
from flowrl.ir.graph import Graph
from flowrl.ir.signatures import DPO_KINDS

DATA = "../../../examples/data"
HEAD = f"""\
model actor : policy {{ source = "tiny:gpt2" }}
model ref : reference {{ source = actor }}
model rm : reward_model {{ source = actor }}
data pairs = jsonl("{DATA}/sum_pairs.jsonl") {{ held_out = "held_out" }}
data prompts = jsonl("data/arith.jsonl")
"""


def step(*lines: str) -> str:
    return HEAD + "step {\n" + "".join(f"    {line}\n" for line in lines) + "}\n"


def expect(text: str) -> str:
    return dedent(text).strip("\n")


def test_dpo_kinds_agree_with_the_loss() -> None:
    assert DPO_KINDS == ALGO_DPO_KINDS


def test_the_preference_updates_compile(compile_ok: Callable[..., Graph]) -> None:
    g = compile_ok(step("rm.update(pairs, loss = \"bradley_terry\", margin = 0.5)",
                        "ref_logp = ref.logprobs(pairs)",
                        "actor.update(pairs, loss = \"dpo\", ref_logp = ref_logp, beta = 0.2, dpo = \"ipo\")"))
    dpo = g.node("actor.update")
    assert dpo.inputs == (("rollout", "pairs"), ("ref_logp", "ref_logp"))
    assert (dpo.attrs["loss"], dpo.attrs["beta"], dpo.attrs["dpo"]) == ("dpo", 0.2, "ipo")
    assert "clip" not in dpo.attrs and "kl_coef" not in dpo.attrs  # ppo_clip's keys are left out
    assert g.node("rm.update").attrs["margin"] == 0.5
    assert g.model("rm").trainable  # updated by the step: it gets an optimizer
    assert not g.model("ref").trainable


def test_a_reward_model_not_updated_stays_frozen(compile_ok: Callable[..., Graph]) -> None:
    g = compile_ok(step("ref_logp = ref.logprobs(pairs)",
                        "actor.update(pairs, loss = \"dpo\", ref_logp = ref_logp)"))
    assert not g.model("rm").trainable


def test_simpo_needs_no_reference(compile_ok: Callable[..., Graph]) -> None:
    g = compile_ok(step("actor.update(pairs, loss = \"dpo\", dpo = \"simpo\", gamma = 1.0)"))
    assert g.node("actor.update").attrs["gamma"] == 1.0


ERRORS = [
    (step("actor.update(pairs, loss = \"dpo\")"), """
        t.flow:7:5: error: missing argument `ref_logp` of `actor.update`: loss "dpo" compares the policy with its reference
                actor.update(pairs, loss = "dpo")
                ^^^^^
        hint: add `ref_logp = NAME` with `NAME = REF.logprobs(pairs)`, or write dpo = "simpo" (no reference)
    """),
    (step("rollout = actor.generate(prompts)", "rm.update(rollout, loss = \"bradley_terry\")"), """
        t.flow:8:15: error: loss "bradley_terry" trains on a data node of rows, but `rollout` is computed in the step
                rm.update(rollout, loss = "bradley_terry")
                          ^^^^^^^
        hint: pass a `data` declaration: rows of prompt/chosen/rejected (dpo, bradley_terry) or prompt/response (sft)
    """),
    (step("actor.update(pairs, advantages = pairs)"), """
        t.flow:7:18: error: loss "ppo_clip" trains on a rollout, but `pairs` is a data node
                actor.update(pairs, advantages = pairs)
                             ^^^^^
        hint: generate one first: `rollout = MODEL.generate(pairs, ...)`; to train on its rows write loss = "sft" (demonstrations) or "dpo" (preference pairs)
    """),
    (step("rollout = actor.generate(prompts)", "actor.update(rollout, beta = 0.1, advantages = rollout)"), """
        t.flow:8:27: error: argument `beta` is not used by loss "ppo_clip"
                actor.update(rollout, beta = 0.1, advantages = rollout)
                                      ^^^^
        hint: remove `beta = ...`; it belongs to loss "dpo"
    """),
    (step("lp = ref.logprobs(pairs)", "actor.update(pairs, loss = \"sft\", advantages = lp)"), """
        t.flow:8:39: error: argument `advantages` is not used by loss "sft"
                actor.update(pairs, loss = "sft", advantages = lp)
                                                  ^^^^^^^^^^
        hint: remove `advantages = ...`; it belongs to loss "ppo_clip"
    """),
    (step("rm.update(pairs, loss = \"dpo\")"), """
        t.flow:7:29: error: argument `loss` of `rm.update` must be one of "bradley_terry", got the string "dpo"
                rm.update(pairs, loss = "dpo")
                                        ^^^^^
    """),
    (HEAD.replace('held_out = "held_out"', 'held_out = "heldout"') + "step {\n    rm.update(pairs)\n}\n", """
        t.flow:4:75: error: row 1 has no column `heldout` (the data's `held_out` column)
            data pairs = jsonl("../../../examples/data/sum_pairs.jsonl") { held_out = "heldout" }
                                                                                      ^^^^^^^^^
        hint: held_out names a bool column of the data
    """),
    (HEAD.replace("model rm : reward_model { source = actor }",
                  "model rm : reward_model { source = actor, trainable = false }") + "step {\n    rm.update(pairs)\n}\n", """
        t.flow:7:8: error: model `rm` is not trainable
                rm.update(pairs)
                   ^^^^^^
        hint: set `trainable = true` in the declaration of `rm`
    """),
]


@pytest.mark.parametrize("text, expected", ERRORS)
def test_check_rejects_it_located(compile_error: Callable[..., str], text: str, expected: str) -> None:
    assert compile_error(text) == expect(expected)
