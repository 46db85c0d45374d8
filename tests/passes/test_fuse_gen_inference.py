"""fuse-gen-inference: when it fuses, each refusal, idempotence, and equal numbers with and without it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import flowrl.dsl
from flowrl.backends.local import LocalBackend
from flowrl.backends.threads import ThreadBackend
from flowrl.engines.chunked_generation import GenChunk, Sampling, Tail, generate_stream, resume_stream
from flowrl.engines.generation import generate
from flowrl.ir.graph import Graph
from flowrl.models.build import ModelSpec, build_model
from flowrl.models.tokenizer import ByteTokenizer
from flowrl.passes.fuse_gen_inference import fuse_gen_inference
from flowrl.runtime.batch import Batch
from flowrl.runtime.chunks import assemble

from .conftest import MODEL, SPLIT, GroupProxy, assert_same_numbers, passes, run_steps

FUSED = ("rollout", "old_logp", "ref_logp", "values", "scores")


def fused(g: Graph) -> list[str]:
    return [n.id for n in g.nodes if n.attrs.get("fusion") == "gen-infer:rollout"]


def test_fuses_generation_with_the_forwards_over_its_rollout(ppo: Callable[..., Graph]) -> None:
    g, notes = fuse_gen_inference(ppo(n=4, batch=4, placement=SPLIT))
    assert fused(g) == list(FUSED)
    gen = g.node("rollout")
    assert (gen.attrs["fusion_kind"], gen.attrs["stream_chunk"], gen.attrs["migrate_below"]) == ("inter-stage", 4, 0.2)
    assert all(g.node(i).attrs["fusion_kind"] == "inter-stage" for i in FUSED)
    assert gen.attrs["flush_steps"] == 8 and gen.attrs["chunk_forwards"] == "own-rank"
    assert "partial_below" not in gen.attrs  # the score-tail pass's (off by default)
    assert notes == ["rollout: streams chunks of 4 finished samples (or what finished within 8 decode steps) to "
                     "ref_logp, values, scores on worker group infer, which score them while gen decodes; old_logp "
                     "run on each generating rank between its decode steps (own-rank), the tail migrating below 20% "
                     "unfinished when forwards are queued for freed ranks"]


NO_FORWARDS = f"""
model actor : policy {{ {MODEL} }}
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("data.jsonl") {{ batch = 4 }}
step {{
    rollout = actor.generate(prompts, n = 4, max_tokens = 16)
    scores  = correct(rollout)
    adv     = group_advantage(scores, group = 4)
    actor.update(rollout, advantages = adv)
}}
"""
UPDATE_FIRST = """actor.update(rollout, old_logp = old_logp, ref_logp = ref_logp, advantages = adv)
    late = actor.logprobs(rollout)
    critic.update(rollout, values = values, returns = adv)"""


def _already_fused(g: Graph) -> Graph:
    return g.with_nodes([n.with_attrs(fusion="mine") if n.id == "values" else n for n in g.nodes])


GEN_REFUSALS: list[tuple[str, dict[str, Any], str]] = [
    ("engine", dict(actor_extra=', engine = "vllm"', placement=SPLIT),
     "rollout: not fused: actor uses engine 'vllm', which cannot hand samples over as they finish"),
    ("short responses", dict(max_tokens=8, placement=SPLIT),
     "rollout: not fused: max_tokens = 8 < 16: samples finish too close together to stream"),
    ("no forwards", dict(text=NO_FORWARDS), "rollout: not fused: no logprobs/values/score call reads it, nor a reward with workers of its own"),
    ("colocated", {}, "rollout: not fused: old_logp, ref_logp, values, scores run on worker group colocated, which "
     "generates, so nothing would run beside generation (place them on another pool in a `placement { }` block "
     "to overlap them with it)"),
]


@pytest.mark.parametrize(("build", "note"), [r[1:] for r in GEN_REFUSALS], ids=[r[0] for r in GEN_REFUSALS])
def test_refuses_the_rollout(ppo: Callable[..., Graph], build: dict[str, Any], note: str) -> None:
    g = ppo(**build)
    out, notes = fuse_gen_inference(g)
    assert out == g and notes == [note]


FORWARD_REFUSALS: list[tuple[str, dict[str, Any], Callable[[Graph], Graph], str, str]] = [
    ("engine", dict(critic_extra=', engine = "deepspeed"', placement=SPLIT), lambda g: g, "values",
     "values: not fused with rollout: critic uses engine 'deepspeed'"),
    ("updated before", dict(body=UPDATE_FIRST, placement=SPLIT), lambda g: g, "late",
     "late: not fused with rollout: actor.update runs before it, so it needs the updated weights"),
    ("already fused", dict(placement=SPLIT), _already_fused, "values",
     "values: not fused with rollout: already fused in mine"),
]


@pytest.mark.parametrize(("build", "edit", "node", "note"), [r[1:] for r in FORWARD_REFUSALS],
                         ids=[r[0] for r in FORWARD_REFUSALS])
def test_refuses_one_forward_and_fuses_the_rest(ppo: Callable[..., Graph], build: dict[str, Any],
                                                edit: Callable[[Graph], Graph], node: str, note: str) -> None:
    g, notes = fuse_gen_inference(edit(ppo(**build)))
    assert node not in fused(g) or g.node(node).attrs.get("fusion") == "mine"
    assert set(fused(g)) == set(FUSED) - {node}
    assert notes[0] == note


def test_idempotent(ppo: Callable[..., Graph]) -> None:
    once = passes(ppo(placement=SPLIT), "fuse-gen-inference")
    twice = passes(once, "fuse-gen-inference")
    assert twice.nodes == once.nodes and [p.changed for p in twice.passes] == [True, False]


# -- the runtime: engines/chunked_generation.py and runtime/gen_infer/ -------------------------------------------

TOK = ByteTokenizer()
PROMPTS = [[TOK.bos_id, *TOK.encode(s)] for s in ["hello world", "hi", "a somewhat longer prompt", "xyz"]]


def _policy(family: str) -> Any:
    module: Any = build_model(ModelSpec(f"tiny:{family}", {"layers": 2, "dim": 32, "heads": 2}), seed=0).module
    bias = torch.zeros(module.config.vocab_size)
    bias[TOK.eos_id] = 2.5  # random tiny models rarely stop: make lengths vary within a few steps
    module.get_output_embeddings().register_forward_hook(lambda _m, _i, out: out + bias)
    return module


def _place(out: dict[str, torch.Tensor], item: GenChunk) -> None:
    width = item.response_ids.shape[1]
    out["ids"][item.samples, :width] = item.response_ids
    out["lp"][item.samples, :width] = item.logprobs
    out["mask"][item.samples, :width] = item.response_mask


def _empty(rows: int, width: int) -> dict[str, torch.Tensor]:
    return {"ids": torch.full((rows, width), TOK.pad_id), "lp": torch.zeros(rows, width),
            "mask": torch.zeros(rows, width, dtype=torch.long)}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9, min_tokens=3)])
def test_a_stream_yields_exactly_the_samples_of_generate(family: str, kw: dict[str, Any]) -> None:
    module = _policy(family)
    ref = generate(module, TOK, PROMPTS, n=4, max_tokens=30, generator=torch.Generator().manual_seed(3), **kw)
    sampling = Sampling(30, kw.get("min_tokens", 0), kw["temperature"], kw.get("top_p", 1.0))
    got = _empty(16, ref.response_ids.shape[1])
    chunks = list(generate_stream(module, TOK, PROMPTS, n=4, sampling=sampling, chunk=3,
                                  generator=torch.Generator().manual_seed(3)))
    assert len(chunks) > 2
    for item in chunks:
        assert isinstance(item, GenChunk)
        _place(got, item)
    assert torch.equal(got["ids"], ref.response_ids) and torch.equal(got["lp"], ref.logprobs)
    assert torch.equal(got["mask"], ref.response_mask)


def test_flush_hands_partial_chunks_over_every_few_steps_with_the_same_samples() -> None:
    """`flush = 2`: whatever finished goes out two decode steps after the last hand-over, full chunk or not."""
    module, sampling = _policy("gpt2"), Sampling(30, 0, 1.0, 1.0)
    ref = generate(module, TOK, PROMPTS, n=4, max_tokens=30, generator=torch.Generator().manual_seed(3))
    items = [list(generate_stream(module, TOK, PROMPTS, n=4, sampling=sampling, chunk=100, flush=flush,
                                  generator=torch.Generator().manual_seed(3))) for flush in (0, 2)]
    assert len(items[0]) == 1 and len(items[1]) > 2  # a chunk of 100 never fills: one hand-over without flush
    got = _empty(16, ref.response_ids.shape[1])
    for item in items[1]:
        assert isinstance(item, GenChunk)
        _place(got, item)
    assert torch.equal(got["ids"], ref.response_ids) and torch.equal(got["lp"], ref.logprobs)


def test_unfinished_samples_go_out_as_they_grow_and_again_when_they_finish() -> None:
    """`partial = 0.5`: once at most half the rows still decode, their responses so far go out every `flush`
    steps (final = False), each a prefix of the sample that finishes later; the finished samples are unchanged."""
    module, sampling = _policy("gpt2"), Sampling(30, 0, 1.0, 1.0)
    ref = generate(module, TOK, PROMPTS, n=4, max_tokens=30, generator=torch.Generator().manual_seed(3))
    items = list(generate_stream(module, TOK, PROMPTS, n=4, sampling=sampling, chunk=100, flush=2, partial=0.5,
                                 generator=torch.Generator().manual_seed(3)))
    live = [i for i in items if isinstance(i, GenChunk) and not i.final]
    assert len(live) >= 2 and all(0 < i.samples.numel() <= 8 for i in live)
    got = _empty(16, ref.response_ids.shape[1])
    for item in items:
        assert isinstance(item, GenChunk)
        if item.final:
            _place(got, item)
    assert torch.equal(got["ids"], ref.response_ids) and torch.equal(got["lp"], ref.logprobs)
    for item in live:  # a prefix of the finished sample, one token longer than its last hand-over at least
        width = item.response_ids.shape[1]
        assert torch.equal(item.response_ids * item.response_mask, ref.response_ids[item.samples, :width]
                           * item.response_mask)
        assert bool((item.response_mask.sum(1) < ref.response_mask[item.samples].sum(1)).all())


class _ExportAfter:
    def __init__(self, steps: int):
        self.steps, self.seen = steps, 0

    def progress(self, remaining: int) -> None:
        self.seen += 1

    def should_export(self) -> bool:
        return self.seen >= self.steps


@pytest.mark.parametrize("after", [1, 5])
def test_migrated_tails_resumed_together_sample_what_each_rank_would(after: int) -> None:
    module, sampling = _policy("gpt2"), Sampling(40, 0, 1.0, 1.0)
    shards = [PROMPTS[:2], PROMPTS[2:]]
    want = _empty(16, 40)
    for r, shard in enumerate(shards):  # unfused: each rank generates its shard to the end
        out = generate(module, TOK, shard, n=4, max_tokens=40, generator=torch.Generator().manual_seed(10 + r))
        width = out.response_ids.shape[1]
        want["ids"][8 * r : 8 * r + 8, :width], want["lp"][8 * r : 8 * r + 8, :width] = out.response_ids, out.logprobs
    got, tails = _empty(16, 40), []
    for r, shard in enumerate(shards):
        for item in generate_stream(module, TOK, shard, n=4, sampling=sampling, chunk=2, first_sample=8 * r,
                                    generator=torch.Generator().manual_seed(10 + r), control=_ExportAfter(after + r)):
            if isinstance(item, Tail):
                tails.append(item)
            else:
                _place(got, item)
    assert len(tails) == 2 and tails[0].mask.shape[1] != tails[1].mask.shape[1]  # different cache widths
    for item in resume_stream(module, TOK, tails, sampling=sampling, chunk=2):
        assert isinstance(item, GenChunk)
        _place(got, item)
    assert torch.equal(got["ids"], want["ids"])
    assert (got["lp"] - want["lp"]).abs().max() <= 1e-5


def test_assemble_restores_sample_order_and_padding() -> None:
    def chunk(samples: list[int], width: int) -> Batch:
        size = len(samples)
        return Batch(size, {"response_ids": torch.ones(size, width, dtype=torch.long),
                            "prompt_ids": torch.ones(size, 2, dtype=torch.long),
                            "sample": torch.tensor(samples), "pad": torch.full((size,), 9)},
                     {"response": [str(s) for s in samples]})

    parts = [chunk([2, 0], 1), chunk([1], 3)]
    out = assemble(parts, [p["sample"] for p in parts])
    assert out.meta["response"] == ["0", "1", "2"] and set(out.tensors) == {"response_ids", "prompt_ids"}
    assert out["response_ids"].tolist() == [[1, 9, 9], [1, 1, 1], [1, 9, 9]]


def test_a_run_computes_the_same_numbers_with_and_without_it(ppo: Callable[..., Graph]) -> None:
    g = ppo(n=4, batch=4, placement=SPLIT)
    on = run_steps(passes(g, "fuse-gen-inference"), backend=ThreadBackend(1))
    assert on[0].metrics["fusion/chunks"] >= 2 and on[0].metrics["fusion/workers"] == 1
    assert_same_numbers(on, run_steps(passes(g)))


def test_the_local_backend_runs_the_stage_unfused(ppo: Callable[..., Graph]) -> None:
    """Every group in the controller's process: another group is no worker beside generation, so the stage's
    members run one by one (chunked forwards would only take turns with decoding)."""
    g = ppo(n=4, batch=4, placement=SPLIT)
    on = run_steps(passes(g, "fuse-gen-inference"))
    assert all(r.metrics["fusion/fallback"] == 1.0 and "fusion/chunks" not in r.metrics for r in on)
    assert_same_numbers(on, run_steps(passes(g)))


@pytest.mark.parametrize("where", ["own-rank", "free-rank"])
def test_two_ranks_migrate_the_tail_and_compute_the_same_numbers(ppo: Callable[..., Graph], where: str) -> None:
    g = passes(ppo(n=4, batch=4, placement=SPLIT), "fuse-gen-inference")
    assert g.node("rollout").attrs["chunk_forwards"] == "own-rank"
    eager = g.with_nodes([n.with_attrs(migrate_below=0.9, chunk_forwards=where) if n.id == "rollout" else n
                          for n in g.nodes])
    on = run_steps(eager, backend=ThreadBackend(2))
    assert all(r.metrics["fusion/workers"] == 2 for r in on)
    migrated = sum(r.metrics["fusion/migrated"] for r in on)
    inline = sum(r.metrics["fusion/inline_chunks"] for r in on)
    if where == "own-rank":  # each rank scores its own chunks: nothing queued, so the tail stays put
        assert inline > 0 and migrated == 0
    else:  # chunks queue for free ranks (whether rows move depends on how many are left when it fires, which
        # depends on thread timing; the hand-over itself is tested deterministically above)
        assert inline == 0
    assert_same_numbers(on, run_steps(passes(ppo(n=4, batch=4, placement=SPLIT)), backend=ThreadBackend(2)))


class _RemoteLike(ThreadBackend):
    """Ranks the scheduler cannot drive one by one (no `on_rank`): the stage must run unfused."""

    def start(self, graph: Graph, *, seed: int, device: str) -> dict[str, Any]:
        groups = super().start(graph, seed=seed, device=device)
        return {name: _NoRanks(g) for name, g in groups.items()}


class _NoRanks(GroupProxy):
    def __init__(self, inner: Any):
        super().__init__(inner)
        self.per_rank, self.why_not_per_rank = False, "a test group without per-rank calls"


def test_a_group_that_cannot_stream_runs_the_stage_unfused(ppo: Callable[..., Graph]) -> None:
    g = ppo(n=4, batch=4, placement=SPLIT)
    on = run_steps(passes(g, "fuse-gen-inference"), steps=1, backend=_RemoteLike(2))
    assert on[0].metrics["fusion/fallback"] == 1.0
    assert_same_numbers(on, run_steps(passes(g), steps=1, backend=ThreadBackend(2)))


@pytest.mark.slow  # spawns two rank processes (~10 s of imports)
def test_process_ranks_stream_migrate_and_train_data_parallel(ppo: Callable[..., Graph]) -> None:
    """Two spawned rank processes (streams and export requests over pipes, gloo all-reduce in the update)
    compute what two in-process ranks compute."""
    from flowrl.backends.process import ProcessBackend

    g = passes(ppo(n=4, batch=4, placement=SPLIT), "fuse-gen-inference", "fuse-train")
    eager = g.with_nodes([n.with_attrs(migrate_below=0.9, chunk_forwards="free-rank") if n.id == "rollout" else n
                          for n in g.nodes])
    on = run_steps(eager, steps=2, backend=ProcessBackend(2))
    assert on[0].metrics["fusion/workers"] == 2
    assert_same_numbers(on, run_steps(passes(ppo(n=4, batch=4, placement=SPLIT)), steps=2,
                                      backend=ThreadBackend(2)))



class _GenGate(LocalBackend):
    """The local backend, where the "infer" group's forwards wait until the "gen" group's stream is over: a
    scheduler that ran those forwards on the generating thread would stall generation (the wait times out)."""

    def __init__(self) -> None:
        self.over = threading.Event()
        self.waited: list[bool] = []  # per infer call: whether generation ended within the wait

    def start(self, graph: Graph, *, seed: int, device: str) -> dict[str, Any]:
        groups = super().start(graph, seed=seed, device=device)
        self.infer = _Waits(groups["infer"], self)
        return {"gen": _Streams(groups["gen"], self.over), "infer": self.infer}


class _Streams(GroupProxy):
    """The in-process group driven from a rank thread of the scheduler, as a group beside the controller is."""

    def __init__(self, inner: Any, over: threading.Event):
        super().__init__(inner)
        self.inline, self.over = False, over

    def on_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        out = self.inner.call(method, *args, **kwargs).result()
        if method != "generate_stream":
            return out
        self.over.clear()
        return self._watch(out)

    def _watch(self, stream: Any) -> Any:
        yield from stream
        self.over.set()


class _Waits(GroupProxy):
    def __init__(self, inner: Any, gate: _GenGate):
        super().__init__(inner)
        self.inline, self.gate = False, gate
        self.calls: list[str] = []

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method in ("logprobs", "values", "score"):
            self.calls.append(method)
            self.gate.waited.append(self.gate.over.wait(timeout=GUARD_S))
        return self.inner.call(method, *args, **kwargs)


def test_forwards_on_another_group_run_while_generation_goes_on(ppo: Callable[..., Graph]) -> None:
    """Split placement: the forwards of ref, critic and rm (pool "infer") are sent to their group chunk by chunk
    from a thread of their own, so generation never waits for them; same numbers as unfused."""
    split = ppo(n=4, batch=4, placement=SPLIT)
    assert {w.name for w in split.worker_groups} == {"gen", "infer"}
    fused_g = passes(split, "fuse-gen-inference")
    assert fused_g.node("rollout").attrs["flush_steps"] == 8
    gate = _GenGate()
    on = run_steps(fused_g, steps=1, backend=gate)
    assert on[0].metrics["fusion/chunks"] >= 3
    assert gate.waited and all(gate.waited)  # no forward of "infer" held generation up
    # The first call waited for the end of generation, so every later chunk had queued: one call per forward
    # took all of them (three forwards: at most two calls each, where chunk by chunk would take 3 x chunks).
    assert len(gate.infer.calls) <= 6 < 3 * on[0].metrics["fusion/chunks"]
    on = run_steps(fused_g, steps=2, backend=_GenGate())
    assert_same_numbers(on, run_steps(passes(split), steps=2))
    two = run_steps(fused_g, steps=2, backend=ThreadBackend(2))
    assert_same_numbers(two, run_steps(passes(split), steps=2, backend=ThreadBackend(2)))


@pytest.mark.parametrize("world", [1, 2])
def test_the_other_group_scores_samples_while_they_decode_with_the_same_numbers(
        ppo: Callable[..., Graph], world: int) -> None:
    """score-tail: the unfinished samples' tokens go to the "infer" group as they are decoded, which keeps
    each sample's cache (on its rank sample % world) and finishes it with its last tokens; same numbers."""
    split = ppo(n=4, batch=4, max_tokens=24, placement=SPLIT)
    g = passes(split, "fuse-gen-inference", "score-tail")
    assert g.node("rollout").attrs["partial_below"] == 0.25
    eager = g.with_nodes([n.with_attrs(partial_below=1.0, flush_steps=2) if n.id == "rollout" else n
                          for n in g.nodes])
    on = run_steps(eager, steps=2, backend=ThreadBackend(world))
    assert all(r.metrics["fusion/grown"] > 0 and r.metrics["fusion/partials"] >= 2 for r in on)
    assert_same_numbers(on, run_steps(passes(split), steps=2, backend=ThreadBackend(world)))


