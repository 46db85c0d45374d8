"""A fused gen-infer stage streamed between serverless pools, the driver's side (`ServerlessGroup.stream_stage`;
the instances' side is stream.py, and migrate.py's `generate` on the generation instances).

The generating pool starts its generation instances (cut-and-migrate and the deduplicated prefill as in a plain
generation), each running the forwards placed on its own group on every chunk and offering the chunk to the
stage's box; one instance of each other group holding forwards of the stage (`stream.consume`) starts with the
first chunk, or a share of the stage's learned slack later (flowrl.elastic.late), and takes the chunks as they
come. Every output goes back in sample order, as the unfused stage computes it. The stage runs only where all of
its instances can hold a device at once (they wait on one another); else the controller runs it unfused.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import ray

from flowrl.backends.serverless import migrate, stream
from flowrl.backends.serverless.scaling import in_order
from flowrl.ir.graph import Node
from flowrl.runtime import dispatch
from flowrl.runtime.batch import Batch
from flowrl.runtime.chunks import ChunkForward, assemble
from flowrl.runtime.env_rollout import env_spec_of
from flowrl.runtime.protocol import StreamedStage, WorkerGroup

if TYPE_CHECKING:  # the group imports this module to run its stage
    from flowrl.backends.serverless.group import ServerlessGroup

Outputs = dict[str, list[tuple[Batch, Any]]]  # forward node -> [(its output on a chunk, the chunk's samples)]


def chunk_forward(node: Node) -> ChunkForward:
    return ChunkForward(node.id, str(node.op), str(node.model), dict(node.attrs))


def _gather(outs: Outputs, spans: dict[str, tuple[float, float]], more: Mapping[str, list[tuple[Batch, Any]]],
            more_spans: Mapping[str, tuple[float, float]]) -> None:
    for node, got in more.items():
        outs.setdefault(node, []).extend(got)
    for node, (a, b) in more_spans.items():
        old = spans.get(node)
        spans[node] = (a, b) if old is None else (min(old[0], a), max(old[1], b))


def stream_stage(group: ServerlessGroup, gen: Node, forwards: Sequence[Node], prompts: Batch, seed: int,
                 others: Mapping[str, WorkerGroup]) -> StreamedStage | None:
    """Generation on `group`'s instances, each running its own group's forwards on its chunks and offering every
    chunk to one instance of each other serverless group with forwards of the stage -> the stage, or None where
    it does not stream (multi-turn, another backend's group, too few devices for all of its instances at once)."""
    from flowrl.backends.serverless.group import ServerlessGroup

    if group.policy.env_release and env_spec_of(gen.attrs) is not None:
        return None  # multi-turn: instances give their devices back while tools run instead (env_release.py)
    away: dict[str, list[ChunkForward]] = {}
    for f in forwards:
        if f.worker_group != group.name:
            away.setdefault(f.worker_group, []).append(chunk_forward(f))
    consumers: dict[str, ServerlessGroup] = {}
    for name in away:
        g = others[name]
        if not isinstance(g, ServerlessGroup):
            return None
        consumers[name] = g
    room = group.room(group.world, {name: 1 for name in away})  # generation and forward instances wait on
    if room is not None and room < 1:  # one another: not all of them could run at once, so run it unfused
        return None
    started = time.perf_counter()
    args, world, order, decided = group.scaler.shards((str(gen.model), prompts, dict(gen.attrs)), room)
    plan = dispatch.plan("generate", args, {"step_seed": seed}, "split", world)
    box = group.new_box("stream") if away else ""
    first, warm = group.take_warm(len(plan.calls), "generate")
    here = [chunk_forward(f) for f in forwards if f.worker_group == group.name]
    migration = group.new_box("migrate")
    shares, shared = group.shares(plan)
    made = []
    for c in plan.calls:
        kw = {**c.kwargs, "first_prompt": c.offset, "box": box, "inline": here, "mailbox": group.mailbox,
              "role": group.role(c.rank, len(plan.calls), migration, decided.sink),
              **({"share": shares[c.rank]} if shares else {})}
        made.append(group.submit(warm, migrate.METHOD, c.args, kw))
    late = group.late_s()
    if away:  # the forward instances start with the first chunk (or once a generation instance returned),
        # `late` seconds after it: a share of what they waited for chunks at the last steps, slot held; sooner
        # only when every generation instance has returned (one returning leaves the others' chunks to wait for)
        ray.wait([group.mailbox.take_all.remote(box, 0), *[r[1] for r, _ in made]], num_returns=1)
        if late > 0:
            ray.wait([r[1] for r, _ in made], num_returns=len(made), timeout=late)
    jobs = []
    for name, fs in away.items():
        g = consumers[name]
        _, waiting = g.take_warm(1, fs[0].op)
        refs, token = g.submit(waiting, stream.CONSUME, (fs,),
                               {"box": box, "producers": len(plan.calls), "mailbox": group.mailbox})
        jobs.append((g, fs[0].op, refs, token))
    parts, used = group.collect("generate", [r for r, _ in made], [t for _, t in made], first)
    group.close_boxes([migration, shared] if shared else [migration])
    outs: Outputs = {}
    wall_spans: dict[str, tuple[float, float]] = {}
    for part in parts:
        _gather(outs, wall_spans, part.outs, part.spans)
    waits: list[float] = []  # what each forward instance waited for chunks this step
    for g, op, refs, token in jobs:
        (theirs, spans, busy), st = ray.get([refs[0], refs[1]])
        u = g.usage_for(op, st)
        waited = max(0.0, u.run_s - busy)
        u = replace(u, run_s=busy, wait_s=u.wait_s + waited)  # waiting for chunks: idle
        waits.append(waited)
        g.record([u], [token])
        _gather(outs, wall_spans, theirs, spans)
    if box:
        group.close_boxes([box])  # its chunks are no longer pinned in the object store
    group.learn_slack(waits, late)
    shift = time.time() - time.perf_counter()  # wall clock -> perf_counter
    gen_end = max(part.ended for part in parts)
    chunks, rollout = group.rollout(parts, args[1])
    group.note(group.scaler.measure(chunks, used, decided.choice, gen_end - shift - started))
    rows = group.scaler.restore_rows(rollout, order)
    rollout = group.scaler.learn_and_restore(rollout, order)
    group.refill()
    return StreamedStage(
        rollout, {n: in_order(assemble([o for o, _ in got], [s for _, s in got]), rows, order)
                  for n, got in outs.items()},
        {"fusion/chunks": float(sum(len(p.chunks) for p in parts)), "fusion/workers": float(len(plan.calls)),
         "fusion/gen_s": gen_end - shift - started, **({"fusion/late_s": late} if away else {})},
        gen_end - shift, {n: (a - shift, b - shift) for n, (a, b) in wall_spans.items()})
