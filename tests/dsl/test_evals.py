"""`eval NAME { ... }` declarations: every key resolved at check time (defaults from the flow's generate, reward and
run), printed by `flowrl compile`, located errors for what cannot run, and which stages of a pipeline evaluate."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from flowrl.compiler import compile_any
from flowrl.dsl import Pipeline
from flowrl.errors import FlowError
from flowrl.ir import to_json, to_text
from flowrl.ir.graph import EvalDecl, Graph

HEAD = """model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=" }
model ref : reference { source = actor }
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("data/arith.jsonl") { batch = 4 }
data held = jsonl("data/arith.jsonl") { limit = 3 }
use grpo(reward = correct, group = 4, max_tokens = 2)
run { steps = 5, checkpoint_every = 2 }
"""


def test_an_eval_block_takes_its_defaults_from_the_flow(compile_ok: Callable[..., Graph]) -> None:
    g = compile_ok(HEAD + "eval held { data = held }\neval wide { data = held, n = 8, temperature = 1.0, every = 0,"
                          " max_tokens = 4, at_start = true }\n")
    assert g.evals[0] == EvalDecl("held", "held", "actor", "correct", g.evals[0].loc, n=1, temperature=0.0,
                                  max_tokens=2, every=2, at_start=False)  # generate's max_tokens, checkpoint_every
    assert (g.evals[0].loc.line, g.evals[0].loc.col) == (8, 1)
    assert (g.evals[1].n, g.evals[1].temperature, g.evals[1].max_tokens, g.evals[1].every, g.evals[1].at_start) == (
        8, 1.0, 4, 0, True)
    text = to_text(g)
    assert "eval held {data=held, model=actor, reward=correct, n=1, temperature=0.0, max_tokens=2, every=2}\n" in text
    assert text.endswith("eval wide {data=held, model=actor, reward=correct, n=8, temperature=1.0, max_tokens=4, "
                         "every=0, at_start=true}\n" + "".join(
                             f"pass {p.name}: {'changed' if p.changed else 'unchanged'}\n" for p in g.passes))
    assert to_json(g)["evals"][0] == {"name": "held", "data": "held", "model": "actor", "reward": "correct", "n": 1,
                                      "temperature": 0.0, "max_tokens": 2, "every": 2, "at_start": False,
                                      "loc": "t.flow:8:1"}


def test_a_flow_without_eval_prints_as_before(compile_ok: Callable[..., Graph]) -> None:
    g = compile_ok(HEAD)
    assert g.evals == () and "eval" not in to_text(g)


def test_a_missing_data_set_is_a_located_error(compile_error: Callable[..., str]) -> None:
    assert compile_error(HEAD + "eval held { data = hled }\n") == (
        "t.flow:8:20: error: `data` names `hled`, which is not a declared data set\n"
        "    eval held { data = hled }\n"
        "                       ^^^^\n"
        "hint: did you mean `held`?")
    assert compile_error(HEAD + "eval held { n = 2 }\n") == (
        "t.flow:8:6: error: eval `held` has no `data`\n"
        "    eval held { n = 2 }\n"
        "         ^^^^\n"
        "hint: add `data = NAME`: a data declaration of held-out prompts")


def test_n_below_one_is_a_located_error(compile_error: Callable[..., str]) -> None:
    assert compile_error(HEAD + "eval held { data = held, n = 0 }\n") == (
        "t.flow:8:30: error: `n` must be at least 1\n"
        "    eval held { data = held, n = 0 }\n"
        "                                 ^")


def test_evaluating_on_the_data_the_step_trains_on_is_a_located_error(compile_error: Callable[..., str]) -> None:
    assert compile_error(HEAD + "eval held { data = prompts }\n") == (
        "t.flow:8:20: error: eval `held` evaluates on `prompts`, which the step trains on\n"
        "    eval held { data = prompts }\n"
        "                       ^^^^^^^\n"
        'hint: declare the held-out prompts as data of their own (`data held = jsonl("...")`); the same file under '
        "another name evaluates on training prompts on purpose")


def test_a_reward_that_does_not_exist_is_a_located_error(compile_error: Callable[..., str]) -> None:
    assert compile_error(HEAD + "eval held { data = held, reward = corect }\n") == (
        "t.flow:8:35: error: `reward` names `corect`, which is not a declared reward\n"
        "    eval held { data = held, reward = corect }\n"
        "                                      ^^^^^^\n"
        "hint: did you mean `correct`?")
    assert compile_error(HEAD + 'eval held { data = held, reward = "correct" }\n') == (
        "t.flow:8:35: error: `reward` names a declared reward\n"
        '    eval held { data = held, reward = "correct" }\n'
        "                                      ^^^^^^^^^\n"
        "hint: write `reward = correct`, without quotes")


def test_other_mistakes_are_located_all_at_once(compile_error: Callable[..., str]) -> None:
    rendered = compile_error(HEAD + "eval held { data = held, model = ref, nn = 2 }\neval held { data = held }\n")
    assert rendered == (
        "t.flow:8:34: error: `model` must be a policy; `ref` is a reference\n"
        "    eval held { data = held, model = ref, nn = 2 }\n"
        "                                     ^^^\n"
        "hint: an evaluation generates answers: name the policy\n"
        "t.flow:8:39: error: unknown eval key `nn`\n"
        "    eval held { data = held, model = ref, nn = 2 }\n"
        "                                          ^^\n"
        "hint: did you mean `n`?\n"
        "t.flow:9:6: error: duplicate eval name `held`\n"
        "    eval held { data = held }\n"
        "         ^^^^\n"
        "hint: `held` is first declared on line 8; eval names must be unique")


def test_a_flow_scoring_with_a_reward_model_names_its_evals_reward(compile_error: Callable[..., str]) -> None:
    text = HEAD.replace('reward correct = "flowrl.rewards.arith_exact"\n', "").replace(
        "use grpo(reward = correct", "model rm : reward_model { source = actor }\nuse grpo(reward = rm")
    assert compile_error(text + "eval held { data = held }\n").splitlines()[:2] == [
        "t.flow:8:6: error: eval `held` has no reward to score with", "    eval held { data = held }"]


STAGED = """flow staged
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 1e-3 }
model ref : reference { source = actor }
model rm : reward_model { source = actor, lr = 1e-3 }
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("data.jsonl") { batch = 4 }
data demos = jsonl("demos.jsonl") { batch = 4 }
data pairs = jsonl("pairs.jsonl") { batch = 4 }
data held = jsonl("data.jsonl") { limit = 3 }
run { steps = 2, seed = 3 }
eval held { data = held, at_start = true }
stage sft { use sft(demos = demos) }
stage rm  { use reward_model(pairs = pairs) }
stage rl  { use grpo(reward = correct, group = 4, max_tokens = 3)  eval held { data = held, n = 2 } }
"""


def _staged(tmp: Path) -> str:
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(3) for b in range(3)]
    (tmp / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "demos.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"], "response": str(r["answer"])}) + "\n"
                                             for r in rows))
    (tmp / "pairs.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"], "chosen": str(r["answer"]),
                                                         "rejected": "9"}) + "\n" for r in rows))
    (tmp / "staged.flow").write_text(STAGED)
    return str(tmp / "staged.flow")


def test_a_top_level_eval_applies_to_the_stages_using_its_model_and_a_stages_own_replaces_it(tmp_path: Path) -> None:
    pipe = compile_any(_staged(tmp_path))
    assert isinstance(pipe, Pipeline)
    evals = {s.name: [(e.name, e.n, e.max_tokens, e.at_start) for e in s.graph.evals] for s in pipe.stages}
    # sft generates nothing: max_tokens from the rl stage's generate; rm trains only the reward model: no eval there
    assert evals == {"sft": [("held", 1, 3, True)], "rm": [], "rl": [("held", 2, 3, False)]}
    pipe = compile_any(str(tmp_path / "staged.flow"), {"eval.held.n": "4"})  # every stage's `held`
    assert isinstance(pipe, Pipeline)
    assert [[e.n for e in s.graph.evals] for s in pipe.stages] == [[4], [], [4]]


def test_an_eval_in_a_stage_that_trains_on_its_data_is_an_error(tmp_path: Path) -> None:
    path = _staged(tmp_path)
    Path(path).write_text(STAGED.replace("eval held { data = held, at_start = true }",
                                         "eval held { data = demos, at_start = true }"))
    try:
        compile_any(path)
    except FlowError as e:
        assert e.render().splitlines()[0] == f"{path}:11:20: error: eval `held` evaluates on `demos`, which the " \
                                             "step trains on"
    else:
        raise AssertionError("compiled")


def test_answers_that_cannot_fit_the_models_positions_are_a_located_error(compile_error: Callable[..., str]) -> None:
    assert compile_error(HEAD + "eval held { data = held, max_tokens = 600 }\n") == (
        "t.flow:8:39: error: eval `held`: `max_tokens = 600` and the longest prompt of `held` (5 tokens) need 605 "
        "positions; model `actor` has 512\n"
        "    eval held { data = held, max_tokens = 600 }\n"
        "                                          ^^^\n"
        "hint: `max_tokens` can be at most 507 here")


def test_set_overrides_an_eval_blocks_keys(compile_ok: Callable[..., Graph], compile_error: Callable[..., str]) -> None:
    g = compile_ok(HEAD + "eval held { data = held }\n", {"eval.held.n": "8", "eval.held.every": "0"})
    assert (g.evals[0].n, g.evals[0].every) == (8, 0)
    assert compile_error(HEAD + "eval held { data = held }\n",
                         {"eval.hed.n": "8", "eval.held.nn": "2", "eval.held": "3", "eval.held.n": "0"}) == (
        "<overrides>:1:6: error: override `eval.hed.n`: no eval named `hed`\n"
        "    eval.hed.n=8\n"
        "         ^^^\n"
        "hint: did you mean `held`?\n"
        "<overrides>:2:11: error: unknown eval key `nn`\n"
        "    eval.held.nn=2\n"
        "              ^^\n"
        "hint: did you mean `n`?\n"
        "<overrides>:3:1: error: override `eval.held` must be eval.NAME.KEY\n"
        "    eval.held=3\n"
        "    ^^^^^^^^^\n"
        "hint: for example `eval.held.n=8`\n"
        "<overrides>:4:13: error: `n` must be at least 1\n"
        "    eval.held.n=0\n"
        "                ^")
