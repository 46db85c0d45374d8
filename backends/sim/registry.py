"""The simulator's policies by name (flowrl.backends.sim): what `flowrl simulate --policy` and `flowrl plan` make.

Its own module so that policies.py (the serverful family) and rlhfless.py (built on it) import in one direction.
"""

from __future__ import annotations

from flowrl.backends.sim.costs import CostModel
from flowrl.backends.sim.policies import Options, PipeRLHF, RLHFuse, Serverful
from flowrl.backends.sim.rlhfless import RLHFless
from flowrl.backends.sim.work import FlowWork
from flowrl.errors import Diagnostic, FlowError

POLICIES: dict[str, type[Serverful]] = {"serverful": Serverful, "rlhfuse": RLHFuse, "rlhfless": RLHFless,
                                        "pipe-rlhf": PipeRLHF}


def make(name: str, cost: CostModel, work: FlowWork, opts: Options) -> Serverful:
    """The policy `name` on the cost model's cluster for the flow's work."""
    if name not in POLICIES:
        raise FlowError(Diagnostic(f"no simulator policy {name!r}", hint=f"one of {', '.join(POLICIES)}"))
    return POLICIES[name](cost, work, opts)
