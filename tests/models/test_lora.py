"""LoRA on flowrl's models (flowrl.models.lora, flowrl.runtime.model_init, the worker): only the adapters (and a value
model's head) train and hold optimizer state; a reference on a LoRA policy is that policy's base with the adapters
off, computing with the policy's own tensors (one copy, measured), also while ranks run forwards of both on threads;
targets an `hf:` model lacks are named at build with the layers it has."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import flowrl
from flowrl.errors import FlowError
from flowrl.ir.graph import Graph
from flowrl.ir.signatures import MODEL_KEYS, TINY_SOURCES
from flowrl.models.build import ModelSpec, build_model
from flowrl.models.lora import BaseView, adapters_of, linear_modules
from flowrl.models.lora_spec import TINY_LINEAR, LoraSpec
from flowrl.runtime.batch import Batch
from flowrl.runtime.model_init import model_seed
from flowrl.runtime.worker import ModelWorker

ROOT = Path(__file__).resolve().parents[2]
CHARSET = "0123456789+="
FLOW = """
model actor : policy {{ source = "tiny:{family}", layers = 1, dim = 32, heads = 2, charset = "{charset}", lr = 1e-2,
                        lora_rank = 4{actor} }}
model ref : reference {{ source = actor }}
model critic : critic {{ source = actor, lr = 1e-2, lora_rank = 2 }}
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("data.jsonl") {{ batch = 4 }}
use ppo(reward = correct, critic = critic, n = 2, max_tokens = 3, kl_coef = 0.1)
"""


def load(tmp_path: Path, family: str = "gpt2", actor: str = "") -> Graph:
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(3) for b in range(3)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "f.flow").write_text(FLOW.format(family=family, charset=CHARSET, actor=actor))
    return flowrl.load(str(tmp_path / "f.flow"))


def rollout(worker: ModelWorker) -> Batch:
    prompts = Batch(4, {}, {"prompt": ["1+2=", "2+2=", "0+1=", "3+"]})
    attrs = {"n": 2, "max_tokens": 3, "temperature": 1.0}
    out = worker.generate("actor", prompts, attrs, step_seed=1)
    shape = out["response_ids"].shape
    gen = torch.Generator().manual_seed(0)
    return Batch(out.size, {**out.tensors, "advantages": torch.randn(shape, generator=gen),
                            "returns": torch.randn(shape, generator=gen)}, out.meta, primary="response_ids")


def test_the_defaults_are_the_languages() -> None:
    assert (LoraSpec(8).alpha, LoraSpec(8).dropout) == (MODEL_KEYS["lora_alpha"][1], MODEL_KEYS["lora_dropout"][1])


@pytest.mark.parametrize("source", TINY_SOURCES)
def test_the_tiny_models_linear_layers_are_the_ones_check_names(source: str) -> None:
    for role in ("policy", "critic"):
        module = build_model(ModelSpec(source, {"layers": 1, "dim": 32, "heads": 2}, role=role), 0).module
        assert sorted({n.rsplit(".", 1)[-1] for n in linear_modules(module)}) == sorted(TINY_LINEAR[source])


def test_only_the_adapters_and_a_critics_head_train_and_hold_optimizer_state(tmp_path: Path) -> None:
    graph = load(tmp_path)
    worker = ModelWorker(graph.models, graph.models, seed=0)
    batch = rollout(worker)
    for name, attrs in (("actor", {"loss": "ppo_clip"}), ("critic", {"loss": "value"})):
        module = worker.models[name].module
        adapters = adapters_of(module)
        assert adapters is not None
        trained = {n for n, p in module.named_parameters() if p.requires_grad}
        lora = {n for n in trained if ".lora_A." in n or ".lora_B." in n}
        assert trained == lora | ({"value_head.weight", "value_head.bias"} if name == "critic" else set())
        assert set(adapters.trainable) == trained and len(lora) == 2 * len(adapters.targets)
        worker.update(name, batch, attrs, step_seed=0)
        optimizer = worker.trainers[name].optimizer  # type: ignore[attr-defined]
        held = {id(p) for p, state in optimizer.state.items() if state}
        params = dict(module.named_parameters())
        assert held == {id(params[n]) for n in trained}  # AdamW's moments for exactly those
        moments = sum(t.numel() for s in optimizer.state.values() for k, t in s.items() if k != "step")
        assert moments == 2 * sum(params[n].numel() for n in trained)
        # what a checkpoint and a weight sync hold: the trained tensors and the base's digest
        state = worker.state_dict()[name]
        assert set(state["module"]) == trained and set(state["optim"]["module"]) == trained
        assert state["base"] == adapters.digest


def test_the_reference_is_the_policys_base_with_its_adapters_off(tmp_path: Path) -> None:
    graph = load(tmp_path)
    worker = ModelWorker(graph.models, graph.models, seed=0)
    actor, ref = worker.models["actor"].module, worker.models["ref"].module
    assert isinstance(ref, BaseView) and ref.state_dict() == {} and worker.state_dict()["ref"]["module"] == {}
    # one copy: every tensor the reference computes with is the policy's own storage
    policy = {p.data_ptr() for p in actor.parameters()}
    base = list(ref.parameters())
    assert base and all(p.data_ptr() in policy for p in base)
    assert sum(p.numel() for p in base) + sum(p.numel() for p in actor.parameters() if p.requires_grad) == \
        sum(p.numel() for p in actor.parameters())
    plain = build_model(ModelSpec("tiny:gpt2", dict(graph.model("actor").config)), model_seed(0, "actor")).module
    with torch.no_grad():
        for n, p in actor.named_parameters():
            if ".lora_B." in n:  # adapters that change the policy (peft starts them at zero)
                p.normal_(0, 0.5)
    ids = torch.tensor([[13, 1, 10, 2, 11, 3]])
    with torch.no_grad():
        policy_logits, ref_logits, base_logits = actor(input_ids=ids).logits, ref(input_ids=ids).logits, \
            plain(input_ids=ids).logits
        again = actor(input_ids=ids).logits
    torch.testing.assert_close(ref_logits, base_logits, rtol=0, atol=1e-6)
    assert not torch.allclose(policy_logits, base_logits, atol=1e-3)
    assert torch.equal(again, policy_logits)  # switched back on
    assert all(p.requires_grad for n, p in actor.named_parameters() if ".lora_" in n)


def test_forwards_of_the_policy_and_its_base_on_threads_each_get_their_own(tmp_path: Path) -> None:
    """The threads backend's ranks run forwards at once; whichever thread runs which, the policy's have the adapters
    and the reference's do not (each compared with the same forward run alone)."""
    graph = load(tmp_path)
    worker = ModelWorker(graph.models, graph.models, seed=0)
    actor, ref = worker.models["actor"].module, worker.models["ref"].module
    with torch.no_grad():
        for n, p in actor.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.5)
    ids = torch.tensor([[13, 1, 10, 2, 11, 3]] * 2)
    with torch.no_grad():
        want = {"actor": actor(input_ids=ids).logits, "ref": ref(input_ids=ids).logits}
    start = threading.Barrier(4)
    wrong: list[str] = []

    def loop(name: str, module: torch.nn.Module) -> None:
        start.wait()
        with torch.no_grad():
            for _ in range(30):
                if not torch.equal(module(input_ids=ids).logits, want[name]):
                    wrong.append(name)

    threads = [threading.Thread(target=loop, args=(n, worker.models[n].module)) for n in ("actor", "ref") * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_targets_an_hf_model_lacks_are_an_error_at_build_naming_its_layers(tmp_path: Path) -> None:
    from tests.runtime.test_export_run import hf_source  # a 1-layer GPT-2 with a character tokenizer

    hf_source(tmp_path / "hf")
    text = f'model actor : policy {{ source = "hf:{tmp_path / "hf"}", lora_rank = 2, lora_targets = ["c_attn", "q_proj"] }}\n'
    graph = flowrl.load(str(_write(tmp_path, text)))
    with pytest.raises(FlowError) as info:
        ModelWorker(graph.models, graph.models, seed=0)
    assert info.value.render() == (
        f"{tmp_path / 'f.flow'}:1:1: error: `lora_targets` 'q_proj' match no linear module of `actor` "
        f'(hf:{tmp_path / "hf"}); its linear modules are c_attn, c_fc, c_proj, lm_head (or write "all-linear")\n'
        "hint: `lora_targets` names layers by the last parts of their dotted names")


def _write(tmp_path: Path, model: str) -> Path:
    (tmp_path / "demos.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    (tmp_path / "f.flow").write_text(model + 'data demos = jsonl("demos.jsonl") { batch = 1 }\nuse sft(demos = demos)\n')
    return tmp_path / "f.flow"


MEASURE = """
import json, sys, psutil, torch, flowrl
from flowrl.runtime.worker import ModelWorker
proc = psutil.Process()
out = {}
workers = []
for name in ("lora_small", "full_small"):  # imports and first-build allocations, counted in neither figure
    graph = flowrl.load(sys.argv[1] + "/" + name + ".flow")
    workers.append(ModelWorker(graph.models, graph.models, seed=0))
for name in sys.argv[2:]:  # one arm a process: what the allocator kept from another arm's build is not reused
    graph = flowrl.load(sys.argv[1] + "/" + name + ".flow")
    before = proc.memory_info().rss
    workers.append(ModelWorker(graph.models, graph.models, seed=0))
    out[name] = proc.memory_info().rss - before
    ptrs = {}
    for m in workers[-1].models.values():
        for p in m.module.parameters():
            ptrs[p.data_ptr()] = p.numel() * p.element_size()
    out[name + "_storage"] = sum(ptrs.values())
print(json.dumps(out))
"""


def test_one_copy_of_the_base_in_memory(tmp_path: Path) -> None:
    """A policy of 12.6M parameters and its reference, built with LoRA and without in a fresh process: the resident
    memory each adds (psutil, the kernel's count) is about one copy of the weights with LoRA, two without, as the
    parameters' own storage says."""
    shape = 'source = "tiny:gpt2", layers = 4, dim = 512, heads = 8, charset = "0123456789+=", lr = 1e-3'
    small = 'source = "tiny:gpt2", layers = 1, dim = 16, heads = 2, charset = "0123456789+=", lr = 1e-3'
    for name, extra in (("lora", ", lora_rank = 8"), ("full", ""), ("lora_small", ", lora_rank = 8"),
                        ("full_small", "")):
        (tmp_path / f"{name}.flow").write_text(
            f"model actor : policy {{ {small if name.endswith('_small') else shape}{extra} }}\n"
            "model ref : reference { source = actor }\n"
            'reward correct = "flowrl.rewards.arith_exact"\n'
            f'data prompts = jsonl("{ROOT / "examples" / "data" / "arith.jsonl"}")\n'
            "use grpo(reward = correct, group = 2, max_tokens = 2)\n")
    got: dict[str, int] = {}
    for arm in ("lora", "full"):
        done = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path), arm], capture_output=True, text=True,
                              timeout=600, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-3000:]
        got.update(json.loads(done.stdout.strip().splitlines()[-1]))
    copy = 12_650_000 * 4  # bytes of one copy of the weights (fp32), roughly
    assert copy * 0.95 < got["lora_storage"] < copy * 1.1 and copy * 1.9 < got["full_storage"] < copy * 2.1
    # the kernel's count agrees: the LoRA worker adds one copy's worth, the full one two (torch's own allocations
    # beside them are the same for both)
    assert got["lora"] < 0.7 * got["full"] and got["full"] > 1.8 * copy, got


