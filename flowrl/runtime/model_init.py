"""A worker's models built from their declarations (flowrl.runtime): each model's init seed, the device `auto`
resolves to, and a `source = other` model's starting weights. Every rank's `ModelWorker` builds its models
through `init_model`, so any process rebuilds the same step-0 weights from the run's seed without shipping them.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch

from flowrl.ir.graph import ModelDecl
from flowrl.models.build import LoadedModel, ModelSpec, build_model, copy_backbone


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
    same seed, so this works in any process without shipping weights)."""
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
