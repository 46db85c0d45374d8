"""The single controller's runtime: batches between nodes, worker groups, the step loop, metrics.

`flowrl.runtime.Batch` (also `flowrl.Batch`) is public: the type a user step function (`@flowrl.function`)
takes and returns. Everything else here is the backends' contract (`protocol`) or internal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowrl.runtime.batch import Batch


def __getattr__(name: str) -> Any:
    # Lazy, so that `import flowrl.runtime.protocol` (the CLI) does not import torch.
    if name == "Batch":
        from flowrl.runtime.batch import Batch

        return Batch
    raise AttributeError(f"module 'flowrl.runtime' has no attribute {name!r}")


__all__ = ["Batch"]
