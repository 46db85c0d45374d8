"""Templates: the standard library's parameters, binding rules, and swapping one algorithm for another."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from flowrl.dsl import stdlib_names, template_source
from flowrl.dsl.templates import stdlib_template
from flowrl.dsl.values import to_value
from flowrl.errors import FlowError
from flowrl.ir import to_json
from flowrl.ir.graph import Graph

Compile = Callable[..., Graph]
Check = Callable[..., str]

DECLS = """\
model actor : policy { source = "tiny:gpt2", layers = 2, dim = 64, heads = 2 }
model ref : reference { source = actor }
model critic : critic { source = actor, lr = 5e-5 }
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("data/arith.jsonl") { batch = 4 }
"""
USE = "use {}(reward = correct, group = 8, clip = 0.2, kl_coef = 0.001, max_tokens = 16)\n"

# LANGUAGE.md's table: required parameters (with role) and the optional ones with their defaults.
TABLE: dict[str, tuple[dict[str, str | None], dict[str, object]]] = {
    "grpo": ({"actor": "policy", "ref": "reference", "reward": None, "prompts": None},
             {"group": 8, "clip": 0.2, "kl_coef": 0.001, "max_tokens": 256, "temperature": 1.0}),
    "ppo": ({"actor": "policy", "ref": "reference", "critic": "critic", "reward": None, "prompts": None},
            {"n": 1, "clip": 0.2, "kl_coef": 0.001, "gamma": 1.0, "lam": 0.95, "max_tokens": 256,
             "temperature": 1.0}),
    "rloo": ({"actor": "policy", "ref": "reference", "reward": None, "prompts": None},
             {"group": 4, "kl_coef": 0.001, "max_tokens": 256, "temperature": 1.0}),
    "reinforce_pp": ({"actor": "policy", "ref": "reference", "reward": None, "prompts": None},
                     {"n": 1, "kl_coef": 0.001, "gamma": 1.0, "max_tokens": 256, "temperature": 1.0}),
    # the recipes' papers' defaults (each template's comment cites them)
    "gspo": ({"actor": "policy", "ref": "reference", "reward": None, "prompts": None},
             {"group": 8, "clip": 3e-4, "clip_high": 4e-4, "kl_coef": 0.0, "agg": "seq-mean-token-mean"}),
    "dr_grpo": ({"actor": "policy", "ref": "reference", "reward": None, "prompts": None},
                {"group": 8, "clip": 0.2, "kl_coef": 0.0, "max_tokens": 256}),
    "cispo": ({"actor": "policy", "ref": "reference", "reward": None, "prompts": None},
              {"group": 8, "clip": 1.0, "clip_high": 4.0, "kl_coef": 0.0, "agg": "token-mean"}),
    "dapo": ({"actor": "policy", "ref": "reference", "reward": None, "prompts": None},
             {"group": 8, "clip": 0.2, "kl_coef": 0.0, "max_tokens": 256, "temperature": 1.0}),
}


@pytest.mark.parametrize("name", sorted(TABLE))
def test_stdlib_parameters_match_the_language_table(name: str, compile_ok: Compile) -> None:
    found = stdlib_template(name)
    assert found is not None
    decl, src = found
    assert src.path == f"<stdlib>/{name}.flow"
    required, optional = TABLE[name]
    params = {p.name.name: p for p in decl.params}
    for pname, role in required.items():
        assert params[pname].default is None
        assert (params[pname].role.name if params[pname].role else None) == role
    # defaults as written, or as bound (ppo's and reinforce_pp's `n` defaults to `group`, which defaults to 1)
    graph = compile_ok(DECLS + f"use {name}(reward = correct)\n")
    rollout = graph.node("rollout")
    for pname, default in optional.items():
        written = params[pname].default
        assert written is not None
        value = to_value(written)
        if str(value) in params:
            assert pname == "n" and rollout.attrs["n"] == default
        else:
            assert value == default, pname


def test_template_source_and_names() -> None:
    assert stdlib_names() == ["cispo", "dapo", "dpo", "dr_grpo", "grpo", "gspo", "ppo", "reinforce_pp", "reward_model", "rloo", "sft"]
    text = template_source("grpo")
    assert "template grpo(actor: policy, ref: reference, reward, prompts," in text
    assert "adv      = group_advantage(scores, group = group, turns = turns)" in text
    with pytest.raises(FlowError) as info:
        template_source("gpro")
    assert info.value.render() == "error: unknown template `gpro`\nhint: did you mean `grpo`?"


def _strip(j: dict[str, Any]) -> dict[str, Any]:
    """The JSON minus what must differ between two templates: the template's name and the source locations
    of the nodes it expands to (they point into `<stdlib>/grpo.flow` or `<stdlib>/ppo.flow`)."""
    j = dict(j)
    j.pop("template")
    j["nodes"] = [{k: v for k, v in n.items() if k != "loc"} for n in j["nodes"]]
    return j


def test_swapping_grpo_for_ppo_changes_exactly_the_critic_parts(compile_ok: Compile) -> None:
    grpo = _strip(to_json(compile_ok(DECLS + USE.format("grpo"))))
    ppo = _strip(to_json(compile_ok(DECLS + USE.format("ppo"))))
    grpo_nodes = {n["id"]: n for n in grpo.pop("nodes")}
    ppo_nodes = {n["id"]: n for n in ppo.pop("nodes")}
    assert grpo == ppo  # models, rewards, data, worker groups, run: all equal
    assert set(ppo_nodes) - set(grpo_nodes) == {"values", "critic.update"}
    assert set(grpo_nodes) - set(ppo_nodes) == set()
    assert ppo_nodes["values"]["op"] == "values" and ppo_nodes["critic.update"]["op"] == "update"
    assert ppo_nodes["critic.update"]["inputs"] == ["rollout", "adv", "values"]
    assert grpo_nodes["adv"]["attrs"]["fn"] == "group_advantage"
    assert ppo_nodes["adv"]["attrs"]["fn"] == "gae"
    assert ppo_nodes["adv"]["inputs"] == ["scores", "values"]
    for node_id in grpo_nodes.keys() - {"adv"}:
        assert grpo_nodes[node_id] == ppo_nodes[node_id], node_id


def test_ppo_without_a_critic_is_a_template_error(compile_error: Check) -> None:
    rendered = compile_error(DECLS.replace("model critic : critic { source = actor, lr = 5e-5 }\n", "")
                             + USE.format("ppo"))
    assert "error: template `ppo` needs a critic model `critic`, but none is declared" in rendered
    assert "declare `model critic : critic { source = actor }`" in rendered


@pytest.mark.parametrize("name", ["grpo", "ppo", "rloo", "reinforce_pp", "gspo", "dr_grpo", "cispo", "dapo"])
def test_one_word_swaps_between_all_standard_templates(name: str, compile_ok: Compile) -> None:
    graph = compile_ok(DECLS + USE.format(name))
    assert graph.template == name
    assert graph.node("rollout").attrs["n"] == 8


# The update's keys (and group_advantage's) each recipe changes from grpo, given examples/grpo_arith.flow's `use`;
# every other node and attribute is grpo's. kl_coef = 0.05 is kept: it means what it means in grpo.
ARITH_USE = "use {}(reward = correct, group = 8, max_tokens = 2, kl_coef = 0.05, temperature = 1.0)\n"
RECIPES = {
    "gspo": ({}, {"ratio": "sequence", "clip": 3e-4, "clip_high": 4e-4, "agg": "seq-mean-token-mean"}),
    "dr_grpo": ({"norm_std": False}, {"agg": "seq-mean-token-sum-norm", "loss_scale_factor": 2}),
    "cispo": ({}, {"loss": "cispo", "clip": 1.0, "clip_high": 4.0, "dual_clip": None}),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_recipe_is_grpo_with_its_papers_loss(name: str, compile_ok: Compile) -> None:
    grpo = _strip(to_json(compile_ok(DECLS + ARITH_USE.format("grpo"))))
    recipe = _strip(to_json(compile_ok(DECLS + ARITH_USE.format(name))))
    grpo_nodes = {n["id"]: n for n in grpo.pop("nodes")}
    nodes = {n["id"]: n for n in recipe.pop("nodes")}
    assert grpo == recipe and grpo_nodes.keys() == nodes.keys()
    adv, update = RECIPES[name]
    for node_id, changed in (("adv", adv), ("actor.update", update)):
        want = {**grpo_nodes[node_id]["attrs"], **changed}
        if "dual_clip" in changed:  # a key of ppo_clip that cispo does not read: left out of its attrs
            del want["dual_clip"]
        assert nodes[node_id]["attrs"] == want, node_id
        assert nodes[node_id]["attrs"]["kl_coef" if node_id == "actor.update" else "group"] == (
            0.05 if node_id == "actor.update" else 8)
    for node_id in grpo_nodes.keys() - {"adv", "actor.update"}:
        assert grpo_nodes[node_id] == nodes[node_id], node_id


def test_explicit_binding_and_reward_model(compile_ok: Compile) -> None:
    graph = compile_ok("""\