DISAGGREGATED = """
placement {
    pool rollout { gpus = 1 }
    pool train   { gpus = 1 }
    actor.generate -> rollout
    actor.update, ref, critic, rm -> train
}
"""


@pytest.mark.slow  # spawns two rank processes (~10 s of imports)
def test_process_groups_of_a_split_placement_sync_weights_and_stream_to_the_other_pool(
        ppo: Callable[..., Graph]) -> None:
    """Generation on one pool, everything else on another, each a rank process: the trained actor reaches the
    rollout pool after every update (`ProcessBackend.after_update`), and the train pool scores chunks while the
    rollout pool decodes; the numbers are those of the local backend, where both pools share one actor."""
    from flowrl.backends.process import ProcessBackend

    path = Path(ppo(n=4, batch=4).path)
    path.write_text(path.read_text() + DISAGGREGATED)
    split = flowrl.dsl.load(path)
    assert [(w.name, w.models) for w in split.worker_groups] == [("rollout", ("actor",)),
                                                                   ("train", ("actor", "ref", "critic", "rm"))]
    local = run_steps(passes(split), steps=3)
    tail = passes(split, "fuse-gen-inference", "score-tail")
    tail = tail.with_nodes([n.with_attrs(partial_below=1.0, flush_steps=2) if n.id == "rollout" else n
                            for n in tail.nodes])  # samples cross the pipe as they grow
    for graph in (passes(split, "fuse-gen-inference"), tail, passes(split)):
        assert_same_numbers(run_steps(graph, steps=3, backend=ProcessBackend(1)), local)


