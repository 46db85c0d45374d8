"""The serverless backend (backends/serverless): the process backend's numbers with one instance per pool, pools
that hold no device slot between calls, the cost report from its instance tasks, asynchronous runs, and the
length-ranked assignment of prompts to instances."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

import flowrl
from flowrl.backends.serverless.group import ServerlessGroup
from flowrl.backends.serverless.instance import Build
from flowrl.ir.graph import Graph
from flowrl.runtime.batch import Batch

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]

def numbers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "cost/", "async/", "scale/", "migrate/", "fusion/",
                                                               "prefill/"))
             and k not in ("step_time_s", "tokens_per_s")} for r in rows]


@pytest.mark.parametrize("k", [0, 1], ids=["synchronous", "asynchronous"])
def test_one_instance_per_pool_gives_the_process_backends_numbers(tmp_path: Path, k: int, ray_session: Any, split_grpo: Callable[..., Graph]) -> None:
    """Weights move between the pools as versions in the object store; the numbers are the process backend's,
    so every instance ran with the weights the schedule names. Between calls no pool holds a slot."""
    graph = split_grpo(k=k)
    freed: list[int] = []

    def between_steps(step: int, row: dict[str, Any]) -> None:
        # Synchronously nothing of the run works between steps (it waits on this callback), so a task asking for
        # all four slots at once is scheduled the moment Ray has them all back: waiting on it waits on that
        # event. A pool still holding a slot would keep it from ever running (the bound only turns that hang
        # into a failure).
        ray_session.get(all_slots.remote(), timeout=300)
        freed.append(step)

    served = flowrl.run(graph, out_dir=tmp_path / "serverless", backend="serverless",
                        on_step=between_steps if k == 0 else None)
    fixed = flowrl.run(graph, out_dir=tmp_path / "process", backend="process")
    _same(numbers(served.metrics), numbers(fixed.metrics))
    if k == 0:
        assert freed == [1, 2, 3, 4]  # after every step all four slots came back: no pool holds one without work


@ray.remote(num_cpus=0, resources={"device_slot": 4})
def all_slots() -> None:
    """Runs only when every device slot of the test cluster is free."""


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-4), key


def test_the_cost_report_is_the_instance_tasks(tmp_path: Path, split_grpo: Callable[..., Graph]) -> None:
    res = flowrl.run(split_grpo(gen="2"), out_dir=tmp_path / "out", backend="serverless")
    events = [e for e in json.loads((tmp_path / "out" / "trace.json").read_text())["traceEvents"]
              if e.get("ph") == "X" and e["cat"] == "held"]
    for row in res.metrics:
        parts = row["cost/busy_s"] + row["cost/starting_s"] + row["cost/loading_s"] + row["cost/idle_s"]
        assert row["cost/held_s"] == pytest.approx(parts) and row["cost/lost_s"] == 0.0
        assert row["cost/held_s"] == pytest.approx(row["cost/gen/held_s"] + row["cost/train/held_s"])
        spans = [e for e in events if e["args"]["step"] == row["step"]]  # one span per instance task
        assert sum(e["dur"] for e in spans) / 1e6 == pytest.approx(row["cost/held_s"], abs=1e-4)
        assert row["cost/cold_starts"] + row["cost/warm_starts"] == len(spans)
    assert sum(r["cost/cold_starts"] for r in res.metrics) >= 2  # each pool built its models at least once
    assert sum(r["cost/warm_starts"] for r in res.metrics) > 0  # and reused them
    # the whole run: every step's row and what ran after the last one (the final checkpoint's task)
    assert res.cost["held_s"] > sum(r["cost/held_s"] for r in res.metrics)
    tracks = {e["tid"]: e["args"]["name"] for e in json.loads((tmp_path / "out" / "trace.json").read_text())[
        "traceEvents"] if e.get("ph") == "M" and e["name"] == "thread_name"}
    assert {tracks[e["tid"]] for e in events} == {"gen instances", "train instances"}  # flowrl timeline's rows


def test_generation_is_assigned_by_predicted_length() -> None:
    """Prompts sorted by their past response lengths go to instances in contiguous runs (short first), and the
    rollout comes back in the prompts' own order, each sample's group id naming its prompt."""
    group = ServerlessGroup("gen", "gen", Build((), (), 0, "cpu"), world=2, run_id="t")
    group.scaler.lengths.observe([10, 11, 12, 13], [40.0, 2.0, 30.0, 1.0])
    prompts = Batch(4, {}, {"prompt": ["a", "b", "c", "d"], "prompt_id": [10, 11, 12, 13]})
    args, world, order, _ = group.scaler.shards(("actor", prompts, {}))  # nothing measured yet: both instances
    assert world == 2 and order == [3, 1, 2, 0] and args[1].meta["prompt_id"] == [13, 11, 12, 10]
    # what the instances return, merged: 2 samples a prompt, group ids in the shuffled order
    gids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    rollout = Batch(8, {"group_id": gids, "response_mask": torch.ones(8, 2)},
                    {"prompt_id": [13, 13, 11, 11, 12, 12, 10, 10]})
    back = group.scaler.learn_and_restore(rollout, order)
    assert back.meta["prompt_id"] == [10, 10, 11, 11, 12, 12, 13, 13]
    assert back["group_id"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_an_instance_lost_mid_generation_is_replaced_and_the_step_ends_the_same(tmp_path: Path, split_grpo: Callable[..., Graph]) -> None:
    """The gen pool's 2nd generate call loses its instance's process before it runs: Ray runs the task again on
    another process with the same versions and seeds, and the run's numbers are those of a run that lost
    nothing. The lost attempt's device time is in the cost report (from its start to its retry's), as a lost
    instance and a cold start, and on the trace."""
    from flowrl.backends.serverless import ServerlessBackend

    graph = split_grpo()
    marker = tmp_path / "crashed"
    lost = flowrl.run(graph, out_dir=tmp_path / "lost", backend=ServerlessBackend(
        crash_on_call={"gen": ("generate", 2, str(marker))}))
    assert marker.exists()  # the instance really died (its process wrote its pid, then exited)
    whole = flowrl.run(graph, out_dir=tmp_path / "whole", backend="serverless")
    _same(numbers(lost.metrics), numbers(whole.metrics))
    assert [r["cost/lost_instances"] for r in lost.metrics] == [0.0, 1.0, 0.0, 0.0]
    assert lost.metrics[1]["cost/lost_s"] > 0 and lost.cost["lost_s"] == lost.metrics[1]["cost/lost_s"]
    assert all(r["cost/lost_s"] == 0.0 for r in whole.metrics)
    spans = [e for e in json.loads((tmp_path / "lost" / "trace.json").read_text())["traceEvents"]
             if e.get("ph") == "X" and e["cat"] == "held" and "(lost)" in e["name"]]
    assert [e["args"]["step"] for e in spans] == [2]
    row = lost.metrics[1]
    parts = row["cost/busy_s"] + row["cost/starting_s"] + row["cost/loading_s"] + row["cost/idle_s"]
    assert row["cost/held_s"] == pytest.approx(parts + row["cost/lost_s"])


def test_each_step_chooses_how_many_instances_generate(tmp_path: Path, split_grpo: Callable[..., Graph]) -> None:
    """Pool gen has 1..3 instances: the first generation uses all 3 (nothing measured yet); later ones take the
    argmin of the cost-weighted score over the logged candidates, and log predicted and measured T and C. The
    candidates are the counts that can run at once (1 up to the free slots: an instance released at the step's
    start holds its slot until it has returned, which on a loaded machine may be after the next generation is
    planned), so they are read from the row."""
    res = flowrl.run(split_grpo(gen="1..3"), out_dir=tmp_path / "out", backend="serverless")
    first, *later = res.metrics
    assert first["scale/gen/instances"] == 3 and "scale/gen/predicted_T_s" not in first
    for row in later:
        counts = [n for n in (1, 2, 3) if f"scale/gen/T_s@{n}" in row]
        assert counts == list(range(1, len(counts) + 1)) and counts  # 1..k, no gaps
        cands = {n: (row[f"scale/gen/T_s@{n}"], row[f"scale/gen/C_s@{n}"]) for n in counts}
        t_ref, c_ref = min(t for t, _ in cands.values()), min(c for _, c in cands.values())
        score = {n: 0.5 * t / t_ref + 0.5 * c / c_ref for n, (t, c) in cands.items()}
        best = min(score, key=lambda n: (score[n], n))
        assert row["scale/gen/instances"] == best
        assert (row["scale/gen/predicted_T_s"], row["scale/gen/predicted_C_s"]) == cands[best]
        assert row["scale/gen/measured_T_s"] > 0 and row["scale/gen/measured_C_s"] > 0


def test_without_placement_the_cost_report_has_a_pool_per_stage_kind(tmp_path: Path, split_grpo: Callable[..., Graph]) -> None:
    text = (tmp_path / "f.flow")
    split_grpo()
    text.write_text(text.read_text().split("placement")[0] + "run { steps = 2, seed = 5 }\n")
    res = flowrl.run(flowrl.load(str(text)), out_dir=tmp_path / "out", backend="serverless")
    assert {p["pool"] for p in res.cost["pools"]} == {"generation", "inference", "training", "setup"}
    for row in res.metrics:
        assert row["cost/held_s"] == pytest.approx(sum(row.get(f"cost/{k}/held_s", 0.0) for k in
                                                       ("generation", "inference", "training", "setup", "colocated")))


def test_prewarm_hides_a_cold_start(tmp_path: Path, split_grpo: Callable[..., Graph],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """keep_warm = false: every instance builds its models when it starts (a cold start). From step 2 on, the
    history says when the train pool's first call (the update) comes, so its instance is started ahead and is
    ready before the call: the update does not wait for the start. The history allows it by construction: the
    reward, which runs before the update, waits until a pre-warmed train instance is ready (an event); without
    pre-warming the update's instance starts cold when called. Same numbers either way."""
    import types

    from flowrl.backends.serverless import ServerlessBackend

    split_grpo()
    text = tmp_path / "f.flow"
    base = (text.read_text().replace("actor.update, ref -> train", "actor.update -> train\n    ref -> gen")
            .replace('"digits.reward"', '"prewarm_gate.reward"'))
    runs: dict[str, Any] = {}
    for mode in ("off", "on"):
        be = ServerlessBackend()

        def reward(prompt: str, response: str, be: ServerlessBackend = be, **_: Any) -> float:
            train = be.groups["train"]
            if train.prewarm.offsets and train.policy.prewarm:  # step 2 on: wait for the pre-warmed instance
                ray.get(train.mailbox.ready.remote(f"{train.key[0]}/train/"), timeout=300)
            return float(sum(c.isdigit() for c in response))

        monkeypatch.setitem(sys.modules, "prewarm_gate", types.SimpleNamespace(reward=reward))
        text.write_text(base.replace("max_staleness = 0", f"max_staleness = 0, keep_warm = false, prewarm = "
                                     f"{'true' if mode == 'on' else 'false'}"))
        runs[mode] = flowrl.run(flowrl.load(str(text)), out_dir=tmp_path / mode, backend=be)
    _same(numbers(runs["on"].metrics), numbers(runs["off"].metrics))
    for mode, res in runs.items():
        events = [e for e in json.loads((tmp_path / mode / "trace.json").read_text())["traceEvents"]
                  if e.get("ph") == "X" and e["cat"] == "held" and e["args"]["step"] >= 2]
        train = [e["name"] for e in events if e["tid"] == _track(tmp_path / mode, "train instances")]
        assert train and all("(cold)" in n for n in train)  # keep_warm = false: every start builds the models
        ready = [r["cost/prewarm_ready"] for r in res.metrics[1:]]
        if mode == "on":
            assert all("(pre-warmed)" in n for n in train) and ready == [1.0] * len(ready)
        else:
            assert not any("(pre-warmed)" in n for n in train) and ready == [0.0] * len(ready)
        for row in res.metrics:
            parts = row["cost/busy_s"] + row["cost/starting_s"] + row["cost/loading_s"] + row["cost/idle_s"]
            assert row["cost/held_s"] == pytest.approx(parts)


