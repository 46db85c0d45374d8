"""drop-reference: a KL-free graph holds no reference model. When it rewrites, each refusal, idempotence, the model
never built (its worker group holds no weights of it), equal numbers, resume, and a reference read by a later
stage of a pipeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import flowrl
from flowrl import run
from flowrl.backends.local import LocalBackend
from flowrl.compiler import compile_any, optimize
from flowrl.dsl import Pipeline
from flowrl.ir import to_text
from flowrl.ir.graph import Graph
from flowrl.passes.drop_reference import drop_reference
from flowrl.runtime.pipeline import run_pipeline

from .conftest import MODEL, passes, run_steps

KL_FREE = """actor.update(rollout, old_logp = old_logp, ref_logp = ref_logp, advantages = adv{extra})
    critic.update(rollout, values = values, returns = adv)"""


@flowrl.function("drop_reference_test_reader")
def _reader(scores: Any, ref_logp: Any) -> Any:
    """A user's step function that reads the reference's log-probs (the pass cannot know what for)."""
    return scores


def test_removes_the_forward_and_the_model(ppo: Callable[..., Graph]) -> None:
    g, notes = drop_reference(ppo(body=KL_FREE.format(extra="")))
    assert "ref_logp" not in [n.id for n in g.nodes]
    assert g.node("actor.update").input("ref_logp") is None and g.node("actor.update").input("old_logp") == "old_logp"
    assert [w.models for w in g.worker_groups] == [("actor", "critic", "rm")]
    assert [m.name for m in g.models] == ["actor", "ref", "critic", "rm"]  # declared still: critic's source chain
    assert notes == ["ref_logp: removed: `actor.update` reads it with kl_coef = 0, so nothing uses ref's log-probs "
                     "(the step's kl_mean is not reported)",
                     "ref: not built (no weights, no forward): no node of the step uses it"]
    assert "model ref : reference <- actor {" in to_text(g) and "  # not built: no worker group holds it" in to_text(g)


def test_removes_it_from_reinforce_pp_rewards_with_no_kl(ppo: Callable[..., Graph]) -> None:
    g, notes = drop_reference(ppo(body="adv2 = reinforce_pp_advantage(scores, old_logp, ref_logp, kl_coef = 0.0)\n"
                                       "    actor.update(rollout, old_logp = old_logp, ref_logp = ref_logp, "
                                       "advantages = adv2)"))
    assert g.node("adv2").inputs == (("scores", "scores"), ("logp", "old_logp"))
    assert notes[0] == ("ref_logp: removed: `adv2` and `actor.update` read it with kl_coef = 0, so nothing uses "
                        "ref's log-probs (the step's kl_mean is not reported)")


def test_a_group_left_with_no_model_goes(ppo: Callable[..., Graph]) -> None:
    placement = "placement {\n    pool gen { gpus = 1 }\n    pool kl { gpus = 1 }\n    actor, critic, rm -> gen\n" \
                "    ref -> kl\n}\n"
    g, _ = drop_reference(ppo(body=KL_FREE.format(extra=""), placement=placement))
    assert [(w.name, w.models) for w in g.worker_groups] == [("gen", ("actor", "critic", "rm"))]


REFUSALS = [
    ("kl_coef", KL_FREE.format(extra=", kl_coef = 0.05"), "`actor.update` has kl_coef = 0.05: its KL penalty reads it"),
    ("kl in the rewards", "adv2 = reinforce_pp_advantage(scores, old_logp, ref_logp, kl_coef = 0.01)\n    "
     "actor.update(rollout, old_logp = old_logp, ref_logp = ref_logp, advantages = adv2)",
     "`adv2` puts kl_coef = 0.01 x the KL to the reference into the rewards"),
    ("another parameter", "actor.update(rollout, old_logp = ref_logp, advantages = adv)",
     "`actor.update` reads it as `old_logp`"),
    ("a user function", "adv2 = drop_reference_test_reader(scores, ref_logp)\n    "
     "actor.update(rollout, old_logp = old_logp, advantages = adv2)",
     "`adv2` (drop_reference_test_reader) reads it"),
]


@pytest.mark.parametrize(("text", "note"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refuses(ppo: Callable[..., Graph], text: str, note: str) -> None:
    g = ppo(body=text)
    out, notes = drop_reference(g)
    assert out == g
    assert notes == [f"ref_logp: kept: {note}"]


def test_refuses_dpo(ppo: Callable[..., Graph]) -> None:
    pairs = Path(__file__).resolve().parents[2] / "examples" / "data" / "sum_pairs.jsonl"
    g = ppo(text=f"""
