"""One test per error class of LANGUAGE.md (syntax errors are in test_syntax.py): the full rendered message."""

from __future__ import annotations

from collections.abc import Callable
from textwrap import dedent

import pytest

HEAD = """\
model actor : policy { source = "tiny:gpt2" }
model ref : reference { source = actor }
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("data/arith.jsonl")
"""


def step(*lines: str) -> str:
    """HEAD plus a step whose first statement is on line 6."""
    return HEAD + "step {\n" + "".join(f"    {line}\n" for line in lines) + "}\n"


def expect(text: str) -> str:
    return dedent(text).strip("\n")


Check = Callable[..., str]


UNKNOWN_NAME = [
    (step("rollout = actor.generate(prompts)", "lp = actor.logprobs(rolout)"), """
        t.flow:7:25: error: unknown name `rolout`
                lp = actor.logprobs(rolout)
                                    ^^^^^^
        hint: did you mean `rollout`?
    """),
    (step("rollout = actor.generate(prompts)", "s = grup_advantage(rollout, group = 2)"), """
        t.flow:7:9: error: unknown name `grup_advantage`
                s = grup_advantage(rollout, group = 2)
                    ^^^^^^^^^^^^^^
        hint: did you mean `group_advantage`?
    """),
    (step("rollout = actr.generate(prompts)"), """
        t.flow:6:15: error: unknown name `actr`
                rollout = actr.generate(prompts)
                          ^^^^
        hint: did you mean `actor`?
    """),
    (step("rollout = actor.generate(xyzzy)"), """
        t.flow:6:30: error: unknown name `xyzzy`
                rollout = actor.generate(xyzzy)
                                         ^^^^^
    """),
    (step("rollout = actor.generate(prompts, n = groupsize)"), """
        t.flow:6:43: error: unknown name `groupsize`
                rollout = actor.generate(prompts, n = groupsize)
                                                      ^^^^^^^^^
    """),
]


@pytest.mark.parametrize("text, expected", UNKNOWN_NAME)
def test_unknown_name(compile_error: Check, text: str, expected: str) -> None:
    assert compile_error(text) == expect(expected)


REBINDING = [
    (step("rollout = actor.generate(prompts, n = 8)", "rollout = actor.generate(prompts)"), """
        t.flow:7:5: error: `rollout` is bound twice in one step
                rollout = actor.generate(prompts)
                ^^^^^^^
        hint: it is first bound on line 6; each name is bound once (single assignment), so give this one another name
    """),
    (step("prompts = actor.generate(prompts)"), """
        t.flow:6:5: error: cannot bind `prompts`: it is already declared (data)
                prompts = actor.generate(prompts)
                ^^^^^^^
        hint: choose another name
    """),
    (HEAD + "template t(actor: policy, prompts) {\n    actor = actor.generate(prompts)\n}\nuse t()\n", """
        t.flow:6:5: error: cannot bind `actor`: it is a parameter of template `t`
                actor = actor.generate(prompts)
                ^^^^^
        hint: choose another name
    """),
    (step("rollout = actor.generate(prompts)", "adv = group_advantage(rollout, group = 2)",
          "actor.update(rollout, advantages = adv)", "actor.update(rollout, advantages = adv)"), """
        t.flow:9:5: error: `actor.update` appears twice in one step
                actor.update(rollout, advantages = adv)
                ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
        hint: a model is updated once per step (first on line 8)
    """),
]


@pytest.mark.parametrize("text, expected", REBINDING)
def test_rebinding(compile_error: Check, text: str, expected: str) -> None:
    assert compile_error(text) == expect(expected)


CYCLE = [
    (step("a = group_advantage(b, group = 2)", "b = group_advantage(a, group = 2)"), """
        t.flow:6:5: error: cycle: a -> b -> a
                a = group_advantage(b, group = 2)
                ^
        hint: each name must be computed from names computed before it; break the loop
    """),
    (step("x = group_advantage(x, group = 2)"), """
        t.flow:6:5: error: cycle: x -> x
                x = group_advantage(x, group = 2)
                ^
        hint: each name must be computed from names computed before it; break the loop
    """),
    (step("rollout = actor.generate(prompts)", "a = group_advantage(c, group = 2)",
          "b = group_advantage(a, group = 2)", "c = group_advantage(b, group = 2)"), """
        t.flow:7:5: error: cycle: a -> c -> b -> a
                a = group_advantage(c, group = 2)
                ^
        hint: each name must be computed from names computed before it; break the loop
    """),
]