def _track(run: Path, name: str) -> int:
    return next(e["tid"] for e in json.loads((run / "trace.json").read_text())["traceEvents"]
                if e.get("ph") == "M" and e["name"] == "thread_name" and e["args"]["name"] == name)


def _long_grpo(split_grpo: Callable[..., Graph], tmp_path: Path, run: str = "", gen: str = "3") -> Graph:
    """The split GRPO flow with responses up to 24 tokens (an untrained model ends them at random lengths; the
    reference's forward is fused into generation: fuse-gen-inference)."""
    split_grpo(gen=gen, run=run)
    text = tmp_path / "f.flow"
    text.write_text(text.read_text().replace("max_tokens = 3", "max_tokens = 24"))
    return flowrl.load(str(text))


def test_a_source_hands_over_exactly_its_unfinished_sequences_and_the_sink_ends_them_as_without(
        tmp_path: Path, split_grpo: Callable[..., Graph]) -> None:
    """One instance's part run here: at tau = 0.5 the source returns the samples that finished and offers the
    rest (with their decoding state) to the sink's box: together exactly its samples, none twice. The sink
    resumes them with its own rows, and the tokens are those `generate` gives each shard without migration."""
    from flowrl.backends.serverless import migrate
    from flowrl.backends.serverless.instance import remote_mailbox
    from flowrl.runtime.chunks import assemble
    from flowrl.runtime.worker import ModelWorker

    graph = _long_grpo(split_grpo, tmp_path)
    attrs = dict(next(n for n in graph.nodes if n.op == "generate").attrs)
    worker = ModelWorker((graph.model("actor"),), graph.models, seed=5, device="cpu")
    # numbered in the step's batch as the controller numbers them: each row's random stream is keyed by its slot
    prompts = Batch(4, {}, {"prompt": ["1+2=", "3+3=", "0+1=", "2+2="], "prompt_id": [0, 1, 2, 3],
                            "prompt_slot": [0, 1, 2, 3]})
    source, sink = prompts.select([0, 1]), prompts.select([2, 3])
    mailbox = remote_mailbox.remote()
    cut = migrate.generate(worker, "actor", source, attrs, step_seed=11, first_prompt=0,
                           role=migrate.Role("m", 0.5), mailbox=mailbox)
    finished = sorted(int(s) for b in cut.chunks for s in b["sample"])
    assert cut.moved_out > 0 and len(finished) >= 0.5 * 8  # it cut at tau, with sequences left
    ((rank, word),) = ray.get(mailbox.take_all.remote("m"))
    tail = ray.get(word[0])
    moved = sorted(int(s) for s in tail.samples)
    assert len(moved) == cut.moved_out == 8 - len(finished)
    assert sorted(finished + moved) == list(range(8))  # exactly the unfinished ones, nothing lost or doubled

    for _ in range(2):  # a source retried after its process was lost offers its tail again: taken once
        mailbox.offer.remote("n", (rank, [ray.put(tail)]))
    own = migrate.generate(worker, "actor", sink, attrs, step_seed=12, first_prompt=2,
                           role=migrate.Role("n", 0.5, sources=1), mailbox=mailbox)
    assert (own.moved_out, own.moved_in) == (0, len(moved))
    whole = migrate.merge([cut.chunks, own.chunks], prompts)
    alone = [worker.generate("actor", source, attrs, step_seed=11), worker.generate("actor", sink, attrs,
                                                                                     step_seed=12)]
    expect = assemble([alone[0], alone[1]], [torch.arange(8), torch.arange(8, 16)])
    width = int(whole["response_mask"].sum(1).max())
    mask = whole["response_mask"][:, :width]
    assert torch.equal(mask, expect["response_mask"][:, :width])
    for key in ("response_ids", "gen_logp"):  # where the mask is 1 (padding differs: pad id vs 0)
        assert torch.allclose((whole[key][:, :width] * mask).float(), (expect[key][:, :width] * mask).float(),
                              atol=1e-6), key
    assert whole.meta["prompt_id"] == [i for i in range(4) for _ in range(4)]