def _disaggregated(ppo: Callable[..., Graph]) -> Graph:
    path = Path(ppo(n=4, batch=4).path)
    path.write_text(path.read_text() + DISAGGREGATED)
    return flowrl.dsl.load(path)


def test_a_forward_of_the_generating_model_on_another_group_spills_to_it(ppo: Callable[..., Graph]) -> None:
    """old_logp (the actor's) on the train pool may be taken by the rollout pool, which holds the same actor
    weights, once it is done generating; the other models' forwards cannot; colocated with generation (SPLIT:
    actor -> gen) it already runs on the generating ranks."""
    g, notes = fuse_gen_inference(_disaggregated(ppo))
    assert {n.id: n.attrs.get("spill_to") for n in g.nodes if n.id in FUSED[1:]} == \
        {"old_logp": "rollout", "ref_logp": None, "values": None, "scores": None}
    assert notes[0].endswith("; once done generating, rollout takes the chunks still queued for old_logp (it holds "
                             "the same actor weights)")
    split, _ = fuse_gen_inference(ppo(n=4, batch=4, placement=SPLIT))
    assert not any("spill_to" in n.attrs for n in split.nodes)
    assert fuse_gen_inference(g)[0] == g


class _Spill(LocalBackend):
    """The local backend with the disaggregated pools, arranged so that a generation rank must take a chunk of
    old_logp: the train pool's first old_logp call (on the stream's first chunk alone: the rollout pool holds its
    second chunk back until that call has begun) waits until the rollout pool has taken one, so the chunks that
    finish meanwhile stay queued, and the rollout pool, once done generating, takes them. No timing decides it:
    the waits are on events (with a guard that fails the test instead of hanging it). The rollout pool streams
    from a thread per rank (`on_rank`) or, a plain in-process group, on the stage's own thread."""

    def __init__(self, threads: bool):
        self.threads = threads
        self.began, self.taken = threading.Event(), threading.Event()

    def start(self, graph: Graph, *, seed: int, device: str) -> dict[str, Any]:
        groups = super().start(graph, seed=seed, device=device)
        return {"rollout": _HoldsSecondChunk(groups["rollout"], self, inline=not self.threads),
                "train": _WaitsForTake(groups["train"], self)}