model actor : policy {{ {MODEL}, lr = 1e-3 }}
model ref : reference {{ source = actor }}
data pairs = jsonl("{pairs}")
step {{
    pair_ref = ref.logprobs(pairs)
    actor.update(pairs, loss = "dpo", ref_logp = pair_ref)
}}
""")
    out, notes = drop_reference(g)
    assert out == g
    assert notes == ["pair_ref: kept: `actor.update` (loss \"dpo\") compares the policy with the reference's log-probs"]


def test_nothing_to_do_without_a_reference_forward(ppo: Callable[..., Graph]) -> None:
    g = drop_reference(ppo(body=KL_FREE.format(extra="")))[0]
    assert drop_reference(g) == (g, ["nothing to do: no reference model's forward in the step"])


def test_idempotent(ppo: Callable[..., Graph]) -> None:
    once = passes(ppo(body=KL_FREE.format(extra="")), "drop-reference")
    twice = passes(once, "drop-reference")
    assert (twice.nodes, twice.worker_groups) == (once.nodes, once.worker_groups)
    assert [p.changed for p in twice.passes] == [True, False]


def test_on_by_default_and_in_the_explanation(ppo: Callable[..., Graph]) -> None:
    g = optimize(ppo(body=KL_FREE.format(extra="")))
    assert [p.name for p in g.passes][:2] == ["on-policy-logp", "drop-reference"]
    record = next(p for p in g.passes if p.name == "drop-reference")
    assert record.changed and record.notes[-1] == "ref: not built (no weights, no forward): no node of the step uses it"


def test_the_model_is_never_built_and_the_numbers_are_the_same(ppo: Callable[..., Graph]) -> None:
    g = ppo(body=KL_FREE.format(extra=""))
    be = LocalBackend()
    groups = be.start(passes(g, "drop-reference"), seed=5, device="cpu")
    try:  # what the backend built, read through the WorkerGroup contract
        assert set(groups["colocated"].state_dict()) == {"actor", "critic", "rm"}
    finally:
        be.shutdown()
    on, off = run_steps(passes(g, "drop-reference"), steps=3), run_steps(g, steps=3)
    for step, (a, b) in enumerate(zip(on, off, strict=True)):
        assert set(b.values) - set(a.values) == {"ref_logp"}
        for node, batch in a.values.items():
            for key, t in batch.tensors.items():
                assert torch.equal(t, b.values[node].tensors[key]), (step, node, key)
        metrics = {k for k in b.metrics if not k.startswith("time/")}
        assert metrics - set(a.metrics) == {"kl_mean"}  # nothing to measure it against
        assert all(a.metrics[k] == b.metrics[k] for k in metrics - {"kl_mean"}), step


def test_a_model_built_from_the_reference_still_builds(ppo: Callable[..., Graph]) -> None:
    flow = ppo(body=KL_FREE.format(extra=""))
    text = Path(flow.path).read_text().replace("model critic : critic { source = actor", "model critic : critic "
                                                                                        "{ source = ref")
    chained = ppo(text=text)
    assert chained.model("critic").source_model == "ref"
    on, off = run_steps(passes(chained, "drop-reference"), steps=2), run_steps(chained, steps=2)
    assert on[-1].metrics["critic/vf_loss"] == off[-1].metrics["critic/vf_loss"]


FLOW = """flow kl_free
model actor : policy {{ {model}, lr = 1e-3 }}
model ref : reference {{ source = actor }}
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("data.jsonl") {{ batch = 4 }}
run {{ steps = 2, seed = 3, checkpoint_every = 1 }}
{body}
"""


def _folder(tmp_path: Path, body: str) -> Path:
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(3) for b in range(3)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "f.flow").write_text(FLOW.format(model=MODEL, body=body))
    return tmp_path / "f.flow"


def _plain(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "cost/")) and k not in
             ("step_time_s", "tokens_per_s", "kl_mean", "actor/kl_mean")} for r in rows]


def test_resume_continues_exactly(tmp_path: Path) -> None:
    path = _folder(tmp_path, "use gspo(reward = correct, group = 4, max_tokens = 3)")
    graph = flowrl.load(str(path))
    assert "ref" not in graph.worker_groups[0].models
    full = run(graph, out_dir=tmp_path / "full").metrics
    part = tmp_path / "part"
    run(graph, out_dir=part, steps=1)
    resumed = run(graph, out_dir=part, resume=True).metrics
    assert _plain(resumed) == _plain(full)
    # a run checkpointed with the reference built (the pass off) resumes with it gone, and the other way round
    other = tmp_path / "other"
    run(flowrl.load(str(path), no_pass=["drop-reference"]), out_dir=other, steps=1)
    assert _plain(run(graph, out_dir=other, resume=True).metrics) == _plain(full)


def test_a_later_stage_reads_the_reference_the_first_stage_left_unbuilt(tmp_path: Path) -> None:
    """Stage `a` trains KL-free (its reference is not built); stage `b` reads the same reference for its KL. As with
    the pass off, b's reference holds the actor's weights from the start of a (the reference a would have built),
    not those a trained."""
    body = ("stage a { use gspo(reward = correct, group = 4, max_tokens = 3) }\n"
            "stage b { use grpo(reward = correct, group = 4, max_tokens = 3, kl_coef = 0.05) }")
    path = _folder(tmp_path, body)
    results = {}
    for name, off in (("on", ()), ("off", ("drop-reference",))):
        pipe = compile_any(str(path), no_pass=off)
        assert isinstance(pipe, Pipeline)
        assert ("ref" in pipe.stage("a").graph.worker_groups[0].models) == bool(off)
        results[name] = run_pipeline(pipe, out_dir=tmp_path / name, backend=lambda stage: LocalBackend())
    on = torch.load(tmp_path / "on/stages/a/models.pt")["ref"]
    off_ref = torch.load(tmp_path / "off/stages/a/models.pt")["ref"]
    assert on.keys() == off_ref.keys() and all(torch.equal(on[k], off_ref[k]) for k in on)
    assert _plain(results["on"].metrics) == _plain(results["off"].metrics)
    b_rows = [r for r in results["on"].metrics if r["stage"] == "b"]
    assert all("kl_mean" in r for r in b_rows) and b_rows[0]["kl_mean"] != 0.0  # a moved the actor off it


CHILD = """
import sys
import flowrl
from flowrl.backends.local import LocalBackend
graph = flowrl.compile_flow(sys.argv[1], "/flows/kl_free.flow", no_pass=sys.argv[2:])
groups = LocalBackend().start(graph, seed=0, device="cpu")
print(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1])
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the kernel's peak RSS from /proc")
def test_the_kernel_counts_the_reference_weights_saved(tmp_path: Path) -> None:
    """The memory the pass saves, as the kernel counts it (each process's peak resident set, VmHWM): at least 80%
    of the reference's block weights (a 4-layer, width-512 policy: 12.6M parameters there, 48 MiB), the rest of
    the process being equal."""
    data = Path(__file__).resolve().parents[2] / "examples" / "data" / "arith.jsonl"
    text = ('model actor : policy { source = "tiny:gpt2", layers = 4, dim = 512, heads = 8, '
            'charset = "0123456789+=" }\nmodel ref : reference { source = actor }\n'
            'reward correct = "flowrl.rewards.arith_exact"\n'
            f'data prompts = jsonl("{data}") {{ batch = 2 }}\n'
            "use gspo(reward = correct, group = 2, max_tokens = 2)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    peak = {}
    for side, off in (("on", []), ("off", ["drop-reference"])):
        done = subprocess.run([sys.executable, "-c", CHILD, text, *off], env=env, capture_output=True, text=True,
                              check=True)
        peak[side] = int(done.stdout.split()[-1]) * 1024  # kB
    ref_bytes = 12 * 4 * 512 * 512 * 4  # the 4 blocks' attention and MLP weights alone, float32
    assert peak["off"] - peak["on"] >= 0.8 * ref_bytes, peak
