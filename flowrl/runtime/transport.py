"""Model state through Ray's object store as numpy arrays (the Ray backend's weight sync and snapshots, the
serverless backend's weights and optimizer state).

Ray pickles a torch tensor in-band (its bytes copied into the pickle and out again: 9.6 ms to put and 6 ms to
get 5.6 MB of state here), but hands numpy arrays over out-of-band (3.9 ms and 0.3 ms: the getter reads the
object store's memory). `pack` turns every tensor of a nested state (a state dict, an optimizer's state) into an
`Array` (dtypes numpy lacks, bfloat16 among them, travel as same-width integers); `unpack` turns them back into
tensors that own their memory (the object store's is read-only, and an optimizer updates its state in place).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_CARRIER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Array:
    data: np.ndarray
    dtype: torch.dtype


def pack(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        try:
            return Array(t.numpy(), t.dtype)
        except TypeError:  # no numpy dtype (bfloat16, float8): the same bytes as integers of its width
            return Array(t.view(_CARRIER[t.element_size()]).numpy(), t.dtype)
    if isinstance(obj, dict):
        return {k: pack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(pack(v) for v in obj)
    return obj


def unpack(obj: Any) -> Any:
    if isinstance(obj, Array):
        t = torch.from_numpy(obj.data.copy())
        return t if t.dtype == obj.dtype else t.view(obj.dtype)
    if isinstance(obj, dict):
        return {k: unpack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(unpack(v) for v in obj)
    return obj
