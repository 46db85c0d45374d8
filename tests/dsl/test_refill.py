"""Dynamic sampling and overlong shaping in the language (dsl.refill, dsl.shaping): the `dapo` template as a
one-word swap from `grpo`, the loop as `flowrl compile` prints it and `flowrl viz` draws it, what the passes do
with it, and the full rendered errors of wrong filters and overlong keys."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from textwrap import dedent
from typing import Any

from flowrl.compiler import optimize
from flowrl.dsl import compile_flow
from flowrl.ir import to_json, to_text
from flowrl.ir.graph import Graph
from flowrl.viz.views import draw

FLOWS = Path(__file__).parent / "flows"
Compile = Callable[..., Graph]
Check = Callable[..., str]

HEAD = """\
model actor : policy { source = "tiny:gpt2", charset = "0123456789+=" }
model ref : reference { source = actor }
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("data/arith.jsonl") { batch = 4 }
"""


def step(*lines: str) -> str:
    """HEAD plus a step whose first statement is on line 6."""
    return HEAD + "step {\n" + "".join(f"    {line}\n" for line in lines) + "}\n"


def expect(text: str) -> str:
    return dedent(text).strip("\n")


def _nodes(graph: Graph) -> dict[str, dict[str, Any]]:
    return {n["id"]: {k: v for k, v in n.items() if k != "loc"} for n in to_json(graph)["nodes"]}


def test_grpo_to_dapo_is_one_word_and_changes_what_dapo_is(compile_ok: Compile) -> None:
    use = "use {}(reward = correct, group = 4, max_tokens = 2)\n"
    grpo, dapo = compile_ok(HEAD + use.format("grpo")), compile_ok(HEAD + use.format("dapo"))
    assert (grpo.models, grpo.data, grpo.rewards, grpo.run) == (dapo.models, dapo.data, dapo.rewards, dapo.run)
    g, d = _nodes(grpo), _nodes(dapo)
    assert set(d) - set(g) == {"kept"}
    assert d["kept"]["attrs"] == {"fn": "filter_groups", "keep": "mixed", "batch": 4, "max_gen_batches": 10,
                                  "refill": ["prompts", "rollout", "scores"]}
    assert d["rollout"]["attrs"] == {**g["rollout"]["attrs"], "refilled_by": "kept"}
    assert d["scores"]["attrs"] == {**g["scores"]["attrs"], "overlong_buffer": 0, "overlong_penalty": 1.0}
    for name in ("old_logp", "ref_logp", "actor.update"):  # the forwards and the update train on the kept groups
        assert d[name]["inputs"][0] == "kept" and g[name]["inputs"][0] == "rollout"
    assert d["adv"]["inputs"] == ["kept"]
    update = {k: v for k, v in d["actor.update"]["attrs"].items() if g["actor.update"]["attrs"].get(k) != v}
    assert update == {"clip_high": 0.28, "kl_coef": 0.0, "mask_truncated": False}  # clip-higher, no KL; token-mean is grpo's


def test_compile_prints_the_loop_and_viz_draws_it_back(compile_ok: Compile) -> None:
    graph = compile_ok(HEAD + "use dapo(reward = correct, group = 4, max_tokens = 2, batch = 6, max_gen_batches = 3)\n")
    text = to_text(graph)
    assert ('  kept = fn:filter_groups(rollout=rollout, scores=scores) {batch=6, keep="mixed", max_gen_batches=3, '
            'refill=["prompts", "rollout", "scores"]}  @controller/controller  # <stdlib>/dapo.flow:32:5') in text
    assert 'refilled_by="kept"' in text
    source = draw(graph, "parsed").source
    assert ('kept -> prompts [label="refill: draw more prompts until 6 groups are kept (\u22643 draws)" '
            'color="#5f3dc4" constraint=false fontcolor="#5f3dc4" style=dashed]') in source


def test_the_passes_share_prefixes_over_the_kept_groups_and_say_why_they_do_not_stream() -> None:
    text = """\
model actor : policy { source = "tiny:gpt2", charset = "0123456789+=" }
model ref : reference { source = actor }
reward length = "flowrl.rewards.length_target" { workers = 1 }
data prompts = jsonl("../../../examples/data/longtail.jsonl") { batch = 4 }
use dapo(reward = length, group = 4, max_tokens = 24, kl_coef = 0.01)
placement {
    pool rollout { gpus = 1 }
    pool train   { gpus = 1 }
    actor.generate -> rollout
    actor.update, ref -> train
}
"""
    graph = optimize(compile_flow(text, str(FLOWS / "t.flow")))
    marked = {n.id for n in graph.nodes if n.attrs.get("share_prefix")}
    assert marked == {"rollout", "ref_logp", "actor.update"}  # old_logp: dropped by on-policy-logp
    fusion = {n.id: n.attrs.get("fusion") for n in graph.nodes if n.attrs.get("fusion")}
    assert fusion == {"rollout": "gen-infer:rollout", "scores": "gen-infer:rollout"}  # the reward scores each draw
    notes = next(p.notes for p in graph.passes if p.name == "fuse-gen-inference")
    assert ("ref_logp: not fused with rollout: it reads kept, the groups filter_groups keeps, known only once every "
            "sample of a draw is generated and scored") in notes


def test_asynchronous_runs_draw_ahead(compile_ok: Compile) -> None:
    graph = optimize(compile_ok(HEAD + """\