@pytest.mark.parametrize("text, expected", CYCLE)
def test_cycle(compile_error: Check, text: str, expected: str) -> None:
    assert compile_error(text) == expect(expected)


WRONG_METHOD = [
    (step("rollout = actor.generate(prompts)", "adv = group_advantage(rollout, group = 2)",
          "ref.update(rollout, advantages = adv)"), """
        t.flow:8:9: error: model `ref` (reference) has no method `update`
                ref.update(rollout, advantages = adv)
                    ^^^^^^
        hint: a reference model has `logprobs`
    """),
    (HEAD + "model critic : critic { source = actor }\nstep {\n    rollout = critic.generate(prompts)\n}\n", """
        t.flow:7:22: error: model `critic` (critic) has no method `generate`
                rollout = critic.generate(prompts)
                                 ^^^^^^^^
        hint: a critic model has `values` or `update`
    """),
    (HEAD + "model frozen : policy { source = actor, trainable = false }\nstep {\n"
            "    rollout = frozen.generate(prompts)\n    adv = group_advantage(rollout, group = 2)\n"
            "    frozen.update(rollout, advantages = adv)\n}\n", """
        t.flow:9:12: error: model `frozen` is not trainable
                frozen.update(rollout, advantages = adv)
                       ^^^^^^
        hint: set `trainable = true` in the declaration of `frozen`
    """),
    (step("rollout = actor(prompts)"), """
        t.flow:6:15: error: `actor` is a model; call one of its methods
                rollout = actor(prompts)
                          ^^^^^
        hint: for example `actor.generate(...)`
    """),
    (step("actor.logprobs(prompts)"), """
        t.flow:6:5: error: the result of `actor.logprobs(...)` is not bound to a name
                actor.logprobs(prompts)
                ^^^^^
        hint: write `NAME = actor.logprobs(...)`; only `MODEL.update(...)` stands alone
    """),
    (step("rollout = actor.generate(prompts)", "adv = group_advantage(rollout, group = 2)",
          "done = actor.update(rollout, advantages = adv)"), """
        t.flow:8:5: error: `actor.update(...)` is a training step and has no result to bind
                done = actor.update(rollout, advantages = adv)
                ^^^^
        hint: write `actor.update(...)` on its own, without `done =`
    """),
]


@pytest.mark.parametrize("text, expected", WRONG_METHOD)
def test_wrong_role_or_method(compile_error: Check, text: str, expected: str) -> None:
    assert compile_error(text) == expect(expected)


