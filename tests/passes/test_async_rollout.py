"""async-rollout: which nodes run ahead, what the graph says about it, each refusal, and the language key."""

from __future__ import annotations

from pathlib import Path

import pytest

import flowrl
from flowrl.errors import FlowError
from flowrl.ir.graph import Graph
from flowrl.viz.views import draw

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str, k: int = 1, **sets: str) -> Graph:
    return flowrl.load(str(EXAMPLES / name), overrides={"run.max_staleness": str(k), **sets})


def notes(g: Graph, name: str) -> list[str]:
    return list(next(r.notes for r in g.passes if r.name == name))


def ahead(g: Graph) -> list[str]:
    return [n.id for n in g.nodes if n.attrs.get("phase") == "rollout"]


def test_grpo_runs_data_generation_rewards_and_advantages_ahead() -> None:
    g = load("longtail_grpo.flow", k=2)
    assert ahead(g) == ["prompts", "rollout", "scores", "adv"]
    assert g.node("rollout").attrs["max_staleness"] == 2
    assert g.node("old_logp").attrs["async_inputs"] == "rollout"
    assert g.node("actor.update").attrs["async_inputs"] == "rollout,adv"
    assert g.node("actor.update").attrs["is_correction"] == "decoupled"
    assert notes(g, "async-rollout")[0].startswith("rollout: generates step t + 2 while step t trains")
    # the forwards wait for the newest weights, steps later: nothing to stream them into
    assert notes(g, "fuse-gen-inference") == [
        "rollout: not fused: asynchronous rollout (pass async-rollout): generation overlaps the training of "
        "earlier steps instead"]
    assert not any(n.attrs.get("fusion") for n in g.nodes)


def test_ppo_keeps_the_critic_and_gae_in_the_train_phase() -> None:
    g = load("longtail_ppo.flow")
    assert ahead(g) == ["prompts", "rollout"]  # rm.score on the train pool, so scores and gae wait there
    assert g.node("critic.update").attrs["async_inputs"] == "rollout"
    assert "is_correction" not in g.node("critic.update").attrs


def test_a_reference_placed_with_generation_runs_ahead_with_it(tmp_path: Path) -> None:
    text = (EXAMPLES / "longtail_grpo.flow").read_text().replace("actor.generate -> rollout",
                                                                  "actor.generate, ref -> rollout")
    text = text.replace("actor.update, ref -> train", "actor.update -> train")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "longtail.jsonl").write_text((EXAMPLES / "data" / "longtail.jsonl").read_text())
    (tmp_path / "f.flow").write_text(text)
    g = flowrl.load(str(tmp_path / "f.flow"), overrides={"run.max_staleness": "1"})
    assert ahead(g) == ["prompts", "rollout", "ref_logp", "scores", "adv"]


def test_an_explicit_correction_is_kept() -> None:
    g = load("longtail_grpo.flow", **{"use.is_correction": '"tis"'})
    assert g.node("actor.update").attrs["is_correction"] == "tis"


@pytest.mark.parametrize(("flow", "sets", "why"), [
    ("grpo_arith.flow", {}, "rollout and actor.update both run on worker group"),
    ("longtail_grpo.flow", {"use.mini_batches": "1"}, None),
])
def test_refusals(flow: str, sets: dict[str, str], why: str | None) -> None:
    g = load(flow, **sets)
    if why is None:  # on-policy-logp dropped old_logp; the update's own forward is the proximal policy
        assert ahead(g) and "the proximal policy's log-probs" in " ".join(notes(g, "on-policy-logp"))
        return
    assert ahead(g) == []
    assert why in notes(g, "async-rollout")[0] and notes(g, "async-rollout")[0].startswith("synchronous: ")


def test_a_forward_of_the_trained_model_on_the_generation_group_refuses(tmp_path: Path) -> None:
    text = (EXAMPLES / "longtail_grpo.flow").read_text().replace("actor.generate -> rollout",
                                                                  "actor.generate, actor.logprobs -> rollout")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "longtail.jsonl").write_text((EXAMPLES / "data" / "longtail.jsonl").read_text())
    (tmp_path / "f.flow").write_text(text)
    g = flowrl.load(str(tmp_path / "f.flow"), overrides={"run.max_staleness": "1"})
    assert notes(g, "async-rollout") == [
        "synchronous: old_logp runs on worker group rollout, which generates, but needs the trained weights "
        "(place it with actor.update)"]


def test_k_0_says_synchronous_and_changes_nothing() -> None:
    g = load("longtail_grpo.flow", k=0)
    assert notes(g, "async-rollout") == ["nothing to do: run { max_staleness = 0 } (synchronous)"]
    assert ahead(g) == [] and g.node("actor.update").attrs["is_correction"] == "auto"


def test_the_viz_draws_the_queued_edges_dashed() -> None:
    source = draw(load("longtail_grpo.flow"), "optimized", None).source
    dashed = [line for line in source.splitlines() if "style=dashed" in line and "async" in line]
    assert len(dashed) == 4  # rollout -> old_logp, ref_logp, actor.update; adv -> actor.update
    assert all("\u22641 stale" in line for line in dashed)


def test_a_negative_staleness_is_a_located_error(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "longtail.jsonl").write_text((EXAMPLES / "data" / "longtail.jsonl").read_text())
    text = (EXAMPLES / "longtail_grpo.flow").read_text().replace("checkpoint_every = 50", "max_staleness = -1")
    (tmp_path / "f.flow").write_text(text)
    with pytest.raises(FlowError) as e:
        flowrl.load(str(tmp_path / "f.flow"))
    shown = e.value.render()
    assert "`max_staleness` must be at least 0" in shown and "f.flow:" in shown and "^" in shown


def test_check_says_why_a_flow_stays_synchronous(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from flowrl.cli import main

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "arith.jsonl").write_text((EXAMPLES / "data" / "arith.jsonl").read_text())
    text = (EXAMPLES / "grpo_arith.flow").read_text().replace("checkpoint_every = 100 }",
                                                              "checkpoint_every = 100, max_staleness = 1 }")
    (tmp_path / "f.flow").write_text(text)
    assert main(["check", str(tmp_path / "f.flow"), str(EXAMPLES / "grpo_arith_async.flow")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (f"{tmp_path / 'f.flow'}: note: run {{ max_staleness = 1 }} is not applied, the run is "
                        "synchronous: rollout and actor.update both run on worker group colocated: nothing to "
                        "overlap (place actor.generate on a pool of its own in a `placement { }` block)")
    assert lines[2:] == [f"{EXAMPLES / 'grpo_arith_async.flow'}: ok"]
