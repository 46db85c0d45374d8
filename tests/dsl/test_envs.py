"""`env` and `tool` declarations and `generate(..., env = NAME)`: parsing, lowering (the EnvSpec a generate node
carries), the templates' `env`, every check with its full rendered message, and the graph views. The
environments are real ones (tests/dsl/flows/dsl_envs.py, next to the flows these tests compile)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from textwrap import dedent

import pytest

from flowrl.compiler import optimize
from flowrl.dsl import ast
from flowrl.dsl.parser import parse
from flowrl.envs import ON_ERROR, EnvSpec
from flowrl.ir.graph import Graph
from flowrl.ir.printer import to_json, to_text
from flowrl.ir.signatures import ENV_KEYS, ENV_ON_ERROR, TOOL_KEYS
from flowrl.runtime.env_rollout import env_spec_of

Compile = Callable[..., Graph]
Error = Callable[..., str]
FLOWS = Path(__file__).parent / "flows"

MODELS = """\
model actor : policy { source = "tiny:gpt2", charset = "0123456789+=<>/c", context = 64 }
model ref : reference { source = actor }
data prompts = jsonl("data/arith.jsonl") { batch = 4 }
"""
ENV = 'env count = "dsl_envs.Countdown" { max_turns = 3, stop = ["=", "+"], workers = 0, timeout = 5 }\n'
TOOL = 'tool add = "dsl_envs.add" { call = "<c>", end = "</c>", max_turns = 2 }\n'


def expect(text: str) -> str:
    return dedent(text).strip("\n")


def test_env_and_tool_declarations_parse() -> None:
    module = parse(ENV + TOOL, "t.flow")
    env, tool = module.decls
    assert isinstance(env, ast.EnvDecl) and isinstance(tool, ast.EnvDecl)
    assert (env.kind.name, env.name.name, env.target.value) == ("env", "count", "dsl_envs.Countdown")
    assert [e.key.name for e in env.entries] == ["max_turns", "stop", "workers", "timeout"]
    assert (tool.kind.name, tool.name.name, tool.line) == ("tool", "add", 2)


def test_env_and_tool_stay_usable_as_names_elsewhere(compile_ok: Compile) -> None:
    """The keywords are contextual: a model, a bound name and a template parameter may be called env or tool."""
    g = compile_ok(dedent("""\
        model env : policy { source = "tiny:gpt2" }
        data tool = jsonl("data/arith.jsonl") { batch = 4 }
        reward correct = "flowrl.rewards.arith_exact"
        step {
            env_out = env.generate(tool, n = 2, max_tokens = 4)
            scores = correct(env_out)
            adv = group_advantage(scores, group = 2)
            env.update(env_out, advantages = adv)
        }
    """))
    assert g.node("env_out").model == "env" and "env" not in g.node("env_out").attrs


def test_a_generate_carries_its_envs_spec(compile_ok: Compile) -> None:
    g = compile_ok(MODELS + 'import "dsl_envs"\n' + ENV + "use grpo(group = 2, max_tokens = 4, env = count)\n")
    gen = g.node("rollout")
    spec = env_spec_of(gen.attrs)
    assert spec == EnvSpec(name="count", target="dsl_envs.Countdown", kind="env", max_turns=3, stop=("=", "+"),
                           workers=0, timeout=5.0, on_error="observe", call="", imports=("dsl_envs",),
                           folder=str(FLOWS), overlap=True, options={})
    assert gen.attrs["max_total"] == 0 and gen.attrs["env_at"] == "t.flow:5:1"
    assert to_json(g)["nodes"][1]["attrs"]["env"]["stop"] == ["=", "+"]  # the whole spec in the JSON view
    line = next(ln for ln in to_text(g).splitlines() if ln.startswith("  rollout ="))
    assert "{env=count (env, max_turns=3), max_tokens=4, min_tokens=0, n=2" in line


def test_a_tool_is_an_env_whose_end_marker_stops_turns(compile_ok: Compile) -> None:
    g = compile_ok(MODELS + TOOL + 'reward correct = "flowrl.rewards.arith_exact"\n'
                   "use grpo(group = 2, max_tokens = 4, env = add)\n")
    spec = env_spec_of(g.node("rollout").attrs)
    assert spec is not None
    assert (spec.kind, spec.call, spec.stop, spec.workers, spec.on_error) == ("tool", "<c>", ("</c>",), 2, "observe")


def test_an_envs_other_keys_are_its_class_options(compile_ok: Compile) -> None:
    g = compile_ok(MODELS + 'env count = "dsl_envs.Countdown" { max_turns = 2, turns = 5 }\n'
                   "use grpo(group = 2, max_tokens = 4, env = count)\n")
    spec = env_spec_of(g.node("rollout").attrs)
    assert spec is not None and dict(spec.options) == {"turns": 5}


def test_env_in_a_step_and_max_total(compile_ok: Compile) -> None:
    g = compile_ok(MODELS + 'env count = "dsl_envs.Countdown" { max_turns = 8, stop = "=", max_total = 40 }\n'
                   "step {\n    rollout = actor.generate(prompts, n = 2, max_tokens = 8, env = count)\n"
                   "    scores = reward(rollout)\n    adv = group_advantage(scores, group = 2)\n"
                   "    actor.update(rollout, advantages = adv)\n}\n")
    gen = g.node("rollout")
    assert gen.attrs["max_total"] == 40 and gen.attrs["env"]["max_turns"] == 8
    # no reward declared: `reward` is the environment's alone (zero scores; the advantage adds env_return)
    assert [(r.name, r.target) for r in g.rewards] == [("reward", "zero")]


@pytest.mark.parametrize("template", ["grpo", "ppo", "rloo", "reinforce_pp"])
def test_every_template_takes_an_env_and_needs_no_reward(compile_ok: Compile, template: str) -> None:
    critic = "model critic : critic { source = actor }\n" if template == "ppo" else ""
    g = compile_ok(MODELS + critic + ENV + f"use {template}(max_tokens = 4, env = count)\n")
    gen = g.node("rollout")
    assert gen.attrs["env"]["name"] == "count"
    assert g.node("scores").attrs["fn"] == "zero"


def test_a_template_without_env_generates_as_before(compile_ok: Compile) -> None:
    g = compile_ok(MODELS + 'reward correct = "flowrl.rewards.arith_exact"\n'
                   "use grpo(reward = correct, group = 2, max_tokens = 4)\n")
    assert set(g.node("rollout").attrs) == {"n", "max_tokens", "min_tokens", "temperature", "top_p"}
    assert [r.target for r in g.rewards] == ["flowrl.rewards.arith_exact"]


def test_the_keys_match_the_envs_contract() -> None:
    """What the language accepts is what flowrl.envs runs: the same on_error choices, and every key but
    max_total (the engine's cap) and the tool's `end` (its stop text) is an EnvSpec field."""
    assert ENV_ON_ERROR == ON_ERROR
    spec_fields = {f.name for f in fields(EnvSpec)}
    assert set(ENV_KEYS) - {"max_total"} <= spec_fields
    assert set(TOOL_KEYS) - {"max_total", "end"} <= spec_fields


def test_fuse_gen_inference_streams_an_env_generate(compile_ok: Compile) -> None:
    """Its forwards run while every live trajectory waits on its environment (colocated ones too)."""
    out = optimize(compile_ok(MODELS + ENV + "use grpo(group = 2, max_tokens = 4, env = count)\n"))
    rec = next(p for p in out.passes if p.name == "fuse-gen-inference")
    assert rec.changed
    assert list(rec.notes) == ["rollout: hands out finished trajectories whenever every live one waits on its environment "
                         "(count), and at the end; ref_logp on worker group colocated run on them during those waits"]


def test_viz_draws_the_environment_loop(compile_ok: Compile) -> None:
    from flowrl.viz import views

    g = compile_ok(MODELS + ENV + "use grpo(group = 2, max_tokens = 4, env = count)\n")
    source = views.draw(g, "parsed").source
    assert 'rollout -> rollout [label="env count (env, max_turns=3)"' in source


# ---- checks: each with its full rendered message -------------------------------------------------------


def test_an_unknown_env_name_in_a_step(compile_error: Error) -> None:
    text = MODELS + ENV + ("step {\n    rollout = actor.generate(prompts, n = 2, max_tokens = 4, env = cuont)\n"
                           "    scores = reward(rollout)\n}\n")
    assert compile_error(text) == expect("""
        t.flow:6:68: error: unknown name `cuont`
                rollout = actor.generate(prompts, n = 2, max_tokens = 4, env = cuont)
                                                                               ^^^^^
        hint: did you mean `count`?
    """)


def test_an_unknown_env_name_as_a_string(compile_error: Error) -> None:
    text = MODELS + ENV + ('step {\n    rollout = actor.generate(prompts, n = 2, max_tokens = 4, env = "cout")\n'
                           "    scores = reward(rollout)\n}\n")
    assert compile_error(text) == expect("""
        t.flow:6:68: error: `env` names `cout`, which is not a declared env or tool
                rollout = actor.generate(prompts, n = 2, max_tokens = 4, env = "cout")
                                                                               ^^^^^^
        hint: did you mean `count`?
    """)


def test_a_misspelt_key_is_not_an_option(compile_error: Error) -> None:
    text = MODELS + 'env count = "dsl_envs.Countdown" { max_turn = 3 }\n' + "use grpo(max_tokens = 4, env = count)\n"
    assert compile_error(text) == expect("""
        t.flow:4:36: error: unknown env key `max_turn`
            env count = "dsl_envs.Countdown" { max_turn = 3 }
                                               ^^^^^^^^
        hint: did you mean `max_turns`?
    """)


def test_a_stop_that_is_not_text(compile_error: Error) -> None:
    text = MODELS + 'env count = "dsl_envs.Countdown" { stop = 3 }\n' + "use grpo(max_tokens = 4, env = count)\n"
    assert compile_error(text) == expect("""
        t.flow:4:43: error: `stop` must be a string or a list of strings
            env count = "dsl_envs.Countdown" { stop = 3 }
                                                      ^
        hint: for example `stop = "</answer>"` or `stop = ["\\n", "."]`
    """)


def test_a_tool_without_its_call_marker(compile_error: Error) -> None:
    text = MODELS + 'tool add = "dsl_envs.add" { end = "</c>" }\n' + "use grpo(max_tokens = 4, env = add)\n"
    assert compile_error(text) == expect("""
        t.flow:4:6: error: tool `add` has no `call` marker
            tool add = "dsl_envs.add" { end = "</c>" }
                 ^^^
        hint: a tool's arguments are written between its markers: add `call = "<calc>", end = "</calc>"`
    """)


def test_a_class_that_is_not_an_env(compile_error: Error) -> None:
    text = MODELS + 'env game = "dsl_envs.NoStep"\n' + "use grpo(max_tokens = 4, env = game)\n"
    assert compile_error(text) == expect("""
        t.flow:4:12: error: NoStep has no method step(self, action) -> (observation, reward, done)
            env game = "dsl_envs.NoStep"
                       ^^^^^^^^^^^^^^^^^
        hint: plain `def` or `async def`, one per trajectory's instance: reset gets the data row, step each turn's action text
    """)


def test_a_module_that_does_not_import(compile_error: Error) -> None:
    rendered = compile_error(MODELS + 'env game = "no_such_envs.Game"\n' + "use grpo(max_tokens = 4, env = game)\n")
    first, line, caret = rendered.splitlines()[:3]
    assert first.startswith("t.flow:4:12: error: env 'game': ") and "no_such_envs" in first
    assert caret == "               " + "^" * len('"no_such_envs.Game"')


def test_a_key_neither_of_the_block_nor_of_the_class(compile_error: Error) -> None:
    text = MODELS + 'env game = "dsl_envs.Countdown" { level = 2 }\n' + "use grpo(max_tokens = 4, env = game)\n"
    assert compile_error(text) == expect("""
        t.flow:4:35: error: unknown env key `level`
            env game = "dsl_envs.Countdown" { level = 2 }
                                              ^^^^^
        hint: env keys: max_turns, stop, workers, timeout, on_error, overlap, max_total, decode_batch; Countdown takes turns
    """)


def test_a_tool_takes_no_other_key(compile_error: Error) -> None:
    text = MODELS + 'tool add = "dsl_envs.add" { call = "<", end = ">", level = 2 }\n' + \
        "use grpo(max_tokens = 4, env = add)\n"
    assert compile_error(text) == expect("""
        t.flow:4:52: error: unknown tool key `level`
            tool add = "dsl_envs.add" { call = "<", end = ">", level = 2 }
                                                               ^^^^^
        hint: tool keys: call, end, max_turns, workers, timeout, on_error, overlap, max_total, decode_batch
    """)


def test_a_marker_outside_the_charset(compile_error: Error) -> None:
    text = MODELS + 'tool add = "dsl_envs.add" { call = "<calc>", end = "</c>" }\n' + \
        "use grpo(max_tokens = 4, env = add)\n"
    assert compile_error(text) == expect("""
        t.flow:4:36: error: the marker "<calc>" uses "al", which is not in the charset of model `actor`
            tool add = "dsl_envs.add" { call = "<calc>", end = "</c>" }
                                               ^^^^^^^^
        hint: the model could never write it (each missing character is <unk>): add them to `charset`, or use characters it has
    """)


def test_turns_times_tokens_past_the_positions(compile_error: Error) -> None:
    text = MODELS + 'env count = "dsl_envs.Countdown" { max_turns = 8 }\n' + "use grpo(max_tokens = 16, env = count)\n"
    assert compile_error(text) == expect("""
        t.flow:5:23: error: `max_tokens = 16` per turn x `max_turns = 8` of `count` and the longest prompt of `prompts` (5 tokens) need 133 positions; model `actor` has 64
            use grpo(max_tokens = 16, env = count)
                                  ^^
        hint: set `max_total = 59` in `count` (a trajectory's response tokens), lower `max_tokens` to 7, or give `actor` more positions
    """)


def test_max_total_past_the_positions(compile_error: Error) -> None:
    text = MODELS + 'env count = "dsl_envs.Countdown" { max_turns = 8, max_total = 60 }\n' + \
        "use grpo(max_tokens = 16, env = count)\n"
    assert compile_error(text) == expect("""
        t.flow:4:63: error: `max_total = 60` and the longest prompt of `prompts` (5 tokens) need 65 positions; model `actor` has 64
            env count = "dsl_envs.Countdown" { max_turns = 8, max_total = 60 }
                                                                          ^^
        hint: `max_total` can be at most 59 here
    """)


def test_max_total_lets_many_turns_fit(compile_ok: Compile) -> None:
    g = compile_ok(MODELS + 'env count = "dsl_envs.Countdown" { max_turns = 8, max_total = 59 }\n'
                   "use grpo(max_tokens = 16, env = count)\n")
    assert g.node("rollout").attrs["max_total"] == 59


def test_an_env_shares_the_declarations_names(compile_error: Error) -> None:
    text = MODELS + 'env prompts = "dsl_envs.Countdown"\n' + "use grpo(max_tokens = 4)\n"
    assert compile_error(text) == expect("""
        t.flow:4:5: error: duplicate name `prompts`: it is already declared as data
            env prompts = "dsl_envs.Countdown"
                ^^^^^^^
        hint: `prompts` is first declared on line 3; names must be unique
    """)


def test_an_unused_env_is_a_warning(compile_ok: Compile) -> None:
    g = compile_ok(MODELS + ENV + 'reward correct = "flowrl.rewards.arith_exact"\n'
                   "use grpo(reward = correct, max_tokens = 4)\n")
    assert [w.render() for w in g.warnings] == [expect("""
        t.flow:4:5: warning: env `count` is declared but no `generate` uses it
            env count = "dsl_envs.Countdown" { max_turns = 3, stop = ["=", "+"], workers = 0, timeout = 5 }
                ^^^^^
        hint: pass it to one: `actor.generate(prompts, env = count)` or `use grpo(..., env = count)`
    """)]


# the generating model's own engine counts, not its source's: in "source", `actor` copies `base` (torch) but runs
# vLLM, whose worker would otherwise run the turns on the torch engine without a word
VLLM_MODELS = {
    "own": MODELS.replace('context = 64 }', 'context = 64, engine = "vllm" }'),
    "source": MODELS.replace("model actor :", "model base :").replace("source = actor", "source = base")
    .replace("model ref :", 'model actor : policy { source = base, engine = "vllm" }\nmodel ref :'),
}


@pytest.mark.parametrize("models, line", [("own", 4), ("source", 5)])
def test_an_env_needs_the_torch_engine(compile_error: Error, models: str, line: int) -> None:
    rendered = compile_error(VLLM_MODELS[models] + ENV + "use grpo(max_tokens = 4, env = count)\n")
    assert expect(f"""
        t.flow:{line}:5: error: `count` needs the torch engine, but model `actor` uses engine = "vllm"
            env count = "dsl_envs.Countdown" {{ max_turns = 3, stop = ["=", "+"], workers = 0, timeout = 5 }}
                ^^^^^
        hint: multi-turn generation runs on the torch engine only, for now: drop `engine` from the model
    """) in rendered


def test_a_declared_reward_left_out_of_an_env_flow_is_a_warning(compile_ok: Compile) -> None:
    g = compile_ok(MODELS + ENV + 'reward correct = "flowrl.rewards.arith_exact"\n'
                   "use grpo(max_tokens = 4, env = count)\n")
    assert g.node("scores").attrs["fn"] == "zero"
    assert [w.render() for w in g.warnings] == [expect("""
        t.flow:5:8: warning: reward `correct` is not used: the scores are the environment's alone
            reward correct = "flowrl.rewards.arith_exact"
                   ^^^^^^^
        hint: to grade trajectories with it, pass it: `reward = correct`
    """)]