BAD_ARGUMENT = [
    (step("rollout = actor.generate(prompts, n = 8, bogus = 1)"), """
        t.flow:6:46: error: unknown argument `bogus` for `actor.generate`
                rollout = actor.generate(prompts, n = 8, bogus = 1)
                                                         ^^^^^
        hint: `actor.generate` takes `prompts`, `n`, `max_tokens`, `min_tokens`, `temperature`, `top_p` or `env`
    """),
    (step("rollout = actor.generate(prompts, max_tokns = 8)"), """
        t.flow:6:39: error: unknown argument `max_tokns` for `actor.generate`
                rollout = actor.generate(prompts, max_tokns = 8)
                                                  ^^^^^^^^^
        hint: did you mean `max_tokens`?
    """),
    (step("rollout = actor.generate(prompts)", "adv = group_advantage(rollout, group = \"8\")"), """
        t.flow:7:44: error: argument `group` of `group_advantage` must be an integer, got the string "8"
                adv = group_advantage(rollout, group = "8")
                                                       ^^^
        hint: write `group = 8`
    """),
    (HEAD + 'use grpo(reward = correct, group = "8")\n', """
        t.flow:5:36: error: argument `group` of template `grpo` must be an integer, got the string "8"
            use grpo(reward = correct, group = "8")
                                               ^^^
        hint: write `group = 8`
    """),
    (step("rollout = actor.generate(prompts)", "adv = group_advantage(rollout)"), """
        t.flow:7:11: error: missing required argument `group` of `group_advantage`
                adv = group_advantage(rollout)
                      ^^^^^^^^^^^^^^^
        hint: add `group = VALUE`
    """),
    (step("rollout = actor.generate(prompts)", "actor.update(rollout)"), """
        t.flow:7:5: error: missing required argument `advantages` of `actor.update`
                actor.update(rollout)
                ^^^^^
        hint: add `advantages = NAME`
    """),
    (step("rollout = actor.generate(prompts)", "adv = group_advantage(group = 2, rollout)"), """
        t.flow:7:38: error: positional argument after keyword arguments
                adv = group_advantage(group = 2, rollout)
                                                 ^^^^^^^
        hint: write positional arguments first, or name this one: `PARAM = ...`
    """),
    (step("rollout = actor.generate(prompts, prompts)"), """
        t.flow:6:39: error: too many positional arguments for `actor.generate`
                rollout = actor.generate(prompts, prompts)
                                                  ^^^^^^^
        hint: its positional parameters: `prompts`; pass the rest as `NAME = VALUE`
    """),
    (step("rollout = actor.generate(prompts, n = 2, n = 3)"), """
        t.flow:6:46: error: argument `n` of `actor.generate` is given twice
                rollout = actor.generate(prompts, n = 2, n = 3)
                                                         ^^^^^
    """),
    (step("rollout = actor.generate(prompts)", "adv = group_advantage(rollout, group = 2)",
          'actor.update(rollout, advantages = adv, kl = "k5")'), """
        t.flow:8:50: error: argument `kl` of `actor.update` must be one of "k1", "k2", "k3", got the string "k5"
                actor.update(rollout, advantages = adv, kl = "k5")
                                                             ^^^^
    """),
    (step("rollout = actor.generate(correct)"), """
        t.flow:6:30: error: argument `prompts` of `actor.generate` needs a name bound in the step, but `correct` is a reward
                rollout = actor.generate(correct)
                                         ^^^^^^^
        hint: call it first: `scores = correct(rollout)`, then pass `scores`
    """),
    (step("rollout = actor.generate(3)"), """
        t.flow:6:30: error: argument `prompts` of `actor.generate` needs a name bound in the step, got the integer 3
                rollout = actor.generate(3)
                                         ^
    """),
]


@pytest.mark.parametrize("text, expected", BAD_ARGUMENT)
def test_bad_argument(compile_error: Check, text: str, expected: str) -> None:
    assert compile_error(text) == expect(expected)


TEMPLATE = [
    (HEAD + "use ppo(reward = correct)\n", """
        t.flow:5:5: error: template `ppo` needs a critic model `critic`, but none is declared
            use ppo(reward = correct)
                ^^^
        hint: declare `model critic : critic { source = actor }`, or pass one: `use ppo(critic = NAME)`
    """),
    (HEAD + "use gpro(reward = correct)\n", """
        t.flow:5:5: error: unknown template `gpro`
            use gpro(reward = correct)
                ^^^^
        hint: did you mean `grpo`?
    """),
    (HEAD + "use simpo(reward = correct)\n", """
        t.flow:5:5: error: unknown template `simpo`
            use simpo(reward = correct)
                ^^^^^
        hint: `simpo` is a kind of the `dpo` template: write `use dpo(dpo = "simpo")`
    """),
    (HEAD + "use sac(reward = correct)\n", """
        t.flow:5:5: error: unknown template `sac`
            use sac(reward = correct)
                ^^^
        hint: templates: cispo, dapo, dpo, dr_grpo, grpo, gspo, ppo, reinforce_pp, reward_model, rloo, sft
    """),
    (HEAD + "use grpo(reward = correct, ref = actor)\n", """
        t.flow:5:34: error: template `grpo` needs `ref` to be a reference model, but `actor` is a policy model
            use grpo(reward = correct, ref = actor)
                                             ^^^^^
        hint: pass a reference model: `use grpo(ref = NAME)`
    """),
    (HEAD.replace("model ref : reference { source = actor }\n", "") + "use grpo(reward = correct)\n", """
        t.flow:4:5: error: template `grpo` needs a reference model `ref`, but none is declared
            use grpo(reward = correct)
                ^^^^
        hint: declare `model ref : reference { source = actor }`, or pass one: `use grpo(ref = NAME)`
    """),
    (HEAD.replace("data prompts", "data train") + "use grpo(reward = correct)\n", """
        t.flow:5:5: error: template `grpo` needs `prompts`, but nothing named `prompts` is declared
            use grpo(reward = correct)
                ^^^^
        hint: declare `data prompts = jsonl("PATH")`, or pass one: `use grpo(prompts = NAME)`
    """),
    (HEAD + "use grpo()\n", """
        t.flow:5:5: error: template `grpo` needs `reward`, but nothing named `reward` is declared
            use grpo()
                ^^^^
        hint: declare `reward reward = "pkg.module.fn"`, or pass one: `use grpo(reward = NAME)`
    """),
    (HEAD + "use grpo(reward = correct, gruop = 8)\n", """
        t.flow:5:28: error: unknown argument `gruop` for template `grpo`
            use grpo(reward = correct, gruop = 8)
                                       ^^^^^
        hint: did you mean `group`?
    """),
    (HEAD + "use grpo(reward = prompts)\n", """
        t.flow:5:19: error: template `grpo` uses `reward` as a function, but `prompts` is data
            use grpo(reward = prompts)
                              ^^^^^^^
    """),
]


