"""Weights carried from one run into another (the stages of a pipeline, `runtime.pipeline`): read a run's final
weights from its last checkpoint, fit them to a model that is built differently, and load them into started
worker groups through the WorkerGroup contract alone (`state_dict` / `load_state_dict`), so every backend does it.

Only weights travel: a model's optimizer state is its own run's (an optimizer restarts with each stage).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from flowrl.errors import Diagnostic, FlowError
from flowrl.runtime.protocol import WorkerGroup

Weights = Mapping[str, torch.Tensor]
BACKBONE = "backbone."  # flowrl.models.build.ValueModel keeps its base transformer under this name


def checkpoint_weights(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every model's weights in a checkpoint (`runner._save_checkpoint`), by model name, whole: a model held by
    several groups is read from the one that trains it (a generation group of an asynchronous run may be versions
    behind), and where DeepSpeed ZeRO-3 partitioned a tensor, the module's own state holds an empty placeholder and
    the trainer's state the gathered tensor (`DeepSpeedTrainEngine.state_dict`). A LoRA model's weights are its
    trained tensors (flowrl.runtime.lora_state)."""
    return read_checkpoint(path)[0]


def read_checkpoint(path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str]]:
    """`checkpoint_weights`, and the digest of each LoRA model's base (flowrl.runtime.lora_state.BASE)."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    out: dict[str, dict[str, torch.Tensor]] = {}
    bases: dict[str, str] = {}
    trained: set[str] = set()
    for group in state["groups"].values():
        for model, s in group.items():
            trainer = s.get("optim") if isinstance(s.get("optim"), Mapping) else None
            if model in trained or (model in out and trainer is None):
                continue
            whole = trainer.get("module", {}) if trainer is not None else {}
            out[model] = {k: (whole[k] if v.numel() == 0 and k in whole else v).detach().cpu()
                          for k, v in s["module"].items()}
            if trainer is not None:
                trained.add(model)
            if isinstance(s.get("base"), str):
                bases[model] = s["base"]
    return out, bases


def fit_weights(own: Weights, given: Weights, model: str = "model") -> dict[str, torch.Tensor]:
    """`given` laid out as `own` (a model's current weights): the same keys load as they are; a causal LM's weights
    given to a value model (critic, reward model) fill its backbone and leave its value head, as `copy_backbone`
    does at step 0; a value model's given to another, its backbone too."""
    if set(own) == set(given):
        return {k: given[k] for k in own}
    backbone = [k for k in own if k.startswith(BACKBONE)]
    if not backbone:
        raise FlowError(Diagnostic(f"cannot start `{model}` from the given weights: its layout differs "
                                   f"({len(own)} tensors, {len(given)} given)",
                                   hint="a policy or reference starts from a policy's weights; a critic or "
                                        "reward model from either"))
    src = {k.removeprefix(BACKBONE): v for k, v in given.items() if k.startswith(BACKBONE)}
    if not src:  # a causal LM: its base transformer is under one prefix (`transformer.` for gpt2, `model.` llama)
        names = [k.removeprefix(BACKBONE) for k in backbone]
        prefix = next((p for p in {k.split(".", 1)[0] for k in given}
                       if all(f"{p}.{n}" in given for n in names)), None)
        if prefix is None:
            raise FlowError(Diagnostic(f"cannot start `{model}` from the given weights: no base transformer in "
                                       "them matches its backbone"))
        src = {n: given[f"{prefix}.{n}"] for n in names}
    out = dict(own)
    for k in backbone:
        name = k.removeprefix(BACKBONE)
        if name not in src or src[name].shape != own[k].shape:
            raise FlowError(Diagnostic(f"cannot start `{model}` from the given weights: `{name}` is missing or "
                                       "shaped differently"))
        out[k] = src[name].to(dtype=own[k].dtype)
    return out


def load_into(groups: Mapping[str, WorkerGroup], weights: Mapping[str, Weights]) -> None:
    """Load each named model's weights into every started group holding it (its optimizer state stays fresh)."""
    for group in groups.values():
        state = group.state_dict()
        mine = {m: w for m, w in weights.items() if m in state}
        if not mine:
            continue
        # "optim": None leaves the fresh optimizer as it is; its state (a copy, across a process) would bring the
        # trainer's own view of the old weights back
        group.load_state_dict({m: {"module": fit_weights(state[m]["module"], w, m), "optim": None}
                               for m, w in mine.items()})
