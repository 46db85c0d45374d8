"""The contract between multi-turn generation and environments (flowrl.envs): what a flow declares (`EnvSpec`),
what one environment call returns (`Outcome`) and the pool that runs them (`Envs`).

The decode loop (flowrl.engines.turns) never runs an environment itself: it asks an `Envs` for a `Future` and
keeps decoding the other samples; it looks at `Future.done()` between decode steps and waits on the pending
futures only when nothing is left to decode. So the pool decides where environments run (warm processes, or
threads in the caller for `workers = 0`) and enforces `timeout` and `on_error`; a future never raises: a failure
is an `Outcome` with `error` set (the pool applied `on_error` already, see `EnvSpec.on_error`).

One environment instance per trajectory, named by the caller's `key` (any hashable, unique within a call:
the decode loop uses (prompt_slot, sample)); `reset` creates it, `step` is sent the text of each turn's action,
`release` drops it (after its trajectory ends, whatever the reason).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["ON_ERROR", "EnvSpec", "Envs", "Outcome"]

# What a failed or timed-out environment call becomes: "observe" hands the error text back as the observation
# (the trajectory goes on), "end" ends the trajectory (reward 0 for that turn), "raise" fails the run.
ON_ERROR = ("observe", "end", "raise")


@dataclass(frozen=True)
class EnvSpec:
    """`env NAME = "module.Class" { ... }` or the tool shorthand `tool NAME = "module.fn" { ... }`."""

    name: str
    target: str  # "module.Class" (kind "env") or "module.fn" (kind "tool")
    kind: str = "env"  # "env" | "tool"
    max_turns: int = 4
    stop: tuple[str, ...] = ()  # texts that end a turn (the stop text is part of the action)
    workers: int = 2  # warm processes; 0 runs environments in threads of the caller's process
    timeout: float = 30.0  # seconds per reset/step call
    on_error: str = "observe"  # one of ON_ERROR
    call: str = ""  # tool only: the marker that opens the tool's arguments (`end` is `stop[0]`)
    imports: tuple[str, ...] = ()  # modules the flow imports (`import "..."`), imported first in each worker
    folder: str = "."  # the flow file's folder, put on sys.path in each worker
    overlap: bool = True  # False: the barrier loop (every sample's turn, then every environment, then the next turn)
    decode_batch: int = 0  # trajectories decoding at once (the engine's max_num_seqs); 0: every one
    options: Mapping[str, Any] = field(default_factory=dict)  # other keys of the block, passed to the class


@dataclass(frozen=True)
class Outcome:
    """One reset or step: the observation text to append (reset: after the prompt, may be empty), the turn's
    reward and whether the trajectory is over. `error` says what went wrong ("timeout after 2.0 s", "raised
    ValueError: ..."), with `timed_out` set for a timeout; `seconds` is the call's own time, taken where it ran."""

    observation: str
    reward: float = 0.0
    done: bool = False
    error: str | None = None
    timed_out: bool = False
    seconds: float = 0.0


class Envs(Protocol):
    """A pool of environment instances, one per trajectory."""

    def reset(self, key: Hashable, row: Mapping[str, Any]) -> Future[Outcome]: ...

    def step(self, key: Hashable, action: str) -> Future[Outcome]: ...

    def release(self, key: Hashable) -> None: ...

    def close(self) -> None: ...