@pytest.mark.parametrize("text, expected", TEMPLATE)
def test_template(compile_error: Check, text: str, expected: str) -> None:
    assert compile_error(text) == expect(expected)


DECLARATION = [
    ('model actor : policy { source = "tiny:gpt2" }\nmodel actor : policy { source = "tiny:gpt2" }\nstep { }\n', """
        t.flow:2:7: error: duplicate model name `actor`
            model actor : policy { source = "tiny:gpt2" }
                  ^^^^^
        hint: `actor` is first declared on line 1; names must be unique
    """),
    ('model actor : policy { source = "tiny:gpt2" }\nreward actor = "flowrl.rewards.arith_exact"\nstep { }\n', """
        t.flow:2:8: error: duplicate name `actor`: it is already declared as model
            reward actor = "flowrl.rewards.arith_exact"
                   ^^^^^
        hint: `actor` is first declared on line 1; names must be unique
    """),
    ('model actor : polcy { source = "tiny:gpt2" }\nstep { }\n', """
        t.flow:1:15: error: unknown role `polcy`
            model actor : polcy { source = "tiny:gpt2" }
                          ^^^^^
        hint: did you mean `policy`?
    """),
    ('model actor : actor { source = "tiny:gpt2" }\nstep { }\n', """
        t.flow:1:15: error: unknown role `actor`
            model actor : actor { source = "tiny:gpt2" }
                          ^^^^^
        hint: roles: policy, reference, critic, reward_model
    """),
    ('model actor : policy { source = "tiny:gpt2" }\nmodel ref : reference { source = actr }\nstep { }\n', """
        t.flow:2:34: error: `source` names `actr`, which is not a declared model
            model ref : reference { source = actr }
                                             ^^^^
        hint: did you mean `actor`?
    """),
    ('model actor : policy { source = "tiny:gpt2", lyers = 2, lr = 1e-4, lr = 2e-4 }\nstep { }\n', """
        t.flow:1:46: error: unknown model key `lyers`
            model actor : policy { source = "tiny:gpt2", lyers = 2, lr = 1e-4, lr = 2e-4 }
                                                         ^^^^^
        hint: did you mean `layers`?
        t.flow:1:68: error: `lr` is set twice
            model actor : policy { source = "tiny:gpt2", lyers = 2, lr = 1e-4, lr = 2e-4 }
                                                                               ^^
        hint: first set on line 1
    """),
    ("model actor : policy { layers = 2 }\nstep { }\n", """
        t.flow:1:7: error: model `actor` has no `source`
            model actor : policy { layers = 2 }
                  ^^^^^
        hint: add `source = "tiny:gpt2"`, `source = "hf:PATH"` or `source = OTHER_MODEL`
    """),
    ('model actor : policy { source = "tiny:gpt2" }\nmodel ref : reference { source = actor, layers = 4 }\nstep { }\n', """
        t.flow:2:41: error: `layers` cannot be set on `ref`: its weights come from `actor`
            model ref : reference { source = actor, layers = 4 }
                                                    ^^^^^^
        hint: set it on `actor` instead
    """),
    ('model actor : policy { source = "tiny:gpt2", engine = "vlm", replicas = 0, trainable = "yes" }\nstep { }\n', """
        t.flow:1:55: error: `engine` must be one of torch, vllm, deepspeed
            model actor : policy { source = "tiny:gpt2", engine = "vlm", replicas = 0, trainable = "yes" }
                                                                  ^^^^^
        hint: did you mean `vllm`?
        t.flow:1:73: error: `replicas` must be a positive integer, `auto` or a range such as 1..8, got the integer 0
            model actor : policy { source = "tiny:gpt2", engine = "vlm", replicas = 0, trainable = "yes" }
                                                                                    ^
        t.flow:1:88: error: `trainable` must be true or false, got the string "yes"
            model actor : policy { source = "tiny:gpt2", engine = "vlm", replicas = 0, trainable = "yes" }
                                                                                                   ^^^^^
    """),
    ("model a : policy { source = b }\nmodel b : policy { source = a }\nstep { }\n", """
        t.flow:1:29: error: source cycle: a -> b -> a
            model a : policy { source = b }
                                        ^
        hint: one model in the chain needs a "tiny:" or "hf:" source
    """),
    ('model actor : policy { source = "tiny:gpt2" }\nstep { }\nplacement {\n    pool train { gpus = 8 }\n'
     "    actor -> trian\n}\n", """
        t.flow:5:14: error: unknown pool `trian`
                actor -> trian
                         ^^^^^
        hint: did you mean `train`?
    """),
]