def test_migration_gives_the_samples_of_a_run_without_it(tmp_path: Path, split_grpo: Callable[..., Graph]) -> None:
    """Three generation instances every step (scaling off): with migrate_at = 0.5 sources hand their tails to
    the sink, and the run's numbers are those with migrate_at = 1 (never)."""
    from flowrl.backends.serverless import ServerlessBackend

    moved = flowrl.run(_long_grpo(split_grpo, tmp_path, ", migrate_at = 0.5"), out_dir=tmp_path / "moved",
                       backend=ServerlessBackend(ablate={"scale"}))
    kept = flowrl.run(_long_grpo(split_grpo, tmp_path, ", migrate_at = 1.0"), out_dir=tmp_path / "kept",
                      backend=ServerlessBackend(ablate={"scale"}))
    assert sum(r["migrate/gen/moved"] for r in moved.metrics) > 0
    assert all("migrate/gen/moved" not in r for r in kept.metrics)
    _same(numbers(moved.metrics), numbers(kept.metrics))


@pytest.mark.parametrize("gen", ["1", "2"])
def test_a_fused_gen_infer_stage_is_streamed_by_the_pools(tmp_path: Path, split_grpo: Callable[..., Graph],
                                                          gen: str) -> None:
    """The reference's forward (pool train) is fused into generation (pool gen): the generation instances offer
    their chunks, one train instance runs the forward on each as it comes; the stage runs fused (run.json says
    nothing was unfused) and the numbers are the process backend's, which runs it through the rank-by-rank
    scheduler. With two generation instances (scaling off) both offer chunks to the one forward instance."""
    from flowrl.backends.serverless import ServerlessBackend

    graph = _long_grpo(split_grpo, tmp_path, ", migrate_at = 1.0", gen=gen)
    served = flowrl.run(graph, out_dir=tmp_path / "serverless", backend=ServerlessBackend(ablate={"scale"}))
    assert "unfused" not in json.loads((tmp_path / "serverless" / "run.json").read_text())
    assert all(r["fusion/chunks"] >= 1 and r["fusion/workers"] == float(gen) for r in served.metrics)
    # the forward instance starts with the first chunk until its slack was measured, then a share of it later
    # (Policy.late): the numbers below are the same either way
    assert served.metrics[0]["fusion/late_s"] == 0.0 and all(r["fusion/late_s"] >= 0.0 for r in served.metrics)
    for row in served.metrics:  # the forward's instance waited for chunks: idle, not busy
        parts = row["cost/busy_s"] + row["cost/starting_s"] + row["cost/loading_s"] + row["cost/idle_s"]
        assert row["cost/held_s"] == pytest.approx(parts)
    if gen == "1":
        fixed = flowrl.run(graph, out_dir=tmp_path / "process", backend="process")
        _same(numbers(served.metrics), numbers(fixed.metrics))
    else:  # the same two shards unfused: the same samples
        unfused = flowrl.load(str(tmp_path / "f.flow"), no_pass=("fuse-gen-inference",))
        whole = flowrl.run(unfused, out_dir=tmp_path / "unfused", backend=ServerlessBackend(ablate={"scale"}))
        _same(numbers(served.metrics), numbers(whole.metrics))


