"""Finding a flow's environment class (flowrl.envs): `env NAME = "module.Class"` or `tool NAME = "module.fn"`
imported from the flow's folder and `import` declarations, its methods checked. What `flowrl check` calls to
validate the declaration, and what each pool worker calls before its first reset.

An environment class has `reset(self, row) -> str` and `step(self, action) -> (observation, reward, done)`,
each plain or `async def`; its constructor takes the block's other keys (`EnvSpec.options`) as keywords. A
tool is a function `fn(args: str, **row) -> str`, turned into an environment class by `flowrl.envs.tools`.
Every problem is an `EnvLoadError` saying what is missing and what to write instead.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

from flowrl.envs.protocol import EnvSpec
from flowrl.envs.tools import TOOL_OPTIONS, tool_class
from flowrl.errors import Diagnostic, FlowError
from flowrl.registry import ResolveError, import_module

__all__ = ["EnvLoadError", "load_env_class"]

RESET = "reset(self, row) -> str"
STEP = "step(self, action) -> (observation, reward, done)"
TOOL = "fn(args: str, **row) -> str"


class EnvLoadError(FlowError):
    """An environment or tool that cannot be used: not importable, not a class, a method missing or of the wrong
    shape. `problem` is the sentence alone, for a caller that renders it at the declaration's line."""

    def __init__(self, problem: str, hint: str | None = None):
        self.problem = problem
        super().__init__(Diagnostic(problem, hint=hint))


def load_env_class(spec: EnvSpec) -> type:
    """The class whose instances run one trajectory each: the declared class, or for a tool the class made from
    its function (`flowrl.envs.tools.tool_class`). Puts the flow's folder on `sys.path` and imports the flow's
    `imports` first (as a reward worker does)."""
    if spec.folder and spec.folder not in sys.path:
        sys.path.insert(0, spec.folder)
    for module in spec.imports:
        try:
            import_module(module)
        except ResolveError as e:
            raise EnvLoadError(f"{spec.kind} '{spec.name}': {e}") from None
    obj = _resolve(spec)
    if spec.kind == "tool":
        return _tool(spec, obj)
    if spec.kind != "env":
        raise EnvLoadError(f"'{spec.name}' is of kind '{spec.kind}', not 'env' or 'tool'")
    if not inspect.isclass(obj):
        raise EnvLoadError(f"env '{spec.name}': '{spec.target}' is a {type(obj).__name__}, not a class",
                           hint=f"a class with {RESET} and {STEP}")
    cls_name = obj.__name__
    for method, shape in (("reset", RESET), ("step", STEP)):
        fn = getattr(obj, method, None)
        if fn is None or not callable(fn):
            raise EnvLoadError(f"{cls_name} has no method {shape}", hint="plain `def` or `async def`, one per "
                               "trajectory's instance: reset gets the data row, step each turn's action text")
        if not _binds(fn, object(), "x"):
            raise EnvLoadError(f"{cls_name}.{method} does not take one argument: it should be {shape}",
                               hint=f"found {method}{_signature(fn)}")
    if not _binds_keywords(obj, dict(spec.options)):
        keys = ", ".join(sorted(spec.options)) or "no keys"
        raise EnvLoadError(f"{cls_name}{_signature(obj)} cannot be made from the block's other keys ({keys})",
                           hint="its constructor is called with them as keywords: add them as parameters "
                                "(or **options), or remove them from the block")
    return obj


def _resolve(spec: EnvSpec) -> Any:
    what = "class" if spec.kind == "env" else "function"
    module, _, attr = spec.target.rpartition(".")
    if not module or not attr:
        raise EnvLoadError(f"{spec.kind} '{spec.name}': '{spec.target}' is not a dotted path",
                           hint=f'write "module.{"Class" if spec.kind == "env" else "fn"}", the module found from '
                                "the flow's folder or installed")
    try:
        import_module(module)
    except ResolveError as e:
        raise EnvLoadError(f"{spec.kind} '{spec.name}': {e}") from None
    found = getattr(importlib.import_module(module), attr, None)
    if found is None:
        raise EnvLoadError(f"module '{module}' has no {what} '{attr}'")
    return found


def _tool(spec: EnvSpec, fn: Any) -> type:
    if not callable(fn) or inspect.isclass(fn):
        raise EnvLoadError(f"tool '{spec.name}': '{spec.target}' is a {type(fn).__name__}, not a function",
                           hint=f"a function {TOOL}")
    if not _binds(fn, "x", partial=True):  # its other parameters are the row's columns
        raise EnvLoadError(f"tool '{spec.name}': {getattr(fn, '__name__', spec.target)}{_signature(fn)} does not "
                           f"take the arguments' text: it should be {TOOL}")
    if not spec.call:
        raise EnvLoadError(f"tool '{spec.name}' has no call marker",
                           hint='write `call = "<calc>"`: the text that opens the tool\'s arguments in an action')
    unknown = sorted(set(spec.options) - set(TOOL_OPTIONS))
    if unknown:
        raise EnvLoadError(f"tool '{spec.name}' takes no key '{unknown[0]}'",
                           hint="a tool's keys are call, end, max_turns, workers, timeout, on_error; the data row's "
                                "columns reach the function as keywords")
    return tool_class(fn, spec.call, spec.stop[0] if spec.stop else "")


def _binds(fn: Callable[..., Any], *args: Any, partial: bool = False) -> bool:
    try:
        sig = inspect.signature(fn)
        sig.bind_partial(*args) if partial else sig.bind(*args)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): trust it
        return True
    return True


def _binds_keywords(cls: type, options: dict[str, Any]) -> bool:
    try:
        inspect.signature(cls).bind(**options)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def _signature(fn: Any) -> str:
    """The parameters as written, without annotations (which read as quoted strings under postponed
    evaluation)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "(...)"
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=bare, return_annotation=inspect.Signature.empty))
