"""`--set KEY=VALUE` overrides: `MODEL.KEY`, `DATA.KEY`, `REWARD.KEY`, `run.KEY`, `use.PARAM`, applied before checking."""

from __future__ import annotations

from collections.abc import Callable
from textwrap import dedent

from flowrl.ir.graph import Graph, Range

Compile = Callable[..., Graph]
Check = Callable[..., str]

FLOW = """\
model actor : policy { source = "tiny:gpt2", lr = 1e-5 }
model ref : reference { source = actor }
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("data/arith.jsonl") { batch = 4 }
use grpo(reward = correct, group = 8)
run { steps = 200 }
"""


def test_overrides_replace_and_add(compile_ok: Compile) -> None:
    g = compile_ok(FLOW, {
        "actor.lr": "1e-4", "actor.layers": "4", "actor.replicas": "2..8", "actor.engine": '"vllm"',
        "prompts.batch": "16", "prompts.shuffle": "false", "run.steps": "5", "run.seed": "7",
        "use.group": "4", "use.max_tokens": "8",
    })
    actor = g.model("actor")
    assert (actor.lr, actor.config["layers"], actor.replicas, actor.engine) == (1e-4, 4, Range(2, 8), "vllm")
    assert g.model("ref").config["layers"] == 4  # derived models follow
    assert (g.data[0].options["batch"], g.data[0].options["shuffle"]) == (16, False)
    assert (g.run["steps"], g.run["seed"]) == (5, 7)
    assert (g.node("rollout").attrs["n"], g.node("rollout").attrs["max_tokens"]) == (4, 8)
    assert g.node("adv").attrs["group"] == 4


def test_run_override_without_a_run_block(compile_ok: Compile) -> None:
    g = compile_ok(FLOW.replace("run { steps = 200 }\n", ""), {"run.steps": "3", "actor.replicas": "auto"})
    assert g.run["steps"] == 3 and g.model("actor").replicas == "auto"


def test_no_overrides_is_the_flow(compile_ok: Compile) -> None:
    assert compile_ok(FLOW, {}) == compile_ok(FLOW)


def test_override_errors(compile_error: Check) -> None:
    rendered = compile_error(FLOW, {
        "critic.lr": "1e-4", "steps": "3", "run.steps": "abc", "actor.lrr": "1", "use.gruop": "4",
        "actor.lr": "1e-", "prompts.batch": '"8"', "run.seed": "@",
    })
    assert rendered == dedent("""\
        <overrides>:1:1: error: override `critic.lr`: no model, data, reward or env named `critic`
            critic.lr=1e-4
            ^^^^^^
        hint: models: actor, ref; data: prompts; rewards: correct; envs: none; or `run`, `use`
        <overrides>:2:1: error: override `steps` must be MODEL.KEY, DATA.KEY, REWARD.KEY, ENV.KEY, run.KEY or use.PARAM
            steps=3
            ^^^^^
        <overrides>:3:11: error: `steps` must be an integer, got the name `abc`
            run.steps=abc
                      ^^^
        <overrides>:4:7: error: unknown model key `lrr`
            actor.lrr=1
                  ^^^
        hint: did you mean `lr`?
        <overrides>:5:5: error: unknown argument `gruop` for template `grpo`
            use.gruop=4
                ^^^^^
        hint: did you mean `group`?
        <overrides>:6:11: error: syntax error: unexpected `e`, expected end of file
            actor.lr=1e-
                      ^
        <overrides>:7:15: error: `batch` must be an integer, got the string "8"
            prompts.batch="8"
                          ^^^
        hint: write `batch = 8`
        <overrides>:8:10: error: syntax error: unknown character '@'
            run.seed=@
                     ^""")


def test_use_override_needs_a_use(compile_error: Check) -> None:
    text = FLOW.replace("use grpo(reward = correct, group = 8)", "step { }")
    assert compile_error(text, {"use.group": "4"}) == dedent("""\
        <overrides>:1:1: error: override `use.group`: this flow has no `use`
            use.group=4
            ^^^^^^^^^
        hint: `use.PARAM` overrides a template argument""")


def test_flow_errors_and_override_errors_together(compile_error: Check) -> None:
    rendered = compile_error(FLOW.replace("lr = 1e-5", "lr = true"), {"run.steps": '"x"'})
    assert rendered.splitlines()[0] == "t.flow:1:51: error: `lr` must be a number, got `true`"
    assert rendered.splitlines()[3] == '<overrides>:1:11: error: `steps` must be an integer, got the string "x"'