use dapo(reward = correct, group = 4, max_tokens = 2)
placement {
    pool rollout { gpus = 1 }
    pool train   { gpus = 1 }
    actor.generate -> rollout
    actor.update, ref -> train
}
run { max_staleness = 1 }
"""))
    assert {n.id for n in graph.nodes if n.attrs.get("phase") == "rollout"} == {"prompts", "rollout", "scores", "kept",
                                                                               "adv"}
    notes = next(p.notes for p in graph.passes if p.name == "async-rollout")
    assert ("kept: its refill draws (prompts, rollout, scores) run ahead too, so drawing more prompts overlaps "
            "training instead of stalling it") in notes


def test_a_filter_of_something_that_is_not_a_rollout(compile_error: Check) -> None:
    assert compile_error(step("rollout = actor.generate(prompts, n = 4)", "scores = correct(rollout)",
                              "kept = filter_groups(scores, scores)")) == expect("""
        t.flow:8:26: error: `filter_groups` filters the groups of a rollout, but `scores` is a `reward`'s output
                kept = filter_groups(scores, scores)
                                     ^^^^^^
        hint: pass a generate's result: `rollout = MODEL.generate(prompts, n = 8)`
    """)


def test_scores_of_another_rollout(compile_error: Check) -> None:
    assert compile_error(step("rollout = actor.generate(prompts, n = 4)", "other = actor.generate(prompts, n = 4)",
                              "scores = correct(other)", "kept = filter_groups(rollout, scores)")) == expect("""
        t.flow:9:35: error: `scores` is not computed from `rollout`: the filter compares the scores of each of its groups
                kept = filter_groups(rollout, scores)
                                              ^^^^^^
        hint: pass the reward of that rollout: `scores = REWARD(rollout)`
    """)


def test_a_node_after_the_filter_reading_the_refilled_rollout(compile_error: Check) -> None:
    assert compile_error(step("rollout = actor.generate(prompts, n = 4)", "scores = correct(rollout)",
                              "kept = filter_groups(rollout, scores)", "old = actor.logprobs(rollout)",
                              "adv = group_advantage(kept, group = 4)",
                              "actor.update(kept, old_logp = old, advantages = adv)")) == expect("""
        t.flow:9:26: error: `rollout` is refilled by `kept = filter_groups(...)`: each draw of prompts adds to it, and the samples trained on are the groups `kept` keeps
                old = actor.logprobs(rollout)
                                     ^^^^^^^
        hint: pass `kept` (it carries `rollout`'s tensors and `scores`'s scores, for the kept groups)
    """)


def test_draws_that_can_never_fill_the_batch(compile_error: Check) -> None:
    assert compile_error(HEAD + "use dapo(reward = correct, group = 4, max_tokens = 2, batch = 9, "
                                "max_gen_batches = 2)\n") == expect("""
        t.flow:5:84: error: `max_gen_batches = 2` draws of 4 prompts can never fill `batch = 9` groups
            use dapo(reward = correct, group = 4, max_tokens = 2, batch = 9, max_gen_batches = 2)
                                                                                               ^
        hint: allow at least 3 draws (`max_gen_batches = 3`), or lower `batch`
    """)


def test_an_overlong_buffer_not_below_max_tokens(compile_error: Check) -> None:
    assert compile_error(HEAD + "use dapo(reward = correct, group = 4, max_tokens = 8, overlong_buffer = 8)\n") == \
        expect("""
        t.flow:5:73: error: `overlong_buffer = 8` is not below `max_tokens = 8` of `rollout`: every response would be punished from its first token
            use dapo(reward = correct, group = 4, max_tokens = 8, overlong_buffer = 8)
                                                                                    ^
        hint: the buffer is the last tokens before max_tokens: at most 7 (DAPO: 4096 of 20480)
    """)


def test_keys_out_of_range_and_choices(compile_error: Check) -> None:
    rendered = compile_error(HEAD + 'use dapo(reward = correct, group = 4, max_tokens = 8, keep = "mix")\n')
    assert 'error: argument `keep` of template `dapo` must be one of "mixed", "all", got the string "mix"' in rendered
    assert "hint: did you mean `mixed`?" in rendered
    rendered = compile_error(step("rollout = actor.generate(prompts, n = 4)",
                                  "scores = correct(rollout, overlong_buffer = -1)"))
    assert rendered.splitlines()[0] == ("t.flow:7:49: error: argument `overlong_buffer` of `correct` must be at least 0, "
                                         "got the integer -1")
    rendered = compile_error(HEAD + "use dapo(reward = correct, group = 4, max_tokens = 8, max_gen_batches = 0)\n")
    assert "error: argument `max_gen_batches` of template `dapo` must be at least 1, got the integer 0" in rendered


def test_one_sample_per_prompt_is_a_warning(compile_ok: Compile) -> None:
    graph = compile_ok(step("rollout = actor.generate(prompts, n = 1, max_tokens = 2)", "scores = correct(rollout)",
                            "kept = filter_groups(rollout, scores)", "adv = group_advantage(kept, group = 1)",
                            "actor.update(kept, advantages = adv)"))
    assert [w.message for w in graph.warnings][:1] == [
        "`rollout` samples one response per prompt (`n = 1`): every group is one sample, and filter_groups keeps them "
        "all (verl keeps a group of one)"]