@pytest.mark.filterwarnings("ignore:`torch.distributed.*is deprecated:FutureWarning")
@pytest.mark.parametrize("stage", [0, 2])
def test_the_deepspeed_engine_trains_the_adapters_as_torch_does(tmp_path: Path, stage: int) -> None:
    """engine = "deepspeed" (ZeRO 0 and 2, CPU): its optimizer holds the adapters alone, and one update leaves them
    where the torch engine's does; the reference still computes with the policy's base."""
    torch_graph = load(tmp_path)
    ds_graph = load(tmp_path, actor=f', engine = "deepspeed", zero_stage = {stage}')
    got = {}
    for name, graph in (("torch", torch_graph), ("deepspeed", ds_graph)):
        worker = ModelWorker([graph.model("actor"), graph.model("ref")], graph.models, seed=0)
        worker.update("actor", rollout(worker), {"loss": "ppo_clip"}, step_seed=0)
        got[name] = worker.state_dict()["actor"]["module"]
        if name == "deepspeed":
            # what AdamW steps: the adapters themselves (ZeRO 0) or ZeRO-2's flat fp32 partition of them
            groups = worker.trainers["actor"].optimizer.param_groups  # type: ignore[attr-defined]
            held = sum(p.numel() for group in groups for p in group["params"])
            trained = sum(p.numel() for p in worker.models["actor"].module.parameters() if p.requires_grad)
            assert held == trained == sum(t.numel() for t in got[name].values())
            policy = {p.data_ptr() for p in worker.models["actor"].module.parameters()}
            assert all(p.data_ptr() in policy for p in worker.models["ref"].module.parameters())
    assert got["torch"].keys() == got["deepspeed"].keys()
    for key, value in got["torch"].items():
        torch.testing.assert_close(got["deepspeed"][key], value, rtol=1e-4, atol=1e-6)


