"""What the fused generation stage produced (flowrl.runtime.gen_infer): its chunks, every forward's outputs, the
timeline of who ran what when, and at the end the outputs in sample order with the stage's metrics.

Written to by the rank threads and the other groups' feeders at once, so every method takes the lock; nothing
else of the stage's state lives here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from flowrl.ir.graph import Node
from flowrl.runtime.batch import Batch
from flowrl.runtime.chunks import Scored, assemble
from flowrl.runtime.gen_infer.records import Timed


class Results:
    def __init__(self, forwards: Sequence[Node], prompts: Batch, on_chunk: Callable[[Batch], None] | None = None):
        self.prompts = prompts
        self.on_chunk = on_chunk  # called with each chunk of finished samples (rewards scored beside generation)
        self.lock = threading.Lock()
        self.chunks: list[Batch] = []
        self.arrivals: list[float] = []
        # node id -> (order, output, its rows' sample numbers): one entry per forward call
        self.outputs: dict[str, list[tuple[int, Batch, torch.Tensor]]] = {f.id: [] for f in forwards}
        self.timeline: list[Timed] = []

    def chunk(self, cid: int) -> Batch:
        with self.lock:
            return self.chunks[cid]

    def add_chunk(self, batch: Batch) -> int:
        """Record a chunk, with the prompt fields `generate` gives its rows (by global prompt index)."""
        groups = batch["group_id"].tolist()
        meta = {k: [v[g] for g in groups] for k, v in self.prompts.meta.items()}
        meta.update(batch.meta)  # "response", and a rollout's own (env_step_s, env_ended)
        chunk = Batch(batch.size, batch.tensors, meta, batch.primary)
        with self.lock:
            self.chunks.append(chunk)
            self.arrivals.append(time.perf_counter())
            cid = len(self.chunks) - 1
        if self.on_chunk is not None:
            self.on_chunk(chunk)
        return cid

    def timed(self, what: str, rank: int, start: float, end: float | None = None) -> None:
        with self.lock:
            self.timeline.append(Timed(what, rank, start, end if end is not None else time.perf_counter()))

    def output(self, node: Node, out: Batch, samples: torch.Tensor, t0: float, rank: int) -> None:
        with self.lock:
            self.outputs[node.id].append((len(self.outputs[node.id]), out, samples))
            self.timeline.append(Timed(node.id, rank, t0, time.perf_counter()))

    def scored(self, rank: int, cid: int, item: Scored) -> set[str]:
        """The forwards a rank ran on its own chunk (own-rank): their outputs; the ids of those nodes."""
        now = time.perf_counter()
        with self.lock:
            meta = self.chunks[cid].meta  # the rank scored the chunk before its prompt fields were added
            for node_id, (out, secs) in item.outs.items():
                self.outputs[node_id].append((cid, Batch(out.size, out.tensors, meta, out.primary),
                                              self.chunks[cid]["sample"]))
                self.timeline.append(Timed(node_id, rank, now - secs, now))
        return set(item.outs)

    def spans_of(self, node_id: str) -> list[Timed]:
        with self.lock:
            return [t for t in self.timeline if t.what == node_id]

    def finish(self, start: float, workers: int, counters: dict[str, float]) -> tuple[Batch, dict[str, Batch],
                                                                                      dict[str, float]]:
        """The rollout and every forward's output in sample order, and the stage's metrics."""
        rollout = assemble(self.chunks, [c["sample"] for c in self.chunks])
        outs = {}
        for node_id, parts in self.outputs.items():
            parts.sort(key=lambda p: p[0])
            outs[node_id] = assemble([b for _, b, _ in parts], [rows for _, _, rows in parts])
        gen_end = max(self.arrivals)
        infer = [t for t in self.timeline if t.what != "generate"]
        busy = sum(t.end - t.start for t in infer)
        overlap = sum(max(0.0, min(t.end, gen_end) - t.start) for t in infer)
        metrics = {"fusion/chunks": float(len(self.chunks)), **counters, "fusion/workers": float(workers),
                   "fusion/gen_s": gen_end - start, "fusion/infer_s": busy, "fusion/overlap_s": overlap,
                   "fusion/overlap_frac": overlap / busy if busy > 0 else 0.0}
        return rollout, outs, metrics
