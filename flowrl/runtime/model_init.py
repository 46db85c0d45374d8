"""A worker's models built from their declarations (flowrl.runtime): each model's init seed, the device `auto`
resolves to, and a `source = other` model's starting weights. Every rank's `ModelWorker` builds its models
through `init_model`, so any process rebuilds the same step-0 weights from the run's seed without shipping them.
A model with `lora_rank` gets its adapters here, on top of those weights (flowrl.models.lora); their init is a
function of the seed too.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch

from flowrl.errors import Diagnostic, FlowError
from flowrl.ir.graph import ModelDecl
from flowrl.models.build import LoadedModel, ModelSpec, build_model, copy_backbone
from flowrl.models.lora_spec import base_of, family_of, lora_spec


def model_seed(seed: int, name: str) -> int:
    """Init seed of a model: stable across processes, so any rank can rebuild the same initial weights."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**31)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _spec(decl: ModelDecl, role: str | None = None) -> ModelSpec:
    return ModelSpec(source=decl.source, config=dict(decl.config), role=role or decl.role,
                     dtype=str(decl.options.get("dtype", "float32")))


def init_model(decl: ModelDecl, decls: Mapping[str, ModelDecl], seed: int) -> LoadedModel:
    """Build `decl`; a model with `source = other` starts from `other`'s step-0 weights (rebuilt from the
    same seed, so this works in any process without shipping weights), without `other`'s adapters (which change
    nothing at step 0: peft starts them at zero); `decl`'s own adapters go on top."""
    loaded = _init_weights(decl, decls, seed)
    spec = lora_spec(decl.options)
    if spec is None:
        return loaded
    if not decl.trainable:  # `flowrl check` says so at the key; this is for graphs made without a flow
        raise FlowError(Diagnostic(f"model `{decl.name}` has `lora_rank` and does not train", loc=decl.loc))
    from flowrl.models.lora import apply_lora

    try:
        apply_lora(loaded.module, spec, family=family_of(decl.source), seed=model_seed(seed, decl.name + ":lora"),
                   what=f"`{decl.name}` ({decl.source})")
    except ImportError as e:
        raise FlowError(Diagnostic(str(e), loc=decl.loc)) from None
    except ValueError as e:  # targets that match no layer: the error names the layers there are
        raise FlowError(Diagnostic(str(e), loc=decl.loc, hint="`lora_targets` names layers by the last parts "
                                                              "of their dotted names")) from None
    return loaded


def _init_weights(decl: ModelDecl, decls: Mapping[str, ModelDecl], seed: int) -> LoadedModel:
    if decl.source_model is None:
        return build_model(_spec(decl), model_seed(seed, decl.name))
    src = decls[decl.source_model]
    while src.source_model is not None:
        src = decls[src.source_model]
    origin = build_model(_spec(src), model_seed(seed, src.name))
    if decl.role in ("critic", "reward_model"):
        loaded = build_model(_spec(decl), model_seed(seed, decl.name))
        copy_backbone(loaded.module, origin.module)
        return loaded
    if decl.role == "reference":
        origin.module.requires_grad_(False)
        origin.module.eval()
    return origin


def shared_base(decl: ModelDecl, decls: Mapping[str, ModelDecl], held: Mapping[str, LoadedModel]) -> LoadedModel | None:
    """A reference on a LoRA policy that `held` (the models of this process's group) has: that policy's base with
    the adapters off, computing with its weights (flowrl.models.lora.base_view); None otherwise."""
    src = base_of(decl, decls)
    if src is None or src not in held:
        return None
    from flowrl.models.lora import base_view

    policy = held[src]
    return LoadedModel(module=base_view(policy.module), tokenizer=policy.tokenizer, kind=policy.kind)
