"""Staged flows (`stage NAME { ... }`): parsing, a graph per stage, located errors, `--set` overrides per stage,
and the check of a reward model that scores before any stage trains it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import flowrl
from flowrl.compiler import compile_any, compile_file
from flowrl.dsl import Pipeline, parse
from flowrl.dsl import ast as A
from flowrl.errors import FlowError

HEAD = """flow staged
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 1e-3 }
model ref : reference { source = actor }
model critic : critic { source = actor }
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("data.jsonl") { batch = 4 }
run { steps = 4, seed = 3 }
"""
TWO = HEAD + """stage warm { use grpo(reward = correct, group = 4, max_tokens = 3)  run { steps = 2 } }
stage ppo {
    use ppo(reward = correct, n = 4, max_tokens = 3)
}
"""


def flow(tmp: Path, text: str, name: str = "staged.flow") -> str:
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(3) for b in range(3)]
    (tmp / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp / name
    path.write_text(text)
    return str(path)


def errors(path: str, overrides: dict[str, str] | None = None) -> str:
    with pytest.raises(FlowError) as e:
        compile_any(path, overrides)
    return e.value.render()


def test_stages_parse_in_order_with_their_parts(tmp_path: Path) -> None:
    module = parse(TWO, "t.flow")
    stages = [d for d in module.decls if isinstance(d, A.StageDecl)]
    assert [s.name.name for s in stages] == ["warm", "ppo"]
    assert [type(i).__name__ for i in stages[0].items] == ["UseDecl", "RunDecl"]
    assert [type(i).__name__ for i in stages[1].items] == ["UseDecl"]
    assert (stages[1].line, stages[1].col) == (9, 1)


def test_a_graph_per_stage_with_only_its_models_and_merged_run(tmp_path: Path) -> None:
    pipe = compile_any(flow(tmp_path, TWO))
    assert isinstance(pipe, Pipeline)
    assert (pipe.flow, pipe.names) == ("staged", ("warm", "ppo"))
    warm, ppo = pipe.stages
    assert [m.name for m in warm.graph.models] == ["actor", "ref"]  # grpo has no critic
    assert [m.name for m in ppo.graph.models] == ["actor", "ref", "critic"]
    assert (warm.steps, warm.run["seed"], ppo.steps, ppo.run["seed"]) == (2, 3, 4, 3)
    assert warm.graph.template == "grpo" and ppo.graph.template == "ppo"
    assert any(n.op == "gae" or n.attrs.get("fn") == "gae" for n in ppo.graph.nodes)
    assert warm.graph.passes and ppo.graph.passes  # the default passes ran on each stage


def test_a_source_model_is_kept_though_the_stage_never_calls_it(tmp_path: Path) -> None:
    text = HEAD + """model gen : policy { source = actor }
stage only_critic {
    step {
        rollout = gen.generate(prompts, n = 2, max_tokens = 2)
        values = critic.values(rollout)
        critic.update(rollout, values = values, returns = values)
    }
}
"""
    (stage,) = compile_any(flow(tmp_path, text)).stages  # type: ignore[union-attr]
    # gen and critic are built from actor's weights: actor is in the graph, unused by any node; ref is not
    assert [m.name for m in stage.graph.models] == ["actor", "critic", "gen"]
    assert {n.model for n in stage.graph.nodes if n.model} == {"gen", "critic"}


def test_a_flow_without_stages_compiles_as_before(tmp_path: Path) -> None:
    plain = HEAD + "use grpo(reward = correct, group = 4, max_tokens = 3)\n"
    path = flow(tmp_path, plain)
    assert compile_any(path) == compile_file(path)


def test_compile_file_and_load_name_the_pipeline_api(tmp_path: Path) -> None:
    path = flow(tmp_path, TWO)
    with pytest.raises(FlowError) as e:
        flowrl.load(path)
    assert e.value.render() == f"""{path}:8:7: error: this flow has stages: it compiles to a pipeline of graphs, not one graph
    stage warm {{ use grpo(reward = correct, group = 4, max_tokens = 3)  run {{ steps = 2 }} }}
          ^^^^
hint: `flowrl run` / `flowrl compile` take it as it is; in Python use flowrl.compiler.compile_any"""


def test_stage_errors_are_located_all_at_once(tmp_path: Path) -> None:
    text = HEAD + """use grpo(reward = correct, group = 4)
stage a { use grpo(reward = correct, group = 4, max_tokens = 3) }
stage a { use grpo(reward = correct, group = 4, max_tokens = 3) }
stage empty { run { steps = 2 } }
stage two { use grpo(reward = correct, group = 4)
    step { r = actor.generate(prompts) } }