model pi : policy { source = "tiny:gpt2" }
model ref : reference { source = pi }
model judge : reward_model { source = pi }
data prompts = jsonl("data/arith.jsonl")
use grpo(actor = pi, reward = judge, group = 2)
""")
    scores = graph.node("scores")
    assert (scores.op, scores.model, scores.method, scores.dispatch) == ("score", "judge", "score", "split")
    assert graph.node("pi.update").model == "pi"
    assert graph.node("rollout").loc.path == "<stdlib>/grpo.flow"
    assert graph.node("rollout").text.startswith("rollout  = actor.generate(prompts, n = group,")  # as written


def test_default_naming_an_earlier_parameter(compile_ok: Compile) -> None:
    assert compile_ok(DECLS + "use ppo(reward = correct, group = 4)\n").node("rollout").attrs["n"] == 4
    assert compile_ok(DECLS + "use ppo(reward = correct, group = 4, n = 2)\n").node("rollout").attrs["n"] == 2


def test_user_template_shadows_the_standard_one(compile_ok: Compile) -> None:
    graph = compile_ok(DECLS + """\
template grpo(actor: policy, reward, prompts, k = 3) {
    rollout = actor.generate(prompts, n = k)
    scores  = reward(rollout)
    adv     = rloo_advantage(scores, group = k)
    actor.update(rollout, advantages = adv)
}
use grpo(reward = correct)
""")
    assert [n.id for n in graph.nodes] == ["prompts", "rollout", "scores", "adv", "actor.update"]
    assert graph.node("rollout").loc.path == "t.flow"


def test_template_bodies_see_only_their_parameters(compile_error: Check) -> None:
    rendered = compile_error(DECLS + """\
