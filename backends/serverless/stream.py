"""A fused gen-infer stage on serverless pools (fuse-gen-inference; issue 15 item 1).

Serverless instances are tasks, so the fused-stage scheduler cannot drive them rank by rank; the pools stream
the stage themselves. Each generation instance (backends/serverless/migrate.py's `generate`, cutting and
migrating as without fusion) runs `ModelWorker.generate_stream` — `generate`'s samples, same seeds — runs the
forwards placed on its own group on each chunk between decode steps (the scheduler's "own-rank" schedule), and
offers every chunk to the stage's box in the Mailbox actor. One instance of each other group holding forwards
of the stage (`consume`), started when the first chunk is there (or, once the stage has run, a share of its
measured slack later: what it spent waiting for chunks with its slot held; `Policy.late`), takes the chunks as
they come and runs its forwards on them, so they overlap the rest of generation; it ends once every generation instance said it has
finished and every chunk it counted came. Every output is put back in sample order (`assemble`), as the
unfused stage computes it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import ray

from flowrl.runtime.batch import Batch
from flowrl.runtime.chunks import ChunkForward
from flowrl.runtime.worker import ModelWorker

CONSUME = "forward_streamed"  # the instance-side method name of a forward instance of the stage
# generation instances run migrate.generate (migrate.METHOD) with `box` and `inline`

Outputs = dict[str, list[tuple[Batch, Any]]]  # forward node -> [(its output on a chunk, the chunk's samples)]


def consume(worker: ModelWorker, forwards: Sequence[ChunkForward], *, box: str, producers: int,
            mailbox: Any) -> tuple[Outputs, dict[str, tuple[float, float]], float]:
    """An instance of another group: its forwards on every chunk in `box` until all `producers` have said they
    finished and every chunk they counted came (the Mailbox is an async actor: words from one instance may be
    taken out of order) -> (outputs, their (first, last) wall times, seconds it computed: the rest it waited)."""
    outs: Outputs = {}
    spans: dict[str, tuple[float, float]] = {}
    heard = since = taken = expected = 0
    busy = 0.0
    while heard < producers or taken < expected:
        words = ray.get(mailbox.take_all.remote(box, since))
        since += len(words)
        for word in words:
            if isinstance(word, tuple):  # ("end", the chunks that instance offered)
                heard += 1
                expected += int(word[1])
                continue
            taken += 1
            chunk: Batch = ray.get(word[0])
            for f in forwards:
                began = time.time()
                outs.setdefault(f.node, []).append((getattr(worker, f.op)(f.model, chunk, dict(f.attrs)),
                                                    chunk["sample"]))
                spans[f.node] = (spans.get(f.node, (began, 0.0))[0], time.time())
                busy += spans[f.node][1] - began
    return outs, spans, busy
