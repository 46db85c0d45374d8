"""What a worker saves, syncs and loads of a model with LoRA adapters (flowrl.runtime, beside `ModelWorker`): only the
trained tensors (the adapters, and a value model's head) and their optimizer state, never the frozen base, which
every process rebuilds from the source and the seed (flowrl.runtime.model_init). A checkpoint keeps the base's digest
beside them: loading adapters onto another base (a changed `hf:` directory) is an error, not a silently different
model. Models without adapters go through as whole state dicts, as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from flowrl.engines.select import Trainer
from flowrl.errors import Diagnostic, FlowError
from flowrl.models.lora import adapters_of

__all__ = ["BASE", "adapter_dropout", "base_entry", "check_base", "load_module_state", "load_trainer_state", "module_state", "trainer_state"]

BASE = "base"  # a LoRA model's checkpoint entry: the digest of the base its adapters were trained on


def module_state(module: nn.Module) -> dict[str, Tensor]:
    """`module`'s weights to save or send: a LoRA model's trained tensors, else its whole state dict."""
    adapters = adapters_of(module)
    return adapters.state(module) if adapters is not None else module.state_dict()


def trainer_state(trainer: Trainer, module: nn.Module) -> dict[str, Any]:
    """The trainer's state, its copy of the weights cut to the trained tensors for a LoRA model."""
    state = trainer.state_dict()
    adapters = adapters_of(module)
    if adapters is None:
        return state
    whole = state.get("module", {})
    return {**state, "module": {k: whole[k] for k in adapters.trainable if k in whole}}


def base_entry(module: nn.Module) -> dict[str, str]:
    """The checkpoint entry naming a LoRA model's base ({} for a model without adapters)."""
    adapters = adapters_of(module)
    return {BASE: adapters.digest} if adapters is not None else {}


def load_module_state(name: str, module: nn.Module, state: Mapping[str, Tensor], digest: str | None = None) -> None:
    """Load what `module_state` gave (`digest`: the base it was trained on, when the state says)."""
    adapters = adapters_of(module)
    if adapters is None:
        module.load_state_dict(state)
        return
    check_base(name, module, digest)
    adapters.load(module, state)


def check_base(name: str, module: nn.Module, digest: str | None) -> None:
    """FlowError when a LoRA model's saved adapters (`digest`: the base they were trained on) meet another base."""
    adapters = adapters_of(module)
    if adapters is not None and digest is not None and digest != adapters.digest:
        raise FlowError(Diagnostic(f"the adapters of `{name}` were trained on other base weights than the ones "
                                   f"rebuilt here (digest {digest}, rebuilt {adapters.digest})",
                                   hint="the base is rebuilt from the model's source and the run's seed: the `hf:` "
                                        "directory (or the torch version that initialised a tiny model) must be "
                                        "the one the run started with"))


def load_trainer_state(trainer: Trainer, module: nn.Module, state: Mapping[str, Any]) -> None:
    """Load what `trainer_state` gave: for a LoRA model the trainer's copy of the weights is completed with the base
    it holds (the engines load whole modules)."""
    adapters = adapters_of(module)
    if adapters is not None and "module" in state:
        whole = trainer.state_dict()["module"]
        state = {**state, "module": {**whole, **state["module"]}}
    trainer.load_state_dict(state)


def adapter_dropout(module: nn.Module) -> contextlib.AbstractContextManager[None]:
    """A LoRA model's `lora_dropout` in force while an update runs (nothing for other models)."""
    adapters = adapters_of(module)
    return adapters.dropout(module) if adapters is not None else contextlib.nullcontext()
