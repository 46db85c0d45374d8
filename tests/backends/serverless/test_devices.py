"""A serverless instance's device (backends/serverless/devices.py) and the models its process keeps between tasks
(backends/serverless/cache.py): worked choices, the LRU's evictions, and moves between host and device."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

import flowrl
from flowrl.backends.serverless.cache import Entry, ProcessModels, move_models, why_not_movable
from flowrl.backends.serverless.devices import (
    NOSET,
    SLOT,
    DeviceError,
    Devices,
    choose_device,
    devices_for,
    gpus_asked,
    group_devices,
)
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


def test_what_the_flow_asks_for_decides_the_device_kind_not_the_cluster_at_start() -> None:
    """A pool's `gpu_fraction`, a model's `gpus` or the device `cuda` ask for GPUs on a cluster that has none yet
    (an autoscaler sees those requests); asking for none, the cluster's GPUs now, else a slot."""
    empty = {"CPU": 1.0}  # a head node, its GPU workers scaled to zero
    assert gpus_asked("auto") == "" and gpus_asked("cpu") == ""
    assert gpus_asked("auto", 0.5) == "gpu_fraction = 0.5" and gpus_asked("cuda:1") == 'device = "cuda:1"'
    assert gpus_asked("auto", None, 2.0) == "a model's gpus = 2"
    assert devices_for(empty, 0.5).asks() == {"CPU": 1.0, "GPU": 0.5}
    assert devices_for(empty, device="cuda").asks() == {"CPU": 1.0, "GPU": 1.0}
    assert devices_for(empty, model_gpus=1.0).resource == "GPU"
    assert devices_for(empty).resource == SLOT and devices_for(empty, device="cpu").resource == SLOT
    assert devices_for({"GPU": 4.0}, device="cpu").resource == "GPU"  # held as the cluster has it; run on the CPU


def test_auto_on_a_node_with_gpus_it_was_not_given_is_an_error_never_a_silent_cpu_run() -> None:
    with pytest.raises(DeviceError) as e:
        choose_device("auto", [], None, node_gpus=8.0)
    assert str(e.value) == (
        'device "auto": this instance took a `device_slot`, not a GPU, on a node with 8 GPU(s) (the cluster had '
        "no GPU when the run started, so its pools ask for slots): its models would run on the CPU beside them. "
        'Ask for GPUs (`run { device = "cuda" }`, or a pool\'s `gpu_fraction`), or run on the CPU on purpose '
        '(`run { device = "cpu" }`)')
    assert choose_device("cpu", [], None, node_gpus=8.0) == "cpu"  # on purpose
    assert choose_device("auto", [], None, node_gpus=0.0) == "cpu"  # a node without GPUs: the CPU is the device


SPLIT = """model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=" }
model ref : reference { source = actor }
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("DATA") { batch = 2 }
use grpo(reward = correct, group = 2, max_tokens = 3, kl_coef = 0.01)
placement {
    pool gen { gpus = 0..2, gpu_fraction = 0.5 }
    pool train { gpus = 1 }
    actor.generate -> gen
    actor.update, ref -> train
}
"""


def test_a_group_asking_for_gpus_where_none_can_come_is_an_error_at_start(tmp_path: Path) -> None:
    """A local Ray instance flowrl started has what it has: a GPU-asking pool there could never run (an error
    located at the pool); a joined cluster may grow, so its request stands. `auto` on a joined cluster with
    neither GPUs nor slots yet cannot say which its autoscaler should add."""
    path = tmp_path / "split.flow"
    path.write_text(SPLIT.replace("DATA", str(DATA)))
    graph = flowrl.load(str(path))
    with pytest.raises(flowrl.FlowError) as e:
        group_devices(graph, {"CPU": 4.0, SLOT: 4.0}, "auto", joined=False)
    assert str(e.value) == (
        f"{path}:7:5: error: worker group `gen` asks for GPUs (gpu_fraction = 0.5), but the Ray instance flowrl "
        "started here has none: no instance of it could ever run\n"
        "        pool gen { gpus = 0..2, gpu_fraction = 0.5 }\n"
        "        ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
        "hint: join a cluster with GPUs (--address; an autoscaling one adds them on demand), or run on the CPU: "
        'leave GPUs out (no `gpu_fraction`, no model `gpus`) and `run { device = "cpu" }`')
    got = group_devices(graph, {"CPU": 1.0, SLOT: 2.0}, "auto", joined=True)  # no GPU yet: gen's request stands
    assert got["gen"].asks() == {"CPU": 1.0, "GPU": 0.5} and got["train"].asks() == {"CPU": 1.0, SLOT: 1.0}
    with pytest.raises(flowrl.FlowError, match="cannot tell which its autoscaler should add for worker group "
                                               "`train`"):
        group_devices(graph, {"CPU": 1.0}, "auto", joined=True)  # train asks for nothing: GPUs or slots?
    both = group_devices(graph, {"CPU": 1.0}, "cuda", joined=True)
    assert {g: d.asks() for g, d in both.items()} == {"gen": {"CPU": 1.0, "GPU": 0.5},
                                                      "train": {"CPU": 1.0, "GPU": 1.0}}
    assert group_devices(graph, {"CPU": 1.0}, "cpu", joined=True)["train"].resource == SLOT


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
    assert why_not_movable(w) == ""
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