def test_a_forward_instance_takes_every_chunk_even_when_the_end_comes_first(tmp_path: Path,
                                                                            split_grpo: Callable[..., Graph]) -> None:
    """The Mailbox is an async actor: a generation instance's words may be taken out of order. Its last word
    counts its chunks, so a forward instance that reads the end before the chunks still runs on all of them."""
    from flowrl.backends.serverless import stream
    from flowrl.backends.serverless.instance import remote_mailbox
    from flowrl.runtime.chunks import ChunkForward
    from flowrl.runtime.worker import ModelWorker

    graph = _long_grpo(split_grpo, tmp_path)
    attrs = dict(next(n for n in graph.nodes if n.op == "generate").attrs)
    worker = ModelWorker((graph.model("actor"),), graph.models, seed=5, device="cpu")
    prompts = Batch(2, {}, {"prompt": ["1+2=", "3+3="], "prompt_id": [0, 1]})
    chunks = [b for b in worker.generate_stream("actor", prompts, attrs, step_seed=3) if isinstance(b, Batch)]
    assert len(chunks) >= 2
    mailbox = remote_mailbox.remote()
    ray.get(mailbox.offer.remote("s", ("end", len(chunks))))  # the end first, then the chunks
    for chunk in chunks:
        ray.get(mailbox.offer.remote("s", [ray.put(chunk)]))
    fwd = ChunkForward("old", "logprobs", "actor", {})
    outs, spans, busy = stream.consume(worker, [fwd], box="s", producers=1, mailbox=mailbox)
    got = sorted(int(s) for _, samples in outs["old"] for s in samples)
    assert got == sorted(int(s) for c in chunks for s in c["sample"]) and busy > 0 and "old" in spans