@pytest.mark.parametrize("text, expected", DECLARATION)
def test_declaration(compile_error: Check, text: str, expected: str) -> None:
    assert compile_error(text) == expect(expected)


PYTHON_REFERENCE = [
    ('reward r = "no.such.module.fn"\nstep { }\n', """
        t.flow:1:12: error: cannot resolve reward "no.such.module.fn": cannot import module 'no.such.module': ModuleNotFoundError: No module named 'no'
            reward r = "no.such.module.fn"
                       ^^^^^^^^^^^^^^^^^^^
        hint: a reward is a dotted path to a Python callable ("pkg.module.fn") or a name registered with @flowrl.reward (add `import "pkg.module"`)
    """),
    ('reward r = "flowrl.rewards.no_such_fn"\nstep { }\n', """
        t.flow:1:12: error: cannot resolve reward "flowrl.rewards.no_such_fn": module 'flowrl.rewards' has no attribute 'no_such_fn'
            reward r = "flowrl.rewards.no_such_fn"
                       ^^^^^^^^^^^^^^^^^^^^^^^^^^^
        hint: a reward is a dotted path to a Python callable ("pkg.module.fn") or a name registered with @flowrl.reward (add `import "pkg.module"`)
    """),
    ('import "no.such.module"\nstep { }\n', """
        t.flow:1:8: error: cannot import module 'no.such.module': ModuleNotFoundError: No module named 'no'
            import "no.such.module"
                   ^^^^^^^^^^^^^^^^
        hint: the module must be importable: installed, or next to the flow file
    """),
]


@pytest.mark.parametrize("text, expected", PYTHON_REFERENCE)
def test_python_reference(compile_error: Check, text: str, expected: str) -> None:
    assert compile_error(text) == expect(expected)


def test_python_reference_registered_name(compile_error: Check) -> None:
    rendered = compile_error('reward r = "arith_exakt"\nstep { }\n')
    head, source, caret, hint = rendered.split("\n")
    assert head.startswith("t.flow:1:12: error: cannot resolve reward \"arith_exakt\": no reward registered as "
                           "'arith_exakt' (registered: ")
    assert (source, caret, hint) == ('    reward r = "arith_exakt"', "               ^^^^^^^^^^^^^",
                                     "hint: did you mean `arith_exact`?")


