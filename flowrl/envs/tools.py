"""The tool shorthand (flowrl.envs): `tool NAME = "module.fn" { call = "<calc>", end = "</calc>" }` as an
environment class, run by the pool like any `env` (`flowrl.envs.load.load_env_class` makes it).

A tool is a function `fn(args: str, **row) -> str` (plain or `async def`); the data row's columns reach it as
keywords, those it names or all with `**row` (as for rewards; `prompt` is not passed). One trajectory:
- reset: the observation is "" (the prompt is followed directly by the first action).
- each action: the turn ends at the end marker (`end`, the spec's `stop[0]`: the engine stops a turn there and
  keeps it in the action), or at the end of sequence / the turn's token cap. When the action contains the call
  marker, the arguments are the text between its LAST call marker and the next end marker (or the end of the
  action, for a turn cut short), and the observation is what `fn(args, **row)` returned, verbatim: no framing is
  added, so a flow whose data expects `<result>...</result>` returns that from its function. The turn's reward
  is 0 and the trajectory goes on (done False) until `max_turns`.
- an action without the call marker is the final answer: done True, reward 0 (the flow's declared `reward`
  grades the whole trajectory).
- `fn` returning a str is the observation; an int or float is written with `str()`; anything else, or `fn`
  raising, is an error outcome, and the spec's `on_error` decides (`"observe"` shows the policy the error text,
  e.g. "raised ZeroDivisionError: division by zero").
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from flowrl.registry import extra_columns

__all__ = ["TOOL_OPTIONS", "tool_arguments", "tool_class"]

TOOL_OPTIONS: tuple[str, ...] = ()  # keys of a tool's block passed on (none: the row's columns are the inputs)


def tool_arguments(action: str, call: str, end: str) -> str | None:
    """The arguments of the action's last call, or None when it makes no call.

    >>> tool_arguments("2+3 is <calc>2+3</calc>", "<calc>", "</calc>")
    '2+3'
    """
    at = action.rfind(call)
    if at < 0:
        return None
    args = action[at + len(call):]
    if end:
        stop = args.find(end)
        if stop >= 0:
            args = args[:stop]
    return args


def _text(name: str, value: Any) -> str:
    if isinstance(value, str):
        return str.__str__(value)  # a str subclass becomes a plain str: its overrides never reach the pool
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(float(value)) if isinstance(value, float) else str(int(value))
    raise TypeError(f"tool {name} returned a {type(value).__name__}, not a str")


def tool_class(fn: Callable[..., Any], call: str, end: str) -> type:
    """An environment class calling `fn` on each action's call (see the module docstring)."""
    name = getattr(fn, "__name__", "tool")

    class Tool:
        def __init__(self) -> None:
            self.row: Mapping[str, Any] = {}

        def reset(self, row: Mapping[str, Any]) -> str:
            self.row = row
            return ""

    if inspect.iscoroutinefunction(fn):
        class AsyncTool(Tool):
            async def step(self, action: str) -> tuple[str, float, bool]:
                args = tool_arguments(action, call, end)
                if args is None:
                    return "", 0.0, True
                return _text(name, await fn(args, **extra_columns(fn, self.row))), 0.0, False

        made: type = AsyncTool
    else:
        class SyncTool(Tool):
            def step(self, action: str) -> tuple[str, float, bool]:
                args = tool_arguments(action, call, end)
                if args is None:
                    return "", 0.0, True
                return _text(name, fn(args, **extra_columns(fn, self.row))), 0.0, False

        made = SyncTool
    made.__name__ = made.__qualname__ = f"Tool[{name}]"
    return made