def _preamble_grpo(split_grpo: Callable[..., Graph], tmp_path: Path, dedup: str) -> Graph:
    """The long split GRPO flow on two generation instances, every prompt opening with the same 15 characters
    (16 tokens with BOS: the share-prefix pass's minimum), so prompts on both instances share a prefix."""
    _long_grpo(split_grpo, tmp_path, f', migrate_at = 1.0, dedup_prefill = "{dedup}"', gen="2")
    rows = [{"prompt": f"12+34+56+78+90={a}+{b}=", "answer": a + b} for a in range(4) for b in range(4)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return flowrl.load(str(tmp_path / "f.flow"))


def test_a_prefix_shared_across_instances_is_prefilled_once_and_handed_over(tmp_path: Path,
                                                                           split_grpo: Callable[..., Graph]) -> None:
    """dedup_prefill "handover": the first instance computes the common prefix once a step and offers its keys
    and values, the other takes them; "local": each instance computes it once for its prompts; "off": every
    prompt prefills it. The samples are the same (float rounding) in all three."""
    from flowrl.backends.serverless import ServerlessBackend

    runs = {mode: flowrl.run(_preamble_grpo(split_grpo, tmp_path, mode), out_dir=tmp_path / mode,
                             backend=ServerlessBackend(ablate={"scale"})) for mode in ("handover", "local", "off")}
    for row in runs["handover"].metrics:
        assert row["prefill/gen/prefixes"] == 1.0 and row["prefill/gen/handover"] == 1.0
        assert row["prefill/gen/computed_tokens"] == 16.0  # once, by the owner
        assert row["prefill/gen/handover_tokens"] == 16.0 and row["prefill/gen/handover_bytes"] > 0
        assert row["prefill/gen/saved_tokens"] == 4 * 16 - 16  # four prompts a step, one computation
    for row in runs["local"].metrics:
        assert row["prefill/gen/handover"] == 0.0 and row["prefill/gen/handover_tokens"] == 0.0
        assert row["prefill/gen/computed_tokens"] == 2 * 16  # once on each instance
    assert all(not any(k.startswith("prefill/") for k in row) for row in runs["off"].metrics)
    _same(numbers(runs["handover"].metrics), numbers(runs["off"].metrics))
    _same(numbers(runs["local"].metrics), numbers(runs["off"].metrics))


def test_the_prefill_plan_shares_a_prefix_across_the_step_and_learns_from_misses() -> None:
    """Driver side: prompts opening with one preamble on three instances -> the first computes it and offers it,
    the others take it; "local": each computes it; "auto" keeps handing over while the measured handover is
    cheaper than recomputing, and stops once it is not (a taker that gave up on its owner counts as its wait)."""
    from flowrl.backends.serverless import prefill
    from flowrl.elastic import PrefillRates
    from flowrl.models.tokenizer import CharTokenizer
    from flowrl.runtime.worker import PromptEncoder

    encoder = PromptEncoder(CharTokenizer("0123456789+="), 512)
    texts = ["12+34+56+78+90=" + q for q in ("1+1=", "2+2=", "3+3=", "4+4=", "5+")] + ["7=", "8="]
    sizes = [2, 2, 3]  # the last instance also holds two prompts without the preamble
    measured = PrefillRates()
    shares, decided = prefill.plan_shares(encoder, texts, 8, 16, sizes, "handover", measured, "b", None)
    pre = tuple(encoder.ids(texts[:1], 8)[0][:16])  # BOS and the 15 characters
    assert [(s.compute, s.offer, s.take) for s in shares] == [((pre,), (pre,), ()), ((), (), ((0, (pre,)),)),
                                                              ((), (), ((0, (pre,)),))]
    assert [s.skipped for s in shares] == [2 * 16, 2 * 16, 16] and decided["handover"] == 1.0
    shares, _ = prefill.plan_shares(encoder, texts, 8, 16, sizes, "local", measured, "b", None)
    assert [(s.compute, s.take) for s in shares] == [((pre,), ()), ((pre,), ()), ((pre,), ())]

    def stats(prefill_s: float = 0.0, handover_s: float = 0.0, missed: float = 0.0) -> dict[str, float]:
        return {"prefill_s": prefill_s, "prefill_tokens": 16.0 if prefill_s else 0.0, "handover_s": handover_s,
                "handover_tokens": 16.0 if handover_s and not missed else 0.0, "handover_missed": missed}

    measured.learn([stats(prefill_s=0.016), stats(handover_s=0.004)])  # 1 ms a token; handed over in 4 ms
    shares, decided = prefill.plan_shares(encoder, texts, 8, 16, sizes, "auto", measured, "b", None)
    assert decided == {**decided, "handover": 1.0, "recompute_est_s": pytest.approx(0.016)}
    assert shares[1].take and shares[1].patience_s == pytest.approx(0.016)  # never waits longer than recomputing
    measured.learn([stats(prefill_s=0.016), stats(handover_s=0.060, missed=1.0)])  # gave up, then computed it
    shares, decided = prefill.plan_shares(encoder, texts, 8, 16, sizes, "auto", measured, "b", None)
    assert decided["handover"] == 0.0 and decided["handover_est_s"] == pytest.approx(0.032)
    assert [s.take for s in shares] == [(), (), ()]


def test_only_a_group_that_trains_a_model_loads_its_optimizer_state(split_grpo: Callable[..., Graph],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An update's weights and optimizer state are two objects; an instance of the group that trains the model
    loads both (its next update continues the optimizer), a generation instance the weights alone."""
    from flowrl.backends.serverless import instance
    from flowrl.runtime.worker import ModelWorker

    graph = split_grpo()
    given: list[Any] = []
    monkeypatch.setattr(ModelWorker, "load_state_dict", lambda self, state: given.append(state["actor"]))
    weights = ray.put({"actor": {"module": {"w": torch.ones(2)}, "optim": None}})
    optim = ray.put({"actor": {"state": {"exp_avg": torch.zeros(2)}}})
    for trains, expect in (((), None), (("actor",), {"state": {"exp_avg": torch.zeros(2)}})):
        build = Build((graph.model("actor"),), graph.models, 0, "cpu", trains=trains)
        instance._ready(("t", f"g{len(given)}"), build, {"actor": (7, [weights, "actor", optim])})
        assert str(given[-1]["optim"]) == str(expect) and torch.equal(given[-1]["module"]["w"], torch.ones(2))
    instance._CACHE.clear()


def test_a_take_left_waiting_on_a_box_returns_when_the_box_closes() -> None:
    """A taker that gave up on its owner leaves its take waiting in the Mailbox; closing the box (the
    generation returned) ends it with no words instead of leaving it waiting for the rest of the run."""
    from flowrl.backends.serverless.instance import remote_mailbox

    mailbox = remote_mailbox.remote()
    waiting = [mailbox.take_all.remote("p", 0), mailbox.take_all.remote("p", 0)]
    mailbox.close.remote("p")  # whether it runs before the takes or after them: they end with no words
    assert ray.get(waiting, timeout=120) == [[], []]
    ray.get(mailbox.offer.remote("q", "word"))
    ray.get(mailbox.close.remote("q"))
    assert ray.get(mailbox.take_all.remote("q", 0), timeout=120) == []  # a late take of a closed box: no wait