DATA = [
    ('data d = jsonl("missing.jsonl")\nstep { }\n', """
        t.flow:1:16: error: data file not found: missing.jsonl
            data d = jsonl("missing.jsonl")
                           ^^^^^^^^^^^^^^^
        hint: paths are relative to the flow file's folder ({flows})
    """),
    ('data d = jsonl("data/bad.jsonl")\nstep { }\n', """
        data/bad.jsonl:2:1: error: invalid JSON: Expecting value
            not json
            ^
        hint: read by data `d` (t.flow:1:1)
        data/bad.jsonl:3:1: error: missing string field 'prompt'
            {{"question": "b"}}
            ^
        hint: every row needs "prompt": "..." (or chat messages)
        data/bad.jsonl:4:1: error: each line must be a JSON object
            [1]
            ^
        hint: read by data `d` (t.flow:1:1)
    """),
    ('data d = csv("data/arith.jsonl")\nstep { }\n', """
        t.flow:1:10: error: unknown data kind `csv`
            data d = csv("data/arith.jsonl")
                     ^^^
        hint: data kinds: jsonl, parquet, datasets
    """),
    ('data d = jsonl("data/arith.jsonl") { bach = 4, batch = "4" }\nstep { }\n', """
        t.flow:1:38: error: unknown data key `bach`
            data d = jsonl("data/arith.jsonl") {{ bach = 4, batch = "4" }}
                                                 ^^^^
        hint: did you mean `batch`?
        t.flow:1:56: error: `batch` must be an integer, got the string "4"
            data d = jsonl("data/arith.jsonl") {{ bach = 4, batch = "4" }}
                                                                   ^^^
        hint: write `batch = 4`
    """),
]


@pytest.mark.parametrize("text, expected", DATA)
def test_data(compile_error: Check, in_flows: object, text: str, expected: str) -> None:
    assert compile_error(text) == expect(expected).format(flows=in_flows)


def test_data_file_is_read_relative_to_the_flow(compile_error: Check) -> None:
    # from another folder, the flow's own folder decides; messages name the file as the flow path does
    text = 'data d = jsonl("data/bad.jsonl")\nstep { }\n'
    assert compile_error(text, path="../flows/t.flow").startswith("../flows/data/bad.jsonl:2:1: error: invalid JSON")


def test_every_error_of_a_file_is_reported(compile_error: Check) -> None:
    text = HEAD + 'reward r = "no.such.module.fn"\nstep {\n    rollout = actor.generate(prompts, n = "8")\n' \
                  "    lp = actor.logprobs(rolout)\n}\n"
    assert compile_error(text) == expect("""
        t.flow:5:12: error: cannot resolve reward "no.such.module.fn": cannot import module 'no.such.module': ModuleNotFoundError: No module named 'no'
            reward r = "no.such.module.fn"
                       ^^^^^^^^^^^^^^^^^^^
        hint: a reward is a dotted path to a Python callable ("pkg.module.fn") or a name registered with @flowrl.reward (add `import "pkg.module"`)
        t.flow:7:43: error: argument `n` of `actor.generate` must be an integer, got the string "8"
                rollout = actor.generate(prompts, n = "8")
                                                      ^^^
        hint: write `n = 8`
        t.flow:8:25: error: unknown name `rolout`
                lp = actor.logprobs(rolout)
                                    ^^^^^^
        hint: did you mean `rollout`?
    """)


def test_flow_without_iteration_or_with_two(compile_error: Check) -> None:
    assert compile_error(HEAD) == expect("""
        t.flow:1:1: error: this flow has no iteration
            model actor : policy { source = "tiny:gpt2" }
            ^
        hint: add `use TEMPLATE(...)` (e.g. `use grpo(group = 8)`) or a `step { ... }` block
    """)
    assert compile_error(HEAD + "use grpo(reward = correct)\nstep { }\n") == expect("""
        t.flow:6:1: error: a flow has exactly one `use` or `step`
            step { }
            ^^^^^^^^
        hint: the first is on line 5; remove one of them
    """)


def test_a_cycle_is_reported_with_other_errors(compile_error: Check) -> None:
    rendered = compile_error(step("a = group_advantage(b, group = 2)", "b = group_advantage(a, group = 2)",
                                  "c = group_advantage(zz, group = 2)"))
    assert [line for line in rendered.splitlines() if ": error: " in line] == [
        "t.flow:6:5: error: cycle: a -> b -> a", "t.flow:8:25: error: unknown name `zz`"]