class _HoldsSecondChunk(GroupProxy):
    def __init__(self, inner: Any, spill: _Spill, inline: bool):
        super().__init__(inner)
        self.spill, self.inline = spill, inline

    def on_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "logprobs" and args[0] == "actor":  # a generation rank runs old_logp: it took a chunk
            self.spill.taken.set()
        if method == "generate_stream":  # a new stage: its own first old_logp call waits for its own take
            self.spill.began.clear()
            self.spill.taken.clear()
        out = self.inner.on_rank(rank, method, *args, **kwargs)
        return self._hold(out) if method == "generate_stream" else out

    def _hold(self, stream: Any) -> Any:
        chunks = 0
        for item in stream:
            if isinstance(item, Batch) and chunks == 1:
                assert self.spill.began.wait(timeout=GUARD_S), "the train pool never started on old_logp"
            chunks += isinstance(item, Batch)
            yield item


class _WaitsForTake(GroupProxy):
    def __init__(self, inner: Any, spill: _Spill):
        super().__init__(inner)
        self.inline, self.spill = False, spill

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "logprobs" and args[0] == "actor" and not self.spill.began.is_set():
            self.spill.began.set()
            assert self.spill.taken.wait(timeout=GUARD_S), "no generation rank took a queued old_logp chunk"
        return self.inner.call(method, *args, **kwargs)


GUARD_S = 120  # only ever reached when the behaviour under test is broken


@pytest.mark.parametrize("threads", [True, False], ids=["rank-threads", "in-process"])
def test_the_generation_pool_takes_queued_chunks_of_its_model_with_the_same_numbers(
        ppo: Callable[..., Graph], threads: bool) -> None:
    split = _disaggregated(ppo)
    on = run_steps(passes(split, "fuse-gen-inference"), steps=2, backend=_Spill(threads))
    assert all("fusion/fallback" not in r.metrics for r in on)
    assert all(r.metrics["fusion/chunks"] >= 3 and r.metrics["fusion/taken"] >= 1 for r in on)
    assert_same_numbers(on, run_steps(passes(split), steps=2))
