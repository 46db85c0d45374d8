"""Tests for flowrl.engines.select: which engine builds what, and every error `check_engine` can raise.

"Not installed" is produced for real: `sys.modules[name] = None` is Python's documented way to make a package
unimportable (find_spec returns None and `import` raises ImportError), whatever this machine has installed.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest
import torch

from flowrl.engines.select import ENGINES, check_engine, forward_module, make_trainer
from flowrl.engines.training import TrainEngine
from flowrl.errors import FlowError, Loc
from flowrl.models.build import ModelSpec, build_model

TINY = {"layers": 1, "dim": 32, "heads": 2}
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
HAS_CUDA = torch.cuda.is_available()


def _policy() -> Any:
    return build_model(ModelSpec("tiny:gpt2", TINY), seed=0).module


def _errors(engine: str, role: str, **facts: Any) -> list[str]:
    """Each diagnostic check_engine raises, rendered as the user sees it."""
    with pytest.raises(FlowError) as info:
        check_engine(engine, role, **facts)
    return [d.render() for d in info.value.diagnostics]


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)


@pytest.fixture
def no_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)


# ---- what each engine builds ---------------------------------------------------------------------------
def test_engines_are_the_languages_engines() -> None:
    assert ENGINES == ("torch", "vllm", "deepspeed")


@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_torch_and_vllm_models_train_with_torch(engine: str) -> None:
    module = _policy()
    trainer = make_trainer(engine, module, lr=3e-4, weight_decay=0.1, max_grad_norm=2.0, options={})
    assert isinstance(trainer, TrainEngine)
    assert trainer.module is module and trainer.lr == 3e-4 and trainer.max_grad_norm == 2.0
    assert trainer.optimizer.param_groups[0]["weight_decay"] == 0.1
    assert forward_module(trainer) is module


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_deepspeed_models_train_with_deepspeed() -> None:
    from flowrl.engines.deepspeed_engine import DeepSpeedTrainEngine

    module = _policy()
    trainer = make_trainer("deepspeed", module, lr=3e-4, weight_decay=0.1, options={"zero_stage": 2})
    assert isinstance(trainer, DeepSpeedTrainEngine)
    assert trainer.zero_stage == 2 and trainer.module is module and trainer.lr == 3e-4
    assert forward_module(trainer) is trainer.forward_module is not module  # losses must run through DeepSpeed


@pytest.mark.parametrize("role", ["policy", "reference", "critic", "reward_model"])
def test_torch_serves_every_role(role: str) -> None:
    check_engine("torch", role, model="m", trainable=False, source="tiny:gpt2", device="cpu")


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed")
@pytest.mark.parametrize("role", ["policy", "critic"])
def test_deepspeed_serves_trainable_roles(role: str) -> None:
    check_engine("deepspeed", role, model="m", source="tiny:gpt2", device="cpu",
                 options={"zero_stage": 3, "offload": True})  # fmt: skip


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None or not HAS_CUDA, reason="needs vLLM and a GPU")
def test_vllm_serves_a_policy_from_an_hf_checkpoint_on_cuda() -> None:
    check_engine("vllm", "policy", model="actor", source="hf:/models/qwen", device="cuda")


# ---- every error -----------------------------------------------------------------------------------------
def test_unknown_engine() -> None:
    assert _errors("vlm", "policy", model="actor") == [
        'error: unknown engine "vlm" for model `actor`\n'
        "hint: engines: torch, vllm, deepspeed"
    ]
    with pytest.raises(FlowError, match='unknown engine "jax" for this model'):
        make_trainer("jax", _policy(), lr=1e-3)


def test_errors_carry_the_declarations_location() -> None:
    assert _errors("vlm", "policy", model="actor", loc=Loc("grpo.flow", 3, 5)) == [
        'grpo.flow:3:5: error: unknown engine "vlm" for model `actor`\n'
        "hint: engines: torch, vllm, deepspeed"
    ]


@pytest.mark.parametrize("role", ["reference", "critic", "reward_model"])
def test_vllm_is_only_for_the_policy(role: str, no_vllm: None) -> None:
    assert (
        f'error: engine "vllm" only generates, and model `m` is a {role}, which never generates\n'
        'hint: use engine = "torch" (log-probs, values and scores always run on the torch module)'
    ) in _errors("vllm", role, model="m")


def test_vllm_not_installed(no_vllm: None) -> None:
    assert (
        'error: engine "vllm" needs vLLM, which is not installed\n'
        "hint: pip install 'flowrl[vllm]', or use engine = \"torch\""
    ) in _errors("vllm", "policy", model="actor")


def test_vllm_needs_an_hf_source(no_vllm: None) -> None:
    assert (
        'error: engine "vllm" needs an hf: source, and model `actor` has source "tiny:gpt2"\n'
        'hint: vLLM loads a checkpoint directory: source = "hf:/abs/path"; or use engine = "torch"'
    ) in _errors("vllm", "policy", model="actor", source="tiny:gpt2")


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_vllm_needs_a_cuda_device(device: Any, no_vllm: None) -> None:
    assert (
        'error: engine "vllm" needs a CUDA device, and model `actor` is placed on device "cpu"\n'
        'hint: use engine = "torch" to generate on the CPU'
    ) in _errors("vllm", "policy", model="actor", device=device)


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA device")
@pytest.mark.parametrize("device", [None, "auto", "cuda"])
def test_vllm_without_any_cuda_device(device: str | None, no_vllm: None) -> None:
    assert (
        'error: engine "vllm" needs a CUDA device, and none is visible to model `actor`\n'
        'hint: use engine = "torch" to generate on the CPU'
    ) in _errors("vllm", "policy", model="actor", device=device)


def test_every_problem_of_a_model_is_reported_together(no_vllm: None) -> None:
    assert _errors("vllm", "critic", source="tiny:gpt2", device="cpu", loc=Loc("ppo.flow", 7, 1)) == [
        'ppo.flow:7:1: error: engine "vllm" only generates, and this model is a critic, which never generates\n'
        'hint: use engine = "torch" (log-probs, values and scores always run on the torch module)',
        'ppo.flow:7:1: error: engine "vllm" needs vLLM, which is not installed\n'
        "hint: pip install 'flowrl[vllm]', or use engine = \"torch\"",
        'ppo.flow:7:1: error: engine "vllm" needs an hf: source, and this model has source "tiny:gpt2"\n'
        'hint: vLLM loads a checkpoint directory: source = "hf:/abs/path"; or use engine = "torch"',
        'ppo.flow:7:1: error: engine "vllm" needs a CUDA device, and this model is placed on device "cpu"\n'
        'hint: use engine = "torch" to generate on the CPU',
    ]


@pytest.mark.parametrize(("role", "trainable"), [("reference", None), ("reward_model", None), ("policy", False)])
def test_deepspeed_is_only_for_trainable_models(role: str, trainable: bool | None, no_deepspeed: None) -> None:
    assert _errors("deepspeed", role, model="m", trainable=trainable) == [
        f'error: engine "deepspeed" only trains, and model `m` ({role}) is not trainable\n'
        'hint: use engine = "torch", or set trainable = true',
        'error: engine "deepspeed" needs DeepSpeed, which is not installed\n'
        "hint: pip install 'flowrl[deepspeed]', or use engine = \"torch\"",
    ]


def test_deepspeed_not_installed(no_deepspeed: None) -> None:
    assert _errors("deepspeed", "critic", model="critic") == [
        'error: engine "deepspeed" needs DeepSpeed, which is not installed\n'
        "hint: pip install 'flowrl[deepspeed]', or use engine = \"torch\""
    ]
    with pytest.raises(FlowError) as info:
        make_trainer("deepspeed", _policy(), lr=1e-3)
    assert info.value.render() == (
        "error: engine \"deepspeed\" needs DeepSpeed, which is not installed: pip install 'flowrl[deepspeed]'\n"
        'hint: or use engine = "torch"'
    )


@pytest.mark.parametrize(
    ("options", "rendered"),
    [
        ({"zero_stage": 4}, "error: zero_stage must be 0, 1, 2 or 3, got 4\n"
                            "hint: 0: plain data parallel; 1: shard optimizer state; 2: + gradients; 3: + weights"),
        ({"zero_stage": True}, "error: zero_stage must be 0, 1, 2 or 3, got True\n"
                               "hint: 0: plain data parallel; 1: shard optimizer state; 2: + gradients; 3: + weights"),
        ({"zero_stage": "2"}, "error: zero_stage must be 0, 1, 2 or 3, got '2'\n"
                              "hint: 0: plain data parallel; 1: shard optimizer state; 2: + gradients; 3: + weights"),
        ({"zero_stage": 2, "offload": "cpu"}, "error: offload must be true or false, got 'cpu'\n"
                                              "hint: offload = true keeps the optimizer state in CPU memory"),
        ({"offload": True}, "error: offload = true needs zero_stage 1, 2 or 3 (it offloads the state ZeRO partitions)\n"
                            "hint: set zero_stage = 2 (or 1 or 3), or drop offload"),
    ],
)  # fmt: skip
def test_deepspeed_options(options: dict[str, Any], rendered: str, no_deepspeed: None) -> None:
    assert rendered in _errors("deepspeed", "policy", options=options)
    with pytest.raises(FlowError) as info:  # make_trainer checks them before importing DeepSpeed
        make_trainer("deepspeed", _policy(), lr=1e-3, options=options)
    assert info.value.render() == rendered
