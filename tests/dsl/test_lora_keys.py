"""LoRA keys in the language (dsl/lora.py, flowrl.models.lora_spec): checked at check time with located errors (on a
model that does not train, without `lora_rank`, targets a tiny model lacks, a wrong kind, with vLLM), and shown by
`flowrl compile`: the settings on the model, and the reference that is a LoRA policy's base."""

from __future__ import annotations

from collections.abc import Callable

from flowrl.ir.graph import Graph
from flowrl.ir.printer import to_json, to_text

HEAD = """model actor : policy {{ source = "tiny:gpt2", lr = 1e-2{actor} }}
model ref : reference {{ source = actor{ref} }}
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("data/arith.jsonl")
use grpo(reward = correct, group = 4, max_tokens = 2)
"""


def flow(actor: str = "", ref: str = "", tail: str = "") -> str:
    return HEAD.format(actor=actor, ref=ref) + tail


def test_compile_prints_the_adapters_and_the_shared_base(compile_ok: Callable[..., Graph]) -> None:
    g = compile_ok(flow(actor=", lora_rank = 8, lora_alpha = 32"))
    lines = to_text(g).splitlines()
    assert lines[1].endswith(" lora {rank=8, alpha=32.0, dropout=0.0, targets=c_attn c_proj c_fc}"), lines[1]
    assert lines[2].endswith("  # ref: base of actor (adapters off), sharing its weights"), lines[2]
    models = {m["name"]: m for m in to_json(g)["models"]}
    assert models["actor"]["lora"] == {"rank": 8, "alpha": 32.0, "dropout": 0.0, "targets": []}
    assert (models["ref"]["base_of"], models["ref"]["shares_base"]) == ("actor", True)


def test_a_reference_in_another_group_gets_its_own_copy(compile_ok: Callable[..., Graph]) -> None:
    placed = "placement {\n  pool a { gpus = 1 }\n  pool b { gpus = 1 }\n  actor -> a\n  ref -> b\n}\n"
    g = compile_ok(flow(actor=', lora_rank = 4, lora_targets = "all-linear"', tail=placed))
    lines = to_text(g).splitlines()
    assert lines[1].endswith("targets=all-linear}")
    assert lines[2].endswith("  # ref: base of actor (adapters off), a copy of its own: not in actor's worker group")


def test_without_lora_nothing_changes(compile_ok: Callable[..., Graph]) -> None:
    g = compile_ok(flow())
    assert " lora " not in to_text(g) and "base of" not in to_text(g)
    assert all("lora" not in m and "base_of" not in m for m in to_json(g)["models"])
    assert not any(k.startswith("lora_") for m in g.models for k in m.options)


def test_lora_on_a_reference_is_an_error(compile_error: Callable[..., str]) -> None:
    assert compile_error(flow(actor=", lora_rank = 8", ref=", lora_rank = 8")) == (
        "t.flow:2:41: error: `lora_rank` on `ref`, which does not train: LoRA adapters are weights an update trains\n"
        "    model ref : reference { source = actor, lora_rank = 8 }\n"
        "                                            ^^^^^^^^^\n"
        "hint: a reference whose source is a LoRA policy is already that policy's base with the adapters off "
        "(`actor`'s weights, one copy): remove the LoRA keys from `ref`")


def test_lora_on_a_policy_that_does_not_train_is_an_error(compile_error: Callable[..., str]) -> None:
    text = flow(tail='model judge : reward_model { source = "tiny:gpt2", lora_rank = 4 }\n')
    assert compile_error(text) == (
        "t.flow:6:52: error: `lora_rank` on `judge`, which does not train: LoRA adapters are weights an update "
        "trains\n"
        '    model judge : reward_model { source = "tiny:gpt2", lora_rank = 4 }\n'
        "                                                       ^^^^^^^^^\n"
        "hint: set `trainable = true` on `judge`, or remove its LoRA keys")


def test_a_lora_key_needs_the_rank(compile_error: Callable[..., str]) -> None:
    assert compile_error(flow(actor=", lora_alpha = 32")) == (
        "t.flow:1:57: error: `lora_alpha` needs `lora_rank`\n"
        '    model actor : policy { source = "tiny:gpt2", lr = 1e-2, lora_alpha = 32 }\n'
        "                                                            ^^^^^^^^^^\n"
        "hint: `lora_rank = 8` trains adapters of rank 8 on `actor`'s frozen weights; without it `actor` trains "
        "every weight")


def test_targets_a_tiny_model_lacks_are_named_with_the_ones_it_has(compile_error: Callable[..., str]) -> None:
    rendered = compile_error(flow(actor=', lora_rank = 8, lora_targets = ["c_attn", "q_proj", "c_fx"]'))
    assert rendered == (
        't.flow:1:98: error: `lora_targets` names "q_proj", which matches no linear module of tiny:gpt2\n'
        '    model actor : policy { source = "tiny:gpt2", lr = 1e-2, lora_rank = 8, lora_targets = ["c_attn", '
        '"q_proj", "c_fx"] }\n'
        "                                                                                                     ^^^^^^^^\n"
        'hint: did you mean `c_proj`? its linear modules are c_attn, c_proj, c_fc, lm_head (or write "all-linear")\n'
        't.flow:1:108: error: `lora_targets` names "c_fx", which matches no linear module of tiny:gpt2\n'
        '    model actor : policy { source = "tiny:gpt2", lr = 1e-2, lora_rank = 8, lora_targets = ["c_attn", '
        '"q_proj", "c_fx"] }\n'
        "                                                                                                           "
        "    ^^^^^^\n"
        'hint: did you mean `c_fc`? its linear modules are c_attn, c_proj, c_fc, lm_head (or write "all-linear")')


def test_targets_of_the_wrong_kind(compile_error: Callable[..., str]) -> None:
    rendered = compile_error(flow(actor=", lora_rank = 8, lora_targets = 3"))
    assert rendered.splitlines()[0] == ('t.flow:1:87: error: `lora_targets` must be "all-linear", a module name or '
                                        'a list of module names')


def test_ranges_are_checked_where_written(compile_error: Callable[..., str]) -> None:
    assert compile_error(flow(actor=", lora_rank = 8, lora_dropout = 1.0")).splitlines()[0] == (
        "t.flow:1:87: error: `lora_dropout` must be at least 0 and below 1")
    assert compile_error(flow(actor=", lora_rank = 0")).splitlines()[0] == (
        "t.flow:1:69: error: `lora_rank` must be at least 1")


def test_lora_with_vllm_is_an_error(compile_error: Callable[..., str]) -> None:
    rendered = compile_error(flow(actor=', lora_rank = 8, engine = "vllm"'))
    assert ('t.flow:1:57: error: `actor` has LoRA adapters and engine "vllm", which generates from a copy of the '
            'whole weights that flowrl replaces after each update') in rendered
    assert 'hint: use engine = "torch" with LoRA' in rendered
