"""share-prefix: when it marks a rollout, each refusal, idempotence, and equal numbers with and without it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import Tensor

from flowrl.engines import packing_cost, prefix, prompt_cache
from flowrl.engines.forward import forward_logprobs, forward_logprobs_entropy, forward_values
from flowrl.engines.generation import generate
from flowrl.engines.prefix import packed_logprobs_entropy, packed_values, shared_logprobs, shared_values
from flowrl.engines.trie import PrefixTrie, plan_prefixes
from flowrl.ir.graph import Graph, frozen
from flowrl.models.build import ModelSpec, build_model
from flowrl.models.tokenizer import ByteTokenizer
from flowrl.passes.share_prefix import MIN_LEN, share_prompt_prefix

from .conftest import PPO_UPDATES, SYSTEM, assert_same_numbers, passes, run_steps

FORWARDS = ("old_logp", "ref_logp", "values", "scores", "actor.update", "critic.update")


def marked(g: Graph) -> list[str]:
    return [n.id for n in g.nodes if n.attrs.get("share_prefix")]


def test_marks_generation_and_every_forward_over_the_rollout(ppo: Callable[..., Graph]) -> None:
    g, notes = share_prompt_prefix(ppo(n=4))
    assert marked(g) == ["rollout", *FORWARDS]
    assert all(g.node(i).attrs["prefix_min_len"] == MIN_LEN for i in marked(g))
    assert notes == ["rollout: n = 4 samples share each prompt and prompts in `prompts` share prefixes of >= 16 "
                     "tokens: prefixes computed once in rollout, old_logp, ref_logp, values, scores, actor.update, "
                     "critic.update"]


def test_one_sample_per_prompt_still_shares_a_common_opening(ppo: Callable[..., Graph]) -> None:
    g, notes = share_prompt_prefix(ppo(n=1))
    assert marked(g) == ["rollout", *FORWARDS]
    assert "prompts in `prompts` share prefixes of >= 16 tokens" in notes[0]


def _prompts_from_a_function(g: Graph) -> Graph:
    data = g.node("prompts")
    made = replace(data, op="fn", attrs=frozen({"fn": "make_prompts"}))
    return g.with_nodes([made if n.id == "prompts" else n for n in g.nodes])


REFUSALS: list[tuple[str, dict[str, Any], Callable[[Graph], Graph], str]] = [
    ("engine", dict(actor_extra=', engine = "vllm"'), lambda g: g,
     "rollout: not shared: actor uses engine 'vllm', which manages its own prefix cache"),
    ("short prompts", dict(prompts=["1+2=", "3+4="], batch=2), lambda g: g,
     "rollout: not shared: every prompt in `prompts` is at most 5 tokens, under prefix_min_len = 16"),
    ("n=1, prompts made in the step", dict(n=1), _prompts_from_a_function,
     "rollout: not shared: n = 1 and the prompts are not read from a data file, so no prefix is known to repeat"),
    ("n=1, no common opening", dict(n=1, prompts=[f"{i}{SYSTEM}" for i in range(8)]), lambda g: g,
     "rollout: not shared: n = 1 and no two prompts in `prompts` share their first 16 tokens"),
]


@pytest.mark.parametrize(("build", "edit", "note"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refuses(ppo: Callable[..., Graph], build: dict[str, Any], edit: Callable[[Graph], Graph],
                 note: str) -> None:
    g = edit(ppo(**build))
    out, notes = share_prompt_prefix(g)
    assert out == g
    assert notes == [note]


def test_refuses_a_forward_on_another_engine_but_shares_the_rest(ppo: Callable[..., Graph]) -> None:
    g, notes = share_prompt_prefix(ppo(critic_extra=', engine = "deepspeed"'))
    assert marked(g) == ["rollout", "old_logp", "ref_logp", "scores", "actor.update"]
    assert notes[:2] == ["values: not shared: critic uses engine 'deepspeed'",
                         "critic.update: not shared: critic uses engine 'deepspeed'"]


def test_idempotent(ppo: Callable[..., Graph]) -> None:
    once = passes(ppo(), "share-prefix")
    twice = passes(once, "share-prefix")
    assert twice.nodes == once.nodes
    assert [p.changed for p in twice.passes] == [True, False]


# -- the runtime: engines/prefix.py, packing_cost.py, prompt_cache.py -----------------------------------------

TOK = ByteTokenizer()


def test_trie_groups_prompts_by_their_common_opening() -> None:
    trie = PrefixTrie()
    for p in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], [1, 2, 3, 4, 5, 6, 7, 8], [7, 7, 7, 7, 7], [1, 2, 8, 8, 8]):
        trie.insert(p)
    # [1, 2, 3, 4] is common to prompts 0-2; prompt 1 ends one token later, so its own last token stays its own.
    assert trie.groups(min_len=3) == [(4, [0, 1, 2])]
    assert trie.groups(min_len=2) == [(2, [0, 1, 2, 4])]
    assert trie.groups(min_len=5) == [(5, [0, 2])]
    assert trie.groups(min_len=6) == []


SYSTEM_PROMPTS = [SYSTEM + "hello world", SYSTEM + "hi", "a somewhat longer prompt", "xyz", SYSTEM + "2+2"]
DISTINCT = ["hello world, how are you", "hi", "a somewhat longer prompt", "xyz"]  # no common opening


def _rollout(family: str, texts: list[str] = SYSTEM_PROMPTS) -> Any:
    policy = build_model(ModelSpec(f"tiny:{family}", {"layers": 2, "dim": 32, "heads": 2}), seed=0).module
    prompts = [[TOK.bos_id, *TOK.encode(t)] for t in texts]
    out = generate(policy, TOK, prompts, n=3, max_tokens=9, generator=torch.Generator().manual_seed(0))
    return policy, (out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("min_len", [4, 16])
@pytest.mark.parametrize("layout", ["packed", "copies", "eager"])
def test_shared_forwards_equal_the_plain_forward(family: str, min_len: int, layout: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """With a trie group: prefix once, each prompt's rest once, then the responses (packed or on copies)."""
    policy, args = _rollout(family)
    critic = build_model(ModelSpec(f"tiny:{family}", {"layers": 2, "dim": 32, "heads": 2}, role="critic"), 1).module
    if layout == "copies":  # every sample attends to its own copy of its prompt's cache
        monkeypatch.setattr(packing_cost, "PACK_LIMIT", 0)
    else:  # packed wherever allowed, whichever costs less here
        monkeypatch.setattr(packing_cost, "PACKING", "always")
    if layout == "eager":  # packed rows with a float mask (eager attention adds it to the scores)
        for model in (policy, critic):
            monkeypatch.setattr(model.config, "_attn_implementation", "eager")
    plan = plan_prefixes(args[0], args[1], min_len)
    assert len(plan.unique) == 5 and plan.groups and plan.saved_tokens > 0
    plain = forward_logprobs(policy, *args, temperature=0.7)
    shared = shared_logprobs(policy, *args, temperature=0.7, min_len=min_len, pad=TOK.pad_id)
    assert shared is not None and (shared - plain).abs().max() <= 1e-5
    for micro in (0, 4):
        values = shared_values(critic, *args, min_len=min_len, micro_batch=micro, pad=TOK.pad_id)
        assert values is not None and (values - forward_values(critic, *args)).abs().max() <= 1e-5


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("eager", [False, True])
def test_prompts_and_packed_samples_in_one_forward_equal_the_plain_forward(family: str, eager: bool,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """No trie group and nothing computed yet: [prompt | its samples packed] in a single call per prompt."""
    policy, args = _rollout(family, DISTINCT)
    if eager:
        monkeypatch.setattr(policy.config, "_attn_implementation", "eager")
    monkeypatch.setattr(packing_cost, "PACKING", "always")  # whether it costs less here or not
    calls: list[int] = []
    single = prefix._single_pass
    monkeypatch.setattr(prefix, "_single_pass", lambda *a: calls.append(1) or single(*a))
    for micro in (0, 6):
        prompt_cache.clear()
        shared = shared_logprobs(policy, *args, temperature=0.7, min_len=16, micro_batch=micro, pad=TOK.pad_id)
        assert shared is not None and (shared - forward_logprobs(policy, *args, temperature=0.7)).abs().max() <= 1e-5
    assert calls == [1, 1, 1]  # one call for the whole rollout, then two micro-batches of two prompts


def test_packing_is_chosen_where_it_costs_less_with_the_same_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many short samples per prompt pack into short rows; a long tail (a few samples of a prompt far longer
    than the rest of the batch, as the last chunk of a streamed long-tail rollout) runs on copies instead."""
    policy = build_model(ModelSpec("tiny:gpt2", {"layers": 2, "dim": 128, "heads": 4}), seed=0).module
    gen = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, 60, (4, 20), generator=gen).repeat_interleave(8, dim=0)  # 4 prompts x 8
    prompt_mask = torch.ones_like(prompt_ids)
    lengths = torch.full((32,), 3)
    rows = list(range(32))
    assert _pays(policy, [r // 8 for r in rows], _mask(lengths, 64))  # 4 rows of 24
    lengths[[0, 1, 2, 3, 4, 5, 8, 9]] = 64
    assert not _pays(policy, [r // 8 for r in rows], _mask(lengths, 64))  # a row of 381
    tail = [0, 1, 2, 3, 4, 5, 8, 9]
    assert not _pays(policy, [r // 8 for r in tail], _mask(lengths[tail], 64))
    response_ids = torch.randint(3, 60, (32, 64), generator=gen) * _mask(lengths, 64)
    args = (prompt_ids, prompt_mask, response_ids, _mask(lengths, 64))
    plain = forward_logprobs(policy, *args)
    calls: list[int] = []
    packed = prefix._responses_packed
    monkeypatch.setattr(prefix, "_responses_packed", lambda *a: calls.append(1) or packed(*a))
    for layout, packed_calls in (("auto", 0), ("always", 1)):  # auto: on copies; always: packed
        monkeypatch.setattr(packing_cost, "PACKING", layout)
        prompt_cache.clear()
        calls.clear()
        for _ in range(2):  # nothing computed yet (one pass), then prompts computed (the two-level path)
            shared = shared_logprobs(policy, *args, min_len=4, pad=0)
            assert shared is not None and (shared - plain).abs().max() <= 1e-5
        assert len(calls) == packed_calls


def _pays(policy: torch.nn.Module, row_prompt: list[int], mask: Tensor) -> bool:
    return packing_cost.packing_pays(policy, packing_cost.packed_rows(row_prompt, mask), 20, mask.shape)  # prompts of 20


def _mask(lengths: Tensor, width: int) -> Tensor:
    return (torch.arange(width)[None, :] < lengths[:, None]).long()


def _grads(module: torch.nn.Module, run: Callable[[], Any]) -> tuple[list[Tensor], list[Tensor]]:
    module.zero_grad(set_to_none=True)
    out = run()
    outs = list(out) if isinstance(out, tuple) else [out]
    sum(o.sum() for o in outs).backward()
    return outs, [p.grad.clone() for p in module.parameters() if p.grad is not None]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_updates_packed_forward_equals_the_plain_one_with_its_gradients(family: str) -> None:
    """An update's forward: each prompt once, its samples packed after it; outputs and gradients as unshared."""
    policy, args = _rollout(family)
    spec = ModelSpec(f"tiny:{family}", {"layers": 2, "dim": 32, "heads": 2}, role="critic")
    critic = build_model(spec, 1).module
    runs = [(policy, lambda: forward_logprobs_entropy(policy, *args, temperature=0.7, with_grad=True),
             lambda: packed_logprobs_entropy(policy, *args, temperature=0.7, min_len=4)),
            (critic, lambda: forward_values(critic, *args, with_grad=True),
             lambda: packed_values(critic, *args, min_len=4))]
    for module, plain, packed in runs:
        (outs_a, grads_a), (outs_b, grads_b) = _grads(module, plain), _grads(module, packed)
        assert all((a - b).abs().max() <= 1e-5 for a, b in zip(outs_a, outs_b, strict=True))
        assert len(grads_a) == len(grads_b)
        for a, b in zip(grads_a, grads_b, strict=True):
            assert (a - b).abs().max() <= 1e-5 * max(1.0, float(a.abs().max()))
    assert packed_logprobs_entropy(policy, *args, min_len=100) is None  # every prompt is shorter


def test_nothing_worth_sharing_falls_back_to_the_plain_forward() -> None:
    policy, args = _rollout("gpt2")
    assert shared_logprobs(policy, *args, min_len=100, pad=TOK.pad_id) is None  # every prompt is shorter


def test_a_run_computes_the_same_numbers_with_and_without_it(ppo: Callable[..., Graph]) -> None:
    g = ppo(n=4, body=PPO_UPDATES)
    assert_same_numbers(run_steps(passes(g)), run_steps(passes(g, "share-prefix")))


def test_computed_prompts_are_reused_until_the_weights_change(monkeypatch: pytest.MonkeyPatch) -> None:
    policy, args = _rollout("gpt2")
    calls: list[int] = []  # prompts computed by each call that computes prompts
    single, prefill = prefix._single_pass, prefix.prefill
    monkeypatch.setattr(prefix, "_single_pass", lambda m, ids, *a: calls.append(len(set(a[1].tolist()))) or
                        single(m, ids, *a))
    monkeypatch.setattr(prefix, "prefill", lambda m, plan, *a: calls.append(len(plan.unique)) or prefill(m, plan, *a))
    first, second = slice(0, 9), slice(9, 15)  # two chunks of one rollout: prompts 0-2, then prompts 3-4
    whole = forward_logprobs(policy, *args)
    for part in (first, second, first):
        got = shared_logprobs(policy, *(a[part] for a in args), min_len=4, pad=TOK.pad_id)
        assert got is not None and (got - whole[part]).abs().max() <= 1e-5
    assert calls == [3, 2]  # the third call found its prompts computed
    with torch.no_grad():
        next(policy.parameters()).add_(0.0)  # an in-place update: every computed prompt is stale ...
    prompt_cache.weights_changed(policy)  # ... as whatever changed the weights says
    shared_logprobs(policy, *(a[first] for a in args), min_len=4, pad=TOK.pad_id)
    assert calls == [3, 2, 3]


def _long_tail(family: str) -> Any:
    """A rollout whose responses end anywhere from 1 to 24 tokens (an EOS bias makes a random model stop)."""
    policy = build_model(ModelSpec(f"tiny:{family}", {"layers": 2, "dim": 32, "heads": 2}), seed=0).module
    bias = torch.zeros(policy.config.vocab_size)
    bias[TOK.eos_id] = 1.5
    hook = policy.get_output_embeddings().register_forward_hook(lambda _m, _i, out: out + bias)
    prompts = [[TOK.bos_id, *TOK.encode(t)] for t in SYSTEM_PROMPTS]
    out = generate(policy, TOK, prompts, n=6, max_tokens=24, generator=torch.Generator().manual_seed(1))
    hook.remove()
    return policy, (out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_packed_rows_leave_the_padding_out_and_equal_the_plain_forward(family: str) -> None:
    """Long-tailed lengths: a packed row holds its samples' real tokens only, not samples x the longest."""
    policy, args = _long_tail(family)
    lens = args[3].sum(1)
    assert int(lens.min()) < 6 and int(lens.max()) == 24  # most short, some at max_tokens
    rows = plan_prefixes(args[0], args[1], 4).row_prompt
    real = {u: sum(max(int(n) - 1, 0) for r, n in enumerate(lens) if rows[r] == u) for u in set(rows)}
    pk = prefix._packing(torch.tensor(rows), args[2], args[3])
    assert pk.ids.shape[1] == max(real.values()) < 6 * 23
    assert int(pk.own.shape[0]) == len(real) and len(pk.sample) == sum(real.values())
    prompt_cache.clear()
    plain = forward_logprobs(policy, *args, temperature=0.7)
    shared = shared_logprobs(policy, *args, temperature=0.7, min_len=4, pad=TOK.pad_id)
    assert shared is not None and (shared - plain).abs().max() <= 1e-5
    (outs_a, grads_a) = _grads(policy, lambda: forward_logprobs_entropy(policy, *args, temperature=0.7, with_grad=True))
    (outs_b, grads_b) = _grads(policy, lambda: packed_logprobs_entropy(policy, *args, temperature=0.7, min_len=4))
    assert all((a - b).abs().max() <= 1e-5 for a, b in zip(outs_a, outs_b, strict=True))
    for a, b in zip(grads_a, grads_b, strict=True):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, float(a.abs().max()))


def test_a_mask_with_holes_keeps_every_column() -> None:
    """Padding is only left out of masks that are one run of 1s from the start; others keep the full width."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]])
    assert packing_cost.run_lengths(mask[:1]).tolist() == [1]
    assert packing_cost.run_lengths(mask).tolist() == [3, 3]


def test_cached_prompts_are_dropped_once_the_weights_change() -> None:
    """The prompt cache is keyed by module and emptied by `weights_changed`: a shared forward after an optimizer
    step or a weight load computes with the new weights (equal to the plain forward), not the cached prompts."""
    from flowrl.engines.prompt_cache import cache_of, weights_changed

    policy, args = _rollout("gpt2")
    prompt_cache.clear()
    first = shared_logprobs(policy, *args, min_len=4, pad=TOK.pad_id)
    assert first is not None and cache_of(policy).entries  # the prompts are cached
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    loss = -forward_logprobs(policy, *args, with_grad=True).sum()
    loss.backward()
    opt.step()  # the weights change in place
    weights_changed(policy)
    after = shared_logprobs(policy, *args, min_len=4, pad=TOK.pad_id)
    plain = forward_logprobs(policy, *args)
    assert after is not None and (after - plain).abs().max() <= 1e-5 and (after - first).abs().max() > 1e-3


def test_a_worker_marks_its_weights_changed_after_an_update_and_a_weight_load() -> None:
    """Every place flowrl changes weights says so: a ModelWorker's update and load_weights bump the version."""
    from flowrl.engines import prompt_cache as pc
    from flowrl.ir.graph import Loc, ModelDecl
    from flowrl.runtime.worker import ModelWorker

    decl = ModelDecl("actor", "policy", "tiny:gpt2", Loc("t.flow", 1, 1),
                     config={"layers": 1, "dim": 32, "heads": 2}, trainable=True, lr=1e-2)
    worker = ModelWorker([decl], [decl], seed=0)
    module = worker.models["actor"].module
    before = pc.cache_of(module).version
    worker.load_weights("actor", worker.weights("actor"))
    assert pc.cache_of(module).version == before + 1