template t(actor: policy, prompts) {
    rollout = actor.generate(prompts)
    scores  = correct(rollout)
}
use t()
""")
    assert rendered.startswith("t.flow:8:15: error: unknown name `correct`")


def test_template_declaration_errors(compile_error: Check) -> None:
    rendered = compile_error(DECLS + """\
template t(actor: polcy, actor) {
    rollout = actor.generate(prompts)
}
template t() {
}
use t()
""")
    assert "t.flow:6:19: error: unknown role `polcy`" in rendered
    assert "t.flow:6:26: error: parameter `actor` is declared twice in template `t`" in rendered
    assert "t.flow:9:10: error: template `t` is declared twice" in rendered


def test_literal_for_a_model_parameter(compile_error: Check) -> None:
    assert compile_error(DECLS + "use grpo(reward = correct, actor = 3)\n").startswith(
        "t.flow:6:36: error: template `grpo` needs `actor` to be a policy model, but the argument is a literal")


def test_show_lists_each_template_with_its_one_line_description(capsys: pytest.CaptureFixture[str]) -> None:
    from flowrl.cli import main
    from flowrl.dsl.templates import template_summary

    # a sentence ends at a period before a capital, but not at "Dr." or "et al."; cut at a word within 100
    assert template_summary("dr_grpo") == ("Dr. GRPO (Liu et al., 2025, arXiv:2503.20783): GRPO without its length and "
                                           "question-difficulty…")
    assert template_summary("rloo") == ("RLOO (Ahmadian et al., 2024): `group` samples per prompt; each response's "
                                        "baseline is the mean…")
    assert main(["show"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == stdlib_names()
    assert "gspo          GSPO (Zheng et al., 2025, arXiv:2507.18071): GRPO with the importance ratio and its clip " \
           "taken per…" in lines
