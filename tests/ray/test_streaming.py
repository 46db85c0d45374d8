"""fuse-gen-inference on Ray ranks: the scheduler pulls each rank's stream item by item (`on_rank`), so a
fused stage runs fused on Ray too, with the numbers of the unfused stage."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import flowrl
from flowrl.ir.graph import Graph

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]

# The actor (generation and its own forward) on one pool, the reference on another: fuse-gen-inference fuses
# only where a forward can run beside generation.
PLACED = """placement {
    pool gen   { gpus = 1 }
    pool infer { gpus = 1 }
    actor -> gen
    ref -> infer
}"""


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    """Equal metrics but times and the fusion counters (only the fused side has those): within 1e-5 in step 1,
    1e-3 later (AdamW's first steps magnify float rounding; see tests/passes/conftest.assert_same_numbers)."""
    for step, (ra, rb) in enumerate(zip(a, b, strict=True)):
        tol = 1e-5 if step == 0 else 1e-3
        keys = {k for k in ra if not k.startswith(("time/", "fusion/", "cost/")) and k not in ("step_time_s", "tokens_per_s")}
        assert keys == {k for k in rb if not k.startswith(("time/", "fusion/", "cost/")) and k not in ("step_time_s",
                                                                                               "tokens_per_s")}
        for k in sorted(keys):
            assert abs(float(ra[k]) - float(rb[k])) <= tol, (ra["step"], k, ra[k], rb[k])


def test_one_rank_streams_and_matches_the_local_backend(tiny: Callable[..., Graph], tmp_path: Path,
                                                        local_metrics: Callable[..., Any]) -> None:
    g = tiny(steps=2, max_tokens=20, placement=PLACED)
    assert g.node("rollout").attrs.get("fusion") == "gen-infer:rollout"
    metrics = flowrl.run(g, out_dir=tmp_path, backend="ray").metrics
    assert all("fusion/fallback" not in r and r["fusion/chunks"] >= 1 for r in metrics)
    _same(local_metrics(steps=2, max_tokens=20), metrics)


@pytest.mark.parametrize("where", ["own-rank", "free-rank"])
def test_two_ranks_stream_migrate_and_match_the_unfused_stage(tiny: Callable[..., Graph], flow_text: Any,
                                                               tmp_path: Path, where: str) -> None:
    import flowrl

    text = flow_text(steps=2, max_tokens=20, replicas=2, placement=PLACED)
    # old_logp kept (one optimizer step would drop it): it runs on the generating ranks, ref_logp on `infer`.
    fused = flowrl.compile_flow(text, "/flows/tiny_grpo.flow", no_pass=["on-policy-logp"])
    eager = fused.with_nodes([n.with_attrs(migrate_below=0.9, chunk_forwards=where) if n.op == "generate" else n
                              for n in fused.nodes])
    on = flowrl.run(eager, out_dir=tmp_path / "on", backend="ray").metrics
    off = flowrl.run(flowrl.compile_flow(text, "/flows/tiny_grpo.flow", no_pass=["on-policy-logp", "fuse-gen-inference"]),
                     out_dir=tmp_path / "off", backend="ray").metrics
    assert all(r["fusion/workers"] == 2 and "fusion/fallback" not in r for r in on)
    if where == "own-rank":
        assert sum(r["fusion/inline_chunks"] for r in on) > 0
    # (Whether free-rank migrates here depends on how fast remote progress arrives; the hand-over itself is
    # tested deterministically below.)
    _same(off, on)


class _ExportAtOnce:
    """A StreamControl that asks for the tail as soon as the rank reports progress."""

    def __init__(self) -> None:
        self.reports: list[int] = []

    def progress(self, remaining: int) -> None:
        self.reports.append(remaining)

    def should_export(self) -> bool:
        return True


def test_a_tail_exported_by_one_ray_rank_resumes_on_another_with_the_same_samples(flow_text: Any) -> None:
    import flowrl
    from flowrl.backends.ray import RayBackend
    from flowrl.engines.chunked_generation import Tail
    from flowrl.runtime.batch import Batch
    from flowrl.runtime.chunks import assemble

    graph = flowrl.compile_flow(flow_text(max_tokens=40, replicas=2, placement=PLACED), "/flows/tiny_grpo.flow")
    attrs = dict(graph.node("rollout").attrs)
    texts = ["1+2=", "3+4=", "5+6=", "7+8="]
    prompts = Batch(4, {}, {"prompt": texts, "row": [{"prompt": t} for t in texts], "prompt_id": [0, 1, 2, 3]})
    backend = RayBackend()
    group: Any = backend.start(graph, seed=3, device="cpu")["gen"]
    try:
        whole = list(group.on_rank(0, "generate_stream", "actor", prompts, attrs, step_seed=11))
        control = _ExportAtOnce()
        part = list(group.on_rank(0, "generate_stream", "actor", prompts, attrs, step_seed=11, control=control))
        tails = [t for t in part if isinstance(t, Tail)]
        assert control.reports and len(tails) == 1 and len(tails[0].samples) > 0
        resumed = list(group.on_rank(1, "resume_stream", "actor", tails, attrs))
    finally:
        backend.shutdown()
    chunks = [c for c in part if not isinstance(c, Tail)] + resumed
    a = assemble(whole, [c["sample"] for c in whole])
    b = assemble(chunks, [c["sample"] for c in chunks])
    assert a["response_ids"].equal(b["response_ids"]) and a["response_mask"].equal(b["response_mask"])
    assert (a["gen_logp"] - b["gen_logp"]).abs().max() <= 1e-5


def test_a_rank_lost_mid_stream_is_rebuilt_and_the_stage_runs_again_with_the_same_numbers(
        flow_text: Any, tmp_path: Path) -> None:
    """Rank 1 of the generating group dies while streaming step 2's chunks (the test hook exits its process once
    its stream handed over a chunk): the group is rebuilt from the weights it held (step 1's update replayed),
    the fused stage runs again from its start with the same seeds and gives the undisturbed run's numbers, and the
    run goes on to step 3 without another retry. Step 3's numbers are not compared: they are not reproducible even
    between two undisturbed runs (three fault-free runs measured: step 1's kl_mean -2.7e-9 vs -1.4e-9, the rounding
    of the streamed chunks' forwards, whose make-up depends on timing; AdamW turns step 1's near-zero gradient,
    grad_norm ~1e-9, into a full lr-sized step, so by step 3 a sample flips: gen_tokens 225 vs 220, kl_mean
    -5.5e-4 vs 5.4e-4, the very failure this test showed ~2 runs in 5)."""
    from flowrl.backends.ray import RayBackend

    text = flow_text(steps=3, max_tokens=20, replicas=2, placement=PLACED)
    graph = flowrl.compile_flow(text, "/flows/tiny_grpo.flow")
    assert graph.node("rollout").attrs.get("fusion") == "gen-infer:rollout"
    # Rank 1's process exits during its second generate_stream (step 2), once the stream handed over a chunk.
    hurt_backend = RayBackend(crash_on_call={"gen": {1: ("generate_stream", 2)}})
    restarts: list[int] = []
    hurt = flowrl.run(graph, out_dir=tmp_path / "hurt", backend=hurt_backend,
                      on_step=lambda step, row: restarts.append(hurt_backend.groups["gen"].restarts)).metrics
    whole = flowrl.run(graph, out_dir=tmp_path / "whole", backend=RayBackend()).metrics
    assert restarts == [0, 1, 1]
    assert [r.get("fault/stage_retries", 0.0) for r in hurt] == [0.0, 1.0, 0.0]
    assert all("fusion/fallback" not in r for r in hurt)
    assert len(hurt) == len(whole) == 3
    _same(whole[:2], [{k: v for k, v in r.items() if not k.startswith("fault/")} for r in hurt[:2]])
