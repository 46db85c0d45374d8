"""Engine selection (flowrl.engines): what a model's `engine = "..."` means, checked before anything is built.

An engine names the one part of a model that is not plain torch; everything else stays torch:

| engine      | generation                        | training                            | valid for                  |
| ----------- | --------------------------------- | ----------------------------------- | -------------------------- |
| `torch`     | torch (flowrl.engines.generation) | `TrainEngine`                       | every role                 |
| `vllm`      | vLLM (`VLLMGenerator`)            | `TrainEngine` (torch)               | `policy` only              |
| `deepspeed` | torch                             | `DeepSpeedTrainEngine` (ZeRO)       | trainable models           |

Teacher-forced passes (log-probs, values, scores) always run on the torch module. So `engine = "vllm"` on a
policy means vLLM rollouts with torch training, whose updated weights are pushed into vLLM after every update;
vLLM needs an `hf:` source (it loads a checkpoint directory) and a CUDA device. `engine = "deepspeed"` means
DeepSpeed training (options `zero_stage` 0-3, default 0, and `offload`, default false) with torch generation.
One model cannot combine the two today: that would need weight sync from ZeRO partitions into vLLM.

`check_engine` reports every problem of one model at once as a `FlowError`; `make_trainer` builds the trainer.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from flowrl.engines.training import TrainEngine
from flowrl.errors import Diagnostic, FlowError, Loc
from flowrl.ir.signatures import ENGINES

__all__ = ["ENGINES", "Trainer", "check_engine", "forward_module", "make_trainer"]

# engine -> (import name, what to call it in messages, extra to install)
_PACKAGES = {"vllm": ("vllm", "vLLM", "vllm"), "deepspeed": ("deepspeed", "DeepSpeed", "deepspeed")}
_TRAINABLE_ROLES = ("policy", "critic")
_ZERO_STAGES = (0, 1, 2, 3)


class Trainer(Protocol):
    """What the worker needs from a training engine (TrainEngine and DeepSpeedTrainEngine both fit)."""

    module: nn.Module
    steps: int  # optimizer steps taken (skipped ones not counted)

    @property
    def lr(self) -> float: ...

    def set_lr(self, lr: float) -> None: ...

    def set_max_grad_norm(self, bound: float | None) -> None: ...

    def step(self, micro_batches: Sequence[Any], loss_fn: Any) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def check_engine(
    engine: str,
    role: str,
    *,
    model: str | None = None,
    trainable: bool | None = None,
    source: str | None = None,
    device: str | torch.device | None = None,
    options: Mapping[str, Any] | None = None,
    loc: Loc | None = None,
) -> None:
    """Raise a FlowError listing every reason `engine` cannot serve this model.

    `role` alone decides what it may do; the keyword facts are checked when given (`trainable` defaults to the
    role's default, `device` None means "this process's default", i.e. CUDA if there is one).
    """
    who = f"model `{model}`" if model else "this model"
    problems: list[Diagnostic] = []

    def problem(message: str, hint: str) -> None:
        problems.append(Diagnostic(message, loc=loc, hint=hint))

    if engine not in ENGINES:
        problem(f"unknown engine \"{engine}\" for {who}", f"engines: {', '.join(ENGINES)}")
        raise FlowError(problems)
    if engine == "vllm" and role != "policy":
        problem(f"engine \"vllm\" only generates, and {who} is a {role}, which never generates",
                "use engine = \"torch\" (log-probs, values and scores always run on the torch module)")  # fmt: skip
    if engine == "deepspeed" and not (trainable if trainable is not None else role in _TRAINABLE_ROLES):
        problem(f"engine \"deepspeed\" only trains, and {who} ({role}) is not trainable",
                "use engine = \"torch\", or set trainable = true")  # fmt: skip
    if engine in _PACKAGES:
        package, label, extra = _PACKAGES[engine]
        if importlib.util.find_spec(package) is None:
            problem(f"engine \"{engine}\" needs {label}, which is not installed",
                    f"pip install 'flowrl[{extra}]', or use engine = \"torch\"")  # fmt: skip
    if engine == "vllm":
        if source is not None and not source.startswith("hf:"):
            problem(f"engine \"vllm\" needs an hf: source, and {who} has source \"{source}\"",
                    "vLLM loads a checkpoint directory: source = \"hf:/abs/path\"; or use engine = \"torch\"")  # fmt: skip
        if not _has_cuda(device):
            placed = device is not None and str(device) != "auto" and torch.device(device).type != "cuda"
            where = f"{who} is placed on device \"{device}\"" if placed else f"none is visible to {who}"
            problem(f"engine \"vllm\" needs a CUDA device, and {where}",
                    "use engine = \"torch\" to generate on the CPU")  # fmt: skip
    if options is not None and options.get("missing_eos_penalty") and role != "reward_model":
        problem(f"missing_eos_penalty is a reward model's, and {who} is a {role}",
                "set it on the reward_model that scores the rollouts")  # fmt: skip
    if engine == "deepspeed" and options is not None:
        for message, hint in _deepspeed_option_problems(options):
            problem(message, hint)
    if problems:
        raise FlowError(problems)


def make_trainer(
    engine: str,
    module: nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.0,
    max_grad_norm: float | None = 1.0,
    options: Mapping[str, Any] | None = None,
) -> Trainer:
    """The training engine `engine` implies: DeepSpeed for "deepspeed", torch's TrainEngine otherwise."""
    options = options or {}
    if engine not in ENGINES:
        check_engine(engine, "policy")  # raises the "unknown engine" error
    if engine != "deepspeed":
        return TrainEngine(module, lr=lr, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
    problems = _deepspeed_option_problems(options)
    if problems:
        raise FlowError([Diagnostic(message, hint=hint) for message, hint in problems])
    from flowrl.engines.deepspeed_engine import DeepSpeedTrainEngine

    try:
        return DeepSpeedTrainEngine(
            module, lr=lr, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
            zero_stage=int(options.get("zero_stage", 0)), offload=bool(options.get("offload", False)),
        )  # fmt: skip
    except ImportError as exc:
        raise FlowError(Diagnostic(str(exc), hint="or use engine = \"torch\"")) from exc


def forward_module(trainer: Trainer) -> nn.Module:
    """The module a loss function must call: DeepSpeed's engine wrapper (its backward hooks need it) or the module."""
    wrapped = getattr(trainer, "forward_module", None)
    return wrapped if isinstance(wrapped, nn.Module) else trainer.module


def _has_cuda(device: str | torch.device | None) -> bool:
    if device is None or str(device) == "auto":
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def _deepspeed_option_problems(options: Mapping[str, Any]) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    stage = options.get("zero_stage", 0)
    # bool is an int subclass; `zero_stage = true` is a mistake, not stage 1.
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in _ZERO_STAGES:
        found.append((f"zero_stage must be 0, 1, 2 or 3, got {stage!r}",
                      "0: plain data parallel; 1: shard optimizer state; 2: + gradients; 3: + weights"))  # fmt: skip
    offload = options.get("offload", False)
    if not isinstance(offload, bool):
        found.append((f"offload must be true or false, got {offload!r}",
                      "offload = true keeps the optimizer state in CPU memory"))  # fmt: skip
    elif offload and stage == 0:
        found.append(("offload = true needs zero_stage 1, 2 or 3 (it offloads the state ZeRO partitions)",
                      "set zero_stage = 2 (or 1 or 3), or drop offload"))  # fmt: skip
    return found
