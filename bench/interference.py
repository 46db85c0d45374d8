"""How much two worker processes slow each other down on this machine (what bounds any overlap gain).

    .venv/bin/python bench/interference.py

Generation of one long-tail GRPO rollout (examples/longtail_grpo.flow, 128 samples, one torch thread), timed
alone and then while a second process runs the policy's log-prob forward over a rollout in a loop: what a
fused stage does when one worker decodes while another scores chunks. On separate devices the second figure
equals the first; here the two processes share the host's cores, caches and memory bandwidth.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

import torch
from passes_common import ROOT, make_side

from flowrl.backends.local import LocalBackend
from flowrl.compiler import compile_file
from flowrl.engines import prompt_cache
from flowrl.runtime.controller import _prompt_batch


def _worker() -> tuple[Any, Any, Any]:
    torch.set_num_threads(1)
    graph = compile_file(str(ROOT / "examples" / "longtail_grpo.flow"))
    side = make_side("x", graph, LocalBackend())
    side.ctl.step(1)
    group = side.ctl.groups[graph.node("rollout").worker_group]
    return group.workers["actor"], graph, _prompt_batch(side.ctl.loaders["prompts"])


def _forwards(started: Any, stop: Any) -> None:
    worker, graph, prompts = _worker()
    rollout = worker.generate("actor", prompts, dict(graph.node("rollout").attrs), step_seed=0)
    started.set()
    while not stop.is_set():
        prompt_cache.clear()  # each pass computes its prompts, as a chunk forward on a fresh worker does
        worker.logprobs("actor", rollout, dict(graph.node("old_logp").attrs))


def _generation_s(worker: Any, graph: Any, prompts: Any, repeats: int) -> float:
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        worker.generate("actor", prompts, dict(graph.node("rollout").attrs), step_seed=i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(repeats: int = 12) -> dict[str, float]:
    worker, graph, prompts = _worker()
    _generation_s(worker, graph, prompts, 2)  # warm-up
    alone = _generation_s(worker, graph, prompts, repeats)
    ctx = mp.get_context("spawn")
    started, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_forwards, args=(started, stop), daemon=True)
    proc.start()
    started.wait(120)
    beside = _generation_s(worker, graph, prompts, repeats)
    stop.set()
    proc.join(30)
    return {"generation_alone_s": alone, "generation_beside_forwards_s": beside, "slowdown": beside / alone}


def main() -> None:
    out = measure()
    print(f"generation alone {out['generation_alone_s']:.3f} s, beside a forward loop in another process "
          f"{out['generation_beside_forwards_s']:.3f} s: {out['slowdown']:.2f}x slower")


if __name__ == "__main__":
    main()
