"""Environments and tools for multi-turn rollouts (flowrl.envs): the contract (protocol.py), the pool that runs
them (pool.py) and the tool shorthand (tools.py)."""

from __future__ import annotations

from flowrl.envs.protocol import ON_ERROR, EnvSpec, Envs, Outcome

__all__ = ["ON_ERROR", "EnvSpec", "Envs", "Outcome"]