"""
    path = flow(tmp_path, text)
    assert errors(path) == f"""{path}:8:1: error: a flow has either stages or a top-level `use`, not both
    use grpo(reward = correct, group = 4)
    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
hint: move it into a stage (`stage NAME {{ use ... }}`), or remove the stages
{path}:10:7: error: duplicate stage name `a`
    stage a {{ use grpo(reward = correct, group = 4, max_tokens = 3) }}
          ^
hint: `a` is first declared on line 9; stage names must be unique
{path}:11:7: error: stage `empty` has no `use` or `step`
    stage empty {{ run {{ steps = 2 }} }}
          ^^^^^
hint: add `use TEMPLATE(...)` or a `step {{ ... }}` block inside its `{{ }}`
{path}:13:5: error: a stage has exactly one `use` or `step`
        step {{ r = actor.generate(prompts) }} }}
        ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
hint: the first is on line 12; put the other in a stage of its own"""


def test_an_error_inside_a_stage_is_reported_once_at_its_line(tmp_path: Path) -> None:
    text = HEAD + """stage a { use grpo(reward = correct, group = 4, max_tokens = 3, clip = "x") }
stage b { use grpo(reward = corect, group = 4, max_tokens = 3) }
model bad : policy { source = "tiny:nope" }
"""
    path = flow(tmp_path, text)
    # each stage's problem at its line; a shared declaration's once, not once per stage
    assert errors(path) == f"""{path}:8:72: error: argument `clip` of template `grpo` must be a number, got the string "x"
    stage a {{ use grpo(reward = correct, group = 4, max_tokens = 3, clip = "x") }}
                                                                           ^^^
{path}:9:29: error: unknown name `corect`
    stage b {{ use grpo(reward = corect, group = 4, max_tokens = 3) }}
                                ^^^^^^
hint: did you mean `correct`?
{path}:10:31: error: unknown tiny model "tiny:nope"
    model bad : policy {{ source = "tiny:nope" }}
                                  ^^^^^^^^^^^
hint: did you mean `tiny:gpt2`?"""


def test_overrides_per_stage_and_for_every_stage(tmp_path: Path) -> None:
    path = flow(tmp_path, TWO)
    pipe = compile_any(path, {"run.steps": "7", "stage.warm.steps": "1", "stage.ppo.use.max_tokens": "2",
                              "actor.lr": "5e-4", "run.seed": "9"})
    assert isinstance(pipe, Pipeline)
    warm, ppo = pipe.stages
    assert (warm.steps, ppo.steps) == (1, 7)  # the stage's own key wins over the plain one
    assert warm.run["seed"] == ppo.run["seed"] == 9
    assert warm.graph.model("actor").lr == ppo.graph.model("actor").lr == 5e-4
    gen = [n for n in ppo.graph.nodes if n.op == "generate"][0]
    assert gen.attrs["max_tokens"] == 2
    assert [n for n in warm.graph.nodes if n.op == "generate"][0].attrs["max_tokens"] == 3
    # a model only some stages have: its override applies where it is
    assert compile_any(path, {"critic.lr": "1e-4"}).stages[1].graph.model("critic").lr == 1e-4  # type: ignore[union-attr]


def test_bad_stage_overrides_are_located(tmp_path: Path) -> None:
    path = flow(tmp_path, TWO)
    assert errors(path, {"stage.wram.steps": "2", "stage.ppo": "1", "stage.ppo.a.b": "1"}) == """\
<overrides>:1:7: error: override `stage.wram.steps`: no stage named `wram`
    stage.wram.steps=2
          ^^^^
hint: did you mean `warm`?
<overrides>:2:1: error: override `stage.ppo` must be stage.NAME.KEY (a run key) or stage.NAME.use.PARAM
    stage.ppo=1
    ^^^^^^^^^
hint: for example `stage.sft.steps=10`
<overrides>:3:1: error: override `stage.ppo.a.b` must be stage.NAME.KEY (a run key) or stage.NAME.use.PARAM
    stage.ppo.a.b=1
    ^^^^^^^^^^^^^
hint: for example `stage.ppo.steps=10`"""
    assert "unknown run key `stepz`" in errors(path, {"stage.ppo.stepz": "3"})


RM = HEAD + """model rm : reward_model { source = SOURCE }
stage first { FIRST }
stage second { use grpo(reward = rm, group = 4, max_tokens = 3) }
"""


def rm_flow(source: str, first: str) -> str:
    return RM.replace("SOURCE", source).replace("FIRST", first)
RM_UPDATE = 'step { rm.update(pairs, loss = "bradley_terry") }'
PAIRS = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)} for a in range(3) for b in range(3)]


def test_a_reward_model_scoring_before_any_stage_trains_it_is_an_error(tmp_path: Path) -> None:
    path = flow(tmp_path, rm_flow("actor", "use grpo(reward = correct, group = 4, max_tokens = 3)"))
    assert errors(path) == f"""{path}:10:20: error: reward model `rm` scores rollouts in stage `second`, but no earlier stage trains it and its weights are `actor`'s with a new value head
    stage second {{ use grpo(reward = rm, group = 4, max_tokens = 3) }}
                       ^^^^
