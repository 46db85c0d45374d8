"""Lowering to the IR: nodes, attributes, declarations, placement."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from textwrap import dedent

import pytest

from flowrl import registry
from flowrl.dsl import compile_flow, load
from flowrl.dsl.lower import CONFIG_KEYS, FIELD_KEYS
from flowrl.ir.graph import CONTROLLER, Graph, Range
from flowrl.ir.signatures import MODEL_KEYS, RUN_KEYS
from flowrl.models.lora_spec import LORA_KEYS

Compile = Callable[..., Graph]
Check = Callable[..., str]

HEAD = """\
model actor : policy { source = "tiny:gpt2" }
model ref : reference { source = actor }
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("data/arith.jsonl")
"""


def test_nodes_are_sorted_topologically_ties_in_statement_order(compile_ok: Compile) -> None:
    g = compile_ok(HEAD + dedent("""\
        step {
            adv      = group_advantage(scores, group = 2)
            ref_logp = ref.logprobs(rollout)
            scores   = correct(rollout)
            rollout  = actor.generate(prompts, n = 2)
            actor.update(rollout, ref_logp = ref_logp, advantages = adv)
        }
    """))
    assert [n.id for n in g.nodes] == ["prompts", "rollout", "ref_logp", "scores", "adv", "actor.update"]


def test_node_fields(compile_ok: Compile) -> None:
    g = compile_ok(HEAD + dedent("""\
        step {
            rollout = actor.generate(prompts, n = 2, temperature = 1)
            scores  = correct(rollout)
            adv     = group_advantage(scores, group = 2)
            actor.update(rollout, advantages = adv, kl_coef = 0.1, ref_logp = rollout)
        }
    """))
    data, rollout, scores, adv, update = g.nodes
    assert (data.id, data.op, data.inputs, data.worker_group, data.dispatch) == (
        "prompts", "data", (), CONTROLLER, "controller")
    assert dict(data.attrs) == {"batch": 8, "shuffle": True, "prompt_key": "prompt", "limit": 0}
    assert data.text == 'data prompts = jsonl("data/arith.jsonl")'
    assert (rollout.op, rollout.model, rollout.method, rollout.inputs) == (
        "generate", "actor", "generate", (("prompts", "prompts"),))
    # every literal parameter is in attrs, defaults included; ints widen to floats for float parameters
    assert dict(rollout.attrs) == {"n": 2, "max_tokens": 256, "min_tokens": 0, "temperature": 1.0, "top_p": 1.0}
    assert isinstance(rollout.attrs["temperature"], float)
    assert (rollout.worker_group, rollout.dispatch) == ("colocated", "split")
    assert (rollout.loc.path, rollout.loc.line, rollout.loc.col) == ("t.flow", 6, 5)
    assert rollout.text == "rollout = actor.generate(prompts, n = 2, temperature = 1)"
    assert (scores.op, dict(scores.attrs), scores.worker_group, scores.dispatch) == (
        "reward", {"fn": "flowrl.rewards.arith_exact"}, CONTROLLER, "controller")
    assert (adv.op, dict(adv.attrs)) == ("fn", {"fn": "group_advantage", "group": 2, "norm_std": True, "eps": 1e-6,
                                         "turns": "trajectory"})
    assert update.id == "actor.update" and update.method == "update"
    # node inputs in signature order, whatever the order of the call
    assert update.inputs == (("rollout", "rollout"), ("advantages", "adv"), ("ref_logp", "rollout"))
    assert update.attrs["kl_coef"] == 0.1 and update.attrs["clip_high"] is None and update.attrs["loss"] == "ppo_clip"


def test_declarations(compile_ok: Compile, in_flows: Path) -> None:
    g = compile_ok(dedent("""\
        model actor : policy { source = "tiny:gpt2", layers = 2, dim = 64, heads = 2, gpus = 1, engine = "vllm" }
        model ref : reference { source = actor, dropout = 0.1 }
        model critic : critic { source = ref, replicas = auto }
        model judge : reward_model { source = "hf:ckpt/judge", lr = 1e-3, dtype = "bfloat16" }
        reward correct = "arith_exact"
        data prompts = jsonl("data/arith.jsonl") { batch = 4 }
        data unused = jsonl("data/arith.jsonl")
        step { }
    """))
    actor, ref, critic, judge = g.models
    assert (actor.source, actor.source_model, actor.trainable, actor.lr, actor.engine, actor.gpus) == (
        "tiny:gpt2", None, True, 1e-5, "vllm", 1.0)
    assert dict(actor.config) == {"layers": 2, "dim": 64, "heads": 2, "context": 512, "dropout": 0.0}
    # the other keys, defaults filled in
    # (the LoRA keys only on a model with `lora_rank`: tests/dsl/test_lora_keys.py)
    others = {k: d for k, (_, d) in MODEL_KEYS.items() if k not in (*CONFIG_KEYS, *FIELD_KEYS, *LORA_KEYS)}
    assert dict(actor.options) == others and others["dtype"] == "float32"
    assert (ref.source, ref.source_model, ref.trainable, ref.lr) == ("tiny:gpt2", "actor", False, None)
    assert dict(ref.config) == {**actor.config, "dropout": 0.1}
    assert (critic.source, critic.source_model, critic.trainable, critic.replicas) == ("tiny:gpt2", "ref", True, "auto")
    assert dict(critic.config) == dict(ref.config)
    assert judge.source == "hf:" + str(in_flows / "ckpt" / "judge")
    # an hf: model's config holds its config.json's positions as `context` (what the workers fit prompts to)
    assert (judge.trainable, judge.lr, dict(judge.config), judge.options["dtype"]) == (False, 1e-3, {"context": 64},
                                                                                       "bfloat16")
    assert [(r.name, r.target, r.batched) for r in g.rewards] == [("correct", "arith_exact", False)]
    assert [d.name for d in g.data] == ["prompts", "unused"]
    assert g.data[0].path == str(in_flows / "data" / "arith.jsonl") and g.data[0].options["batch"] == 4
    # every run key filled with its default (keys added to RUN_KEYS included)
    assert dict(g.run) == {k: d for k, (_, d) in RUN_KEYS.items()}
    assert (g.run["steps"], g.run["device"], g.run["max_staleness"]) == (100, "auto", 0)
    assert g.flow == "t" and g.template is None and g.nodes == ()


def test_flow_name(compile_ok: Compile, in_flows: Path) -> None:
    assert compile_ok("flow named\nstep { }\n").flow == "named"
    assert compile_ok("step { }\n", path="sub/dir/my_flow.flow").flow == "my_flow"
    assert compile_flow("step { }\n").flow == "flow"  # "<string>": paths resolve against the cwd
    assert compile_flow('data d = jsonl("data/arith.jsonl")\nstep { }\n').data[0].path == str(
        in_flows / "data" / "arith.jsonl")


def test_worker_groups_without_placement(compile_ok: Compile) -> None:
    g = compile_ok(HEAD + 'model critic : critic { source = actor, replicas = 2 }\nuse grpo(reward = correct)\n')
    assert [(w.name, w.models, w.pool, w.replicas) for w in g.worker_groups] == [
        ("colocated", ("actor", "ref", "critic"), None, 2)]
    assert {n.worker_group for n in g.nodes if n.model} == {"colocated"}


def test_worker_groups_with_placement(compile_ok: Compile) -> None:
    g = compile_ok(HEAD + dedent("""\
        model critic : critic { source = actor }
        model spare : policy { source = actor }
        use ppo(reward = correct)
        placement {
            pool gen { gpus = 4..16, elastic = true }
            pool train { gpus = 8 }
            actor.generate -> gen
            actor.update, critic -> train
        }
    """))
    groups = {w.name: (w.models, w.pool) for w in g.worker_groups}
    assert groups == {"gen": (("actor",), "gen"), "train": (("actor", "critic"), "train"),
                      "default": (("ref", "spare"), None)}
    where = {n.id: n.worker_group for n in g.nodes}
    assert where == {"prompts": CONTROLLER, "rollout": "gen", "old_logp": "train", "ref_logp": "default",
                     "values": "train", "scores": CONTROLLER, "adv": CONTROLLER, "actor.update": "train",
                     "critic.update": "train"}
    assert [(p.name, p.gpus, p.elastic) for p in g.pools] == [("gen", Range(4, 16), True), ("train", 8, False)]


def test_no_default_group_when_everything_is_pinned(compile_ok: Compile) -> None:
    g = compile_ok(HEAD + "use grpo(reward = correct)\nplacement {\n    pool all { gpus = 2 }\n"
                          "    actor, ref -> all\n}\n")
    assert [w.name for w in g.worker_groups] == ["all"]


def test_colocated_replicas_must_agree(compile_error: Check) -> None:
    rendered = compile_error(HEAD.replace('"tiny:gpt2" }', '"tiny:gpt2", replicas = 2 }')
                             + 'model critic : critic { source = actor, replicas = 4 }\nstep { }\n')
    assert rendered.startswith("t.flow:5:52: error: models in worker group `colocated` ask for different "
                               "replicas: `actor` has 2, `critic` has 4")


# ---- user functions and imports ----------------------------------------------------------------------


def my_adv(scores: object, values: object = None, *, scale: float = 1.0, mode: str, flag: bool = False) -> object:
    return scores


def test_user_function(compile_ok: Compile, compile_error: Check, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.FUNCTIONS, "my_adv", my_adv)
    g = compile_ok(HEAD + dedent("""\
        step {
            rollout = actor.generate(prompts)
            scores  = correct(rollout)
            adv     = my_adv(scores, mode = "x", scale = 2)
        }
    """))
    adv = g.node("adv")
    assert (adv.op, adv.inputs) == ("fn", (("scores", "scores"),))
    assert dict(adv.attrs) == {"fn": "my_adv", "scale": 2.0, "mode": "x", "flag": False}
    rendered = compile_error(HEAD + 'step {\n    rollout = actor.generate(prompts)\n'
                                    '    adv = my_adv(rollout, scale = "2")\n}\n')
    assert rendered == dedent("""\
        t.flow:7:11: error: missing required argument `mode` of `my_adv`
                adv = my_adv(rollout, scale = "2")
                      ^^^^^^
        hint: add `mode = VALUE`
        t.flow:7:35: error: argument `scale` of `my_adv` must be a number, got the string "2"
                adv = my_adv(rollout, scale = "2")
                                              ^^^
        hint: write `scale = 2`""")


def test_import_makes_registrations_visible(tmp_path: Path) -> None:
    (tmp_path / "flowrl_test_plugin_a.py").write_text(dedent("""\
        import flowrl.registry as r

        @r.reward("always_one")
        def always_one(prompt, response, **row):
            return 1.0

        @r.function("double")
        def double(scores):
            return scores
    """))
    (tmp_path / "data.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "x.flow").write_text(dedent("""\
        import "flowrl_test_plugin_a"
        model actor : policy { source = "tiny:gpt2" }
        reward one = "always_one"
        data prompts = jsonl("data.jsonl")
        step {
            rollout = actor.generate(prompts)
            scores  = one(rollout)
            twice   = double(scores)
        }
    """))
    g = load(tmp_path / "x.flow")
    assert g.imports == ("flowrl_test_plugin_a",)
    assert g.node("scores").attrs["fn"] == "always_one" and g.node("twice").attrs["fn"] == "double"
    assert str(tmp_path) not in os.sys.path  # the flow's folder is on sys.path only while it is checked


def test_graph_is_frozen_and_verified(compile_ok: Compile) -> None:
    g = compile_ok(HEAD + "use grpo(reward = correct)\n")
    with pytest.raises(TypeError):
        g.node("adv").attrs["group"] = 3  # type: ignore[index]
