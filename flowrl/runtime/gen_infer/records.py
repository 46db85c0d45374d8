"""The typed records of the fused generation stage (flowrl.runtime.gen_infer): jobs a rank thread is given, events
it reports back to the scheduler, what is queued for another worker group, and the timeline's entries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowrl.engines.chunked_generation import Tail
from flowrl.ir.graph import Node
from flowrl.runtime.batch import Batch
from flowrl.runtime.chunks import Scored

ELSEWHERE = -1  # the `Timed.rank` of forwards run by another worker group


@dataclass
class Timed:
    """One piece of work of the stage: which rank ran it and when (seconds, perf_counter)."""

    what: str
    rank: int
    start: float
    end: float


# -- jobs for a generation rank (its thread runs them in order) ------------------------------------------------


@dataclass(frozen=True)
class Stream:
    """Pull a stream (`generate_stream` or `resume_stream`) on the rank to its end."""

    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Forward:
    """Run `node` on chunk `cid` on the rank."""

    cid: int
    node: Node


@dataclass(frozen=True)
class Take:
    """Run `node` (a `spill_to` forward) on `chunk`, claimed from the other group's queue."""

    node: Node
    chunk: Batch


Job = Stream | Forward | Take


# -- what a rank thread reports -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkReady:
    rank: int
    item: Batch | Scored  # finished samples, with the rank's own forwards on them when it ran those (own-rank)


@dataclass(frozen=True)
class TailReady:
    rank: int
    tail: Tail  # the rank's unfinished rows, exported on request


@dataclass(frozen=True)
class StreamEnded:
    rank: int


@dataclass(frozen=True)
class JobDone:
    rank: int


@dataclass(frozen=True)
class Failed:
    rank: int
    error: BaseException


Event = ChunkReady | TailReady | StreamEnded | JobDone | Failed


# -- what is queued for another worker group --------------------------------------------------------------------


@dataclass(frozen=True)
class Finished:
    """Finished samples never sent while decoding."""

    node: Node
    batch: Batch


@dataclass(frozen=True)
class Live:
    """Unfinished samples' responses so far (a `Growing` batch), scored while they decode."""

    node: Node
    batch: Batch


@dataclass(frozen=True)
class Final:
    """Finished samples that went out live before: the group holds their state and finishes them."""

    node: Node
    batch: Batch


Feed = Finished | Live | Final