hint: train it in an earlier stage, or give it a checkpoint source"""
    tiny = flow(tmp_path, rm_flow('"tiny:gpt2"', "use grpo(reward = correct, group = 4)"), "t.flow")
    assert 'its source "tiny:gpt2" has random weights' in errors(tiny)


def test_a_reward_model_trained_in_an_earlier_stage_may_score(tmp_path: Path) -> None:
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    text = rm_flow("actor", RM_UPDATE).replace("run {", 'data pairs = jsonl("pairs.jsonl") { batch = 4 }\nrun {')
    pipe = compile_any(flow(tmp_path, text))
    assert isinstance(pipe, Pipeline) and pipe.names == ("first", "second")


def test_a_stage_places_with_its_own_block_or_the_files_less_the_models_it_leaves_out(tmp_path: Path) -> None:
    text = TWO.replace("run { steps = 4, seed = 3 }", """run { steps = 4, seed = 3 }
placement {
    pool gen { gpus = 0 }
    pool train { gpus = 0 }
    actor.generate -> gen
    actor.update, ref, critic -> train
}""").replace("    use ppo(reward = correct, n = 4, max_tokens = 3)\n", """    use ppo(reward = correct, n = 4, max_tokens = 3)
    placement { pool all { gpus = 0 }
        actor, ref, critic -> all }
""")
    warm, ppo = compile_any(flow(tmp_path, text)).stages  # type: ignore[union-attr]
    assert [(w.name, w.models) for w in warm.graph.worker_groups] == [("gen", ("actor",)),
                                                                      ("train", ("actor", "ref"))]  # no critic
    assert [(w.name, w.models) for w in ppo.graph.worker_groups] == [("all", ("actor", "ref", "critic"))]


def test_at_most_one_run_block_in_a_stage_and_in_the_file(tmp_path: Path) -> None:
    text = TWO.replace("run { steps = 2 } }", "run { steps = 2 }\n  run { seed = 1 } }") + "run { seed = 2 }\n"
    path = flow(tmp_path, text)
    assert errors(path) == f"""{path}:9:3: error: a stage has at most one `run` block
      run {{ seed = 1 }} }}
      ^^^^^^^^^^^^^^^^
hint: merge it into the one on line 8
{path}:13:1: error: a flow has at most one `run` block
    run {{ seed = 2 }}
    ^^^^^^^^^^^^^^^^
hint: merge the two; a stage's own settings go in its `run {{ }}`"""


@pytest.mark.parametrize("inside", ["model x : policy { source = actor }", 'use grpo(group = 2)  data d = jsonl("x")',
                                    "step { }  stage t { }"])
def test_a_declaration_inside_a_stage_is_a_named_syntax_error(tmp_path: Path, inside: str) -> None:
    path = flow(tmp_path, HEAD + f"stage s {{ {inside} }}\n")
    text = errors(path)
    word = {"m": "model", "u": "data", "s": "stage"}[inside[0]]
    assert f"error: syntax error: expected `use`, `step`, `run` or `placement` in a stage, got `{word}`" in text
    assert text.endswith("hint: a stage holds one `use` or `step { }`, and its own `run { }` and `placement { }`; "
                         "models, data and rewards are declared at the top level, for every stage")


def test_mutated_staged_flows_fail_only_with_flow_errors(tmp_path: Path) -> None:
    """The fuzz property (tests/dsl/test_fuzz.py) on a staged flow: 600 seeded mutations, no other exception."""
    import random

    from flowrl.dsl import compile_any as compile_text_any

    flow(tmp_path, TWO)  # its data file
    words = ["stage", "{", "}", "use", "step", "run", "placement", "warm", "ppo", "grpo(", ")", "\n", "=", "steps",
             "actor", "ref", "critic", "rm", "model", "reward_model"]
    rng = random.Random(27)
    for _ in range(600):
        text = TWO
        for _ in range(rng.randint(1, 3)):
            i = rng.randint(0, len(text))
            if rng.random() < 0.5:
                text = text[:i] + text[i + rng.randint(1, 6):]
            else:
                text = text[:i] + rng.choice(words) + text[i:]
        overrides = {"stage.ppo.steps": "2"} if rng.random() < 0.3 else None
        try:
            compile_text_any(text, str(tmp_path / "m.flow"), overrides)
        except FlowError as e:
            assert e.render()
