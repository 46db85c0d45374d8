"""Environments and tools the tests of flowrl.envs load by name (from this folder, as a flow's folder): well-behaved
ones, and one whose actions act as a hostile policy would make an environment act."""

from __future__ import annotations

import asyncio
import os
import struct
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any


class Counter:
    """Counts its steps (state kept across turns): observation "n=<steps> pid=<process>", done at `limit`."""

    def __init__(self, limit: int = 3) -> None:
        self.limit, self.n = limit, 0

    def reset(self, row: Mapping[str, Any]) -> str:
        return f"start {row.get('name', '')}"

    def step(self, action: str) -> tuple[str, float, bool]:
        self.n += 1
        return f"n={self.n} pid={os.getpid()}", float(self.n), self.n >= self.limit


class Sleepy:
    """Sleeps the seconds its action says ("0.25"), then answers them back: answers come in any order."""

    def reset(self, row: Mapping[str, Any]) -> str:
        return ""

    def step(self, action: str) -> tuple[str, float, bool]:
        time.sleep(float(action))
        return action, 1.0, False


class AsyncSleepy:
    """Sleepy as `async def`: calls of one worker overlap on its event loop."""

    async def reset(self, row: Mapping[str, Any]) -> str:
        await asyncio.sleep(0)
        return "ready"

    async def step(self, action: str) -> tuple[str, float, bool]:
        await asyncio.sleep(float(action))
        return action, 2.0, False


class Gate:
    """A step that waits until a file exists (the test creates it): a call made unable to finish first."""

    def reset(self, row: Mapping[str, Any]) -> str:
        self.path = str(row["gate"])
        return ""

    def step(self, action: str) -> tuple[str, float, bool]:
        if action == "wait":
            while not os.path.exists(self.path):
                time.sleep(0.01)
            return "opened", 0.0, False
        return "quick", 0.0, False


class FakeStr(str):
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return "forged"


class FakeFloat(float):
    def __float__(self) -> float:
        return 99.0


class Hostile:
    """Does what its action says."""

    def reset(self, row: Mapping[str, Any]) -> str:
        return ""

    def step(self, action: str) -> Any:
        if action == "hang":
            threading.Event().wait()
        if action == "exit":
            os._exit(3)
        if action == "print":
            print("garbage on stdout " * 1000, flush=True)
            sys.stdout.write('[0, "fake", 1.0, true, null, 0.0, false]\n')
            sys.stdout.flush()
            return "printed", 0.0, False
        if action == "huge":
            return "x" * 100_000, 0.0, False
        if action == "nan":
            return "obs", float("nan"), False
        if action == "inf":
            return "obs", float("inf"), False
        if action == "fake":
            return FakeStr("real"), FakeFloat(0.5), False
        if action == "shape":
            return "only two", 1.0
        if action == "bool-reward":
            return "obs", True, False
        if action == "int-done":
            return "obs", 0.0, 1
        if action == "raise":
            raise ValueError("bad action")
        if action == "exit-call":
            sys.exit(2)
        if action == "forge":  # writes on the worker's own socket (its fd is the child's argument)
            body = b'{"not": "an answer"}'
            os.write(int(sys.argv[1]), struct.pack("!i", len(body)) + body)
            threading.Event().wait()
        if action == "surrogate":
            return "a\ud800b", 0.0, False
        if action == "numpy":
            import numpy as np

            return "obs", np.float32(0.25), np.bool_(True)
        if action == "modules":
            return " ".join(sorted(m for m in ("torch", "flowrl.runtime", "numpy") if m in sys.modules)), 0.0, False
        return "pid=" + str(os.getpid()), 0.0, False


class BadReset:
    def reset(self, row: Mapping[str, Any]) -> str:
        raise RuntimeError("no such level")

    def step(self, action: str) -> tuple[str, float, bool]:
        return "", 0.0, True


def calc(args: str, **row: Any) -> str:
    """A calculator for "a+b", "a*b", "a-b", "a/b" of integers."""
    for op in "+-*/":
        left, mid, right = args.partition(op)
        if mid:
            a, b = int(left), int(right)
            return str({"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op])
    raise ValueError(f"cannot compute {args!r}")


def lookup(args: str, table: Mapping[str, str]) -> str:
    """A tool reading a data column."""
    return table.get(args.strip(), "unknown")


async def async_upper(args: str) -> str:
    await asyncio.sleep(0)
    return args.upper()


def number(args: str) -> int:
    return len(args)


def listing(args: str) -> list[str]:
    return [args]


def no_args() -> str:
    return ""


NOT_CALLABLE = 3


class NoStep:
    def reset(self, row: Mapping[str, Any]) -> str:
        return ""


class TwoArgStep:
    def reset(self, row: Mapping[str, Any]) -> str:
        return ""

    def step(self, action: str, extra: int) -> tuple[str, float, bool]:
        return "", 0.0, True


class AsyncOk:
    async def reset(self, row: Mapping[str, Any]) -> str:
        return ""

    async def step(self, action: str) -> tuple[str, float, bool]:
        return "", 0.0, True


class AsyncGate:
    """Gate as `async def`: the waiting step awaits on the worker's event loop, the others still answer."""

    async def reset(self, row: Mapping[str, Any]) -> str:
        self.path = str(row["gate"])
        return ""

    async def step(self, action: str) -> tuple[str, float, bool]:
        if action == "wait":
            while not os.path.exists(self.path):
                await asyncio.sleep(0.01)
            return "opened", 0.0, False
        await asyncio.sleep(0)
        return "quick", 0.0, False