def test_an_adapted_lm_head_tied_to_the_embeddings_exports_untied(tmp_path: Path) -> None:
    """GPT-2 ties its output layer to its input embeddings; an adapter on `lm_head` changes the output alone, so the
    merged export unties them (merging in place would change the embeddings too) and gives flowrl's logits."""
    from transformers import AutoModelForCausalLM

    from flowrl.models.export import export_model
    from flowrl.models.lora import apply_lora, merged_state

    spec = ModelSpec("tiny:gpt2", {"layers": 1, "dim": 32, "heads": 2, "charset": CHARSET})
    module = build_model(spec, 0).module
    apply_lora(module, LoraSpec(4, targets=("c_attn", "lm_head")), family="gpt2", seed=1)
    with torch.no_grad():
        for n, p in module.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.5)
    ids = torch.tensor([[13, 1, 10, 2, 11]])
    with torch.no_grad():
        ours = module(input_ids=ids).logits
    weights, untied = merged_state(module)
    assert untied and not torch.equal(weights["lm_head.weight"], weights["transformer.wte.weight"])
    export_model(weights, spec, tmp_path / "hf", untie=untied)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert theirs.lm_head.weight.data_ptr() != theirs.transformer.wte.weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids).logits, ours, rtol=0, atol=1e-5)
