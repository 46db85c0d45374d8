"""A serverless instance's device (backends/serverless/devices.py) and the models its process keeps between tasks
(backends/serverless/cache.py): worked choices, the LRU's evictions, and moves between host and device."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

import flowrl
from flowrl.backends.serverless.cache import Entry, ProcessModels, movable, move_models
from flowrl.backends.serverless.devices import NOSET, SLOT, DeviceError, Devices, choose_device, devices_for
from flowrl.runtime.batch import Batch
from flowrl.runtime.worker import ModelWorker

DATA = Path(__file__).resolve().parents[3] / "examples" / "data" / "arith.jsonl"

FLOW = """
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 1e-3 }
model ref : reference { source = actor }
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("DATA") { batch = 2 }
use grpo(reward = correct, group = 2, max_tokens = 3, kl_coef = 0.01)
"""


@pytest.mark.parametrize(("requested", "assigned", "visible", "want"), [
    ("auto", [], None, "cpu"),  # no GPU on the cluster: the logical slot, models on the CPU
    ("cpu", ["1"], None, "cpu"),  # an explicit cpu stays
    ("auto", ["1"], None, "cuda:1"),  # every GPU of the node visible: the id is the place
    ("cuda", ["0"], None, "cuda:0"),
    ("auto", ["7"], "5,7", "cuda:1"),  # the node sees GPUs 5 and 7: Ray's id 7 is the second
    ("cuda:0", ["3"], "3", "cuda:0"),  # Ray narrowed the process to its GPU: cuda:0 of the visible set
])
def test_an_instance_chooses_the_gpu_ray_assigned_it(requested: str, assigned: list[str], visible: str | None,
                                                     want: str) -> None:
    assert choose_device(requested, assigned, visible) == want


def test_cuda_without_a_gpu_is_an_error_never_the_cpu() -> None:
    with pytest.raises(DeviceError, match="given no GPU"):
        choose_device("cuda", [], None)
    # a reused process whose CUDA saw another GPU first cannot reach the one Ray assigned now
    with pytest.raises(DeviceError, match=f"sees only GPUs \\['0'\\].*{NOSET}"):
        choose_device("auto", ["1"], "0")


def test_a_task_asks_for_a_gpu_where_the_cluster_has_them_else_a_slot() -> None:
    assert devices_for({"CPU": 4.0, SLOT: 4.0}).options() == {"num_cpus": 1.0, "resources": {SLOT: 1}}
    assert devices_for({"CPU": 4.0, "GPU": 2.0}).options() == {
        "num_cpus": 1.0, "num_gpus": 1.0, "runtime_env": {"env_vars": {NOSET: "1"}}}
    assert devices_for({"GPU": 8.0}, fraction=0.25).options()["num_gpus"] == 0.25
    assert devices_for({"GPU": 8.0}).resource == "GPU" and Devices().resource == SLOT
    half = devices_for({"GPU": 3.0}, fraction=0.5)
    assert half.asks() == {"CPU": 1.0, "GPU": 0.5} and half.capacity({"GPU": 3.0}) == 6
    assert Devices().asks() == {"CPU": 1.0, SLOT: 1.0} and Devices().capacity({SLOT: 4.0, "GPU": 2.0}) == 4


def _worker() -> ModelWorker:
    graph = flowrl.compile_flow(FLOW.replace("DATA", str(DATA)), "/flows/d.flow")
    return ModelWorker((graph.model("actor"), graph.model("ref")), graph.models, seed=3, device="cpu")


def test_the_process_keeps_a_bounded_set_and_frees_what_it_evicts() -> None:
    kept = ProcessModels(kept=2)
    workers = [_worker() for _ in range(3)]
    gone = [weakref.ref(w) for w in workers]
    for i, w in enumerate(workers):
        kept.put(("run", f"g{i}"), Entry(w))
    assert list(kept.entries) == [("run", "g1"), ("run", "g2")]  # g0, the least recently used, evicted
    assert kept.get(("run", "g1")) is not None  # used: now the most recent
    del workers, w
    gc.collect()
    assert gone[0]() is None and gone[1]() is not None  # the evicted worker's models were freed
    newer = _worker()
    kept.put(("run2", "g0"), Entry(newer))  # a new run: the earlier run's entries go
    del newer
    gc.collect()
    assert list(kept.entries) == [("run2", "g0")] and gone[1]() is None and gone[2]() is None


def test_models_move_to_the_host_and_back_and_compute_the_same() -> None:
    """The move's code path on a machine without GPUs (CPU to CPU): the parameters stay the objects the
    optimizer holds, its state moves with them, and a trained model's numbers are unchanged."""
    w = _worker()
    assert movable(w) == ""
    params = [id(p) for p in w.models["actor"].module.parameters()]
    rollout = Batch(2, {"prompt_ids": torch.tensor([[3, 4], [4, 5]]), "prompt_mask": torch.ones(2, 2),
                        "response_ids": torch.tensor([[5, 6], [6, 7]]), "response_mask": torch.ones(2, 2)})
    trainer = w.trainers["actor"]
    # one optimizer step, so the optimizer has state to move
    loss = -torch.nn.functional.log_softmax(w.models["actor"].module(torch.tensor([[3, 4, 5]])).logits, -1).mean()
    loss.backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in trainer.optimizer.state.items()}
    before = w.logprobs("actor", rollout, {})["logp"]
    took = move_models(w, "cpu")
    assert took >= 0.0 and str(w.device) == "cpu"
    assert [id(p) for p in w.models["actor"].module.parameters()] == params
    assert torch.equal(w.logprobs("actor", rollout, {})["logp"], before)
    assert {id(p) for p in trainer.optimizer.state} == set(state) and all(
        torch.equal(v, state[id(p)][k]) for p, s in trainer.optimizer.state.items() for k, v in s.items())
