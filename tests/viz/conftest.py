"""Hand-built GRPO-like and PPO-like graphs (the IR dataclasses only, no front end) for the viz tests."""

from __future__ import annotations

from dataclasses import replace

import pytest

from flowrl.errors import Loc
from flowrl.ir.graph import (
    DataDecl,
    Graph,
    GroupDecl,
    ModelDecl,
    Node,
    PassRecord,
    PoolDecl,
    Range,
    RewardDecl,
    frozen,
)
from flowrl.ir.verify import verify

PATH = "/flows/test.flow"


def loc(line: int) -> Loc:
    return Loc(PATH, line, 5)


def _common(flow: str, extra_models: tuple[ModelDecl, ...] = ()) -> dict[str, object]:
    models = (
        ModelDecl("actor", "policy", "tiny:gpt2", loc(1), trainable=True, lr=1e-4),
        ModelDecl("ref", "reference", "actor", loc(2), source_model="actor"),
        *extra_models,
    )
    return {
        "flow": flow, "path": PATH, "models": models,
        "rewards": (RewardDecl("correct", "flowrl.rewards.arith_exact", loc(3)),),
        "data": (DataDecl("prompts", "jsonl", "/flows/data/arith.jsonl", loc(4), frozen({"batch": 32})),),
        "run": frozen({"steps": 10}),
    }


def _call(id: str, op: str, line: int, model: str | None = None, inputs: tuple[tuple[str, str], ...] = (),
          wg: str = "controller", dispatch: str = "controller", **attrs: object) -> Node:
    return Node(id, op, loc(line), model=model, method=("update" if op == "update" else op) if model else None, inputs=inputs,
                attrs=frozen(attrs), worker_group=wg, dispatch=dispatch)


def grpo() -> Graph:
    nodes = (
        _call("prompts", "data", 10),
        _call("rollout", "generate", 11, "actor", (("prompts", "prompts"),), "rollout", "split", n=8, max_tokens=16),
        _call("old_logp", "logprobs", 12, "actor", (("rollout", "rollout"),), "train", "split"),
        _call("ref_logp", "logprobs", 13, "ref", (("rollout", "rollout"),), "train", "split"),
        _call("scores", "reward", 14, None, (("rollout", "rollout"),), fn="flowrl.rewards.arith_exact"),
        _call("adv", "fn", 15, None, (("scores", "scores"),), fn="group_advantage", group=8),
        _call("actor.update", "update", 16, "actor",
              (("rollout", "rollout"), ("old_logp", "old_logp"), ("ref_logp", "ref_logp"), ("advantages", "adv")),
              "train", "split", loss="ppo_clip", clip=0.2),
    )
    return verify(Graph(
        **_common("grpo_arith"), nodes=nodes,  # type: ignore[arg-type]
        pools=(PoolDecl("rollout", Range(2, 16), loc(20), elastic=True), PoolDecl("train", 8, loc(21))),
        worker_groups=(GroupDecl("rollout", ("actor",), "rollout", Range(2, 16)),
                       GroupDecl("train", ("actor", "ref"), "train")),
        template="grpo",
    ))


def ppo() -> Graph:
    critic = ModelDecl("critic", "critic", "actor", loc(5), source_model="actor", trainable=True, lr=5e-5)
    nodes = (
        _call("prompts", "data", 10),
        _call("rollout", "generate", 11, "actor", (("prompts", "prompts"),), "policy", "split", n=1),
        _call("old_logp", "logprobs", 12, "actor", (("rollout", "rollout"),), "policy", "split"),
        _call("ref_logp", "logprobs", 13, "ref", (("rollout", "rollout"),), "policy", "broadcast"),
        _call("values", "values", 14, "critic", (("rollout", "rollout"),), "critic", "split"),
        _call("scores", "reward", 15, None, (("rollout", "rollout"),), fn="flowrl.rewards.arith_exact"),
        _call("adv", "fn", 16, None, (("scores", "scores"), ("values", "values")), fn="gae", gamma=1.0),
        _call("actor.update", "update", 17, "actor",
              (("rollout", "rollout"), ("old_logp", "old_logp"), ("ref_logp", "ref_logp"), ("advantages", "adv")),
              "policy", "split", loss="ppo_clip"),
        _call("critic.update", "update", 18, "critic",
              (("rollout", "rollout"), ("returns", "adv"), ("values", "values")), "critic", "rank0", loss="value"),
    )
    return verify(Graph(
        **_common("ppo_arith", (critic,)), nodes=nodes,  # type: ignore[arg-type]
        worker_groups=(GroupDecl("policy", ("actor", "ref")), GroupDecl("critic", ("critic",))),
        template="ppo",
    ))


def optimized(g: Graph) -> Graph:
    """What the passes will produce: the two log-prob calls fused, generation sharing prompt prefixes."""
    nodes = []
    for n in g.nodes:
        if n.id in ("old_logp", "ref_logp"):
            n = n.with_attrs(fusion="f0", fusion_kind="inter-stage fusion")
        if n.op == "generate":
            n = n.with_attrs(share_prefix=True)
        nodes.append(n)
    return verify(replace(g, nodes=tuple(nodes), passes=(
        PassRecord("fuse-logprobs", True, ("fused old_logp + ref_logp: same rollout, same worker group",)),
        PassRecord("share-prefix", True, ("rollout: n=8 samples share each prompt's prefix",)),
        PassRecord("colocate", False, ("refused: only one trainable model",)),
    )))


class Graphs:
    """The builders, handed to tests through the `graphs` fixture."""

    grpo = staticmethod(grpo)
    ppo = staticmethod(ppo)
    optimized = staticmethod(optimized)


@pytest.fixture
def graphs() -> type[Graphs]:
    return Graphs


@pytest.fixture(params=["grpo", "ppo"])
def any_graph(request: pytest.FixtureRequest) -> Graph:
    return grpo() if request.param == "grpo" else ppo()
