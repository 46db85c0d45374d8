"""Pass score-tail: unfinished samples of a streamed rollout are scored on the other group as they grow."""

from __future__ import annotations

from collections.abc import Callable

from flowrl.ir.graph import Graph
from flowrl.passes import select
from flowrl.passes.score_tail import score_tail

from .conftest import SPLIT, passes


def test_off_by_default_and_switched_on_by_name() -> None:
    assert "score-tail" not in [p.name for p in select()]
    names = [p.name for p in select(enabled=["score-tail"])]
    assert names.index("score-tail") == names.index("fuse-gen-inference") + 1


def test_sets_partial_below_on_a_rollout_streamed_to_another_group(ppo: Callable[..., Graph]) -> None:
    g, notes = score_tail(passes(ppo(n=4, batch=4, placement=SPLIT), "fuse-gen-inference"))
    assert g.node("rollout").attrs["partial_below"] == 0.25
    assert notes == ["rollout: below 25% of samples unfinished, their tokens so far also go out every 8 decode "
                     "steps and are scored as they grow"]


def test_refuses_a_rollout_that_is_not_streamed(ppo: Callable[..., Graph]) -> None:
    g = ppo(n=4, batch=4, placement=SPLIT)
    out, notes = score_tail(g)
    assert out.nodes == g.nodes
    assert notes == ["rollout: tail not scored while decoding: not fused with its forwards (fuse-gen-inference did "
                     "not stream it)"]


def test_refuses_when_every_forward_runs_on_the_generating_group(ppo: Callable[..., Graph]) -> None:
    g = passes(ppo(n=4, batch=4, placement=SPLIT), "fuse-gen-inference")
    key = g.node("rollout").attrs["fusion"]
    # Only the actor's own old_logp (on the generating group) left in the stage, as a hand-written graph could.
    here = g.with_nodes([n.with_attrs(fusion=None) if n.attrs.get("fusion") == key and n.worker_group != "gen"
                         else n for n in g.nodes])
    out, notes = score_tail(here)
    assert out.nodes == here.nodes
    assert notes == ["rollout: tail not scored while decoding: none of its forwards runs on another worker group"]


def test_idempotent(ppo: Callable[..., Graph]) -> None:
    once = passes(ppo(n=4, batch=4, placement=SPLIT), "fuse-gen-inference", "score-tail")
    twice = passes(once, "score-tail")
    assert twice.nodes == once.nodes and twice.passes[-1].changed is False
