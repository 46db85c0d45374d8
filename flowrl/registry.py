"""Name registries for what flows refer to by name: rewards and step functions.

`@flowrl.reward("name")` and `@flowrl.function("name")` add entries; `import "pkg.module"` in a flow
imports the module so its registrations become visible. Rewards may also be named by dotted path.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class RewardFn:
    """A reward callable. `batched` ones take lists (`fn(prompts, responses, **columns) -> list[float]`)."""

    name: str
    fn: Callable[..., Any]
    batched: bool = False


REWARDS: dict[str, RewardFn] = {}
FUNCTIONS: dict[str, Callable[..., Any]] = {}


def reward(name: str | None = None, *, batched: bool = False) -> Callable[[F], F]:
    """Register a reward: `fn(prompt, response, **row) -> float` (or the batched form)."""

    def wrap(fn: F) -> F:
        key = name or fn.__name__
        REWARDS[key] = RewardFn(key, fn, batched)
        fn.__flowrl_batched__ = batched  # type: ignore[attr-defined]
        return fn

    return wrap


def function(name: str | None = None) -> Callable[[F], F]:
    """Register a step function usable as `x = name(a, b, k = v)` in a flow.

    Parameters before `*` receive node outputs (runtime `Batch` objects); keyword-only parameters receive
    literals. Annotations (int, float, bool, str) are checked by the compiler.
    """

    def wrap(fn: F) -> F:
        FUNCTIONS[name or fn.__name__] = fn
        return fn

    return wrap


class ResolveError(LookupError):
    """A dotted path or registered name that does not resolve; the message says why."""


def _stale(module: str) -> bool:
    """Whether `module`'s top-level package was imported from another file than the one `sys.path` finds now: two
    flows in one process (a notebook, a test session), each with its own `my_rewards.py` next to it, must each get
    their own, not the first one imported."""
    top = module.partition(".")[0]
    loaded = sys.modules.get(top)
    # a single-file module only (a user's reward file): a package (`tests`, an installed library) is never dropped
    if loaded is None or getattr(loaded, "__file__", None) is None or hasattr(loaded, "__path__"):
        return False
    spec = importlib.machinery.PathFinder.find_spec(top, sys.path)
    return spec is not None and spec.origin is not None and spec.submodule_search_locations is None and \
        os.path.realpath(spec.origin) != os.path.realpath(str(loaded.__file__))


def import_module(module: str) -> None:
    if _stale(module):
        top = module.partition(".")[0]
        for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            del sys.modules[name]
    try:
        importlib.import_module(module)
    except Exception as e:  # any import-time failure is the user's module's problem
        raise ResolveError(f"cannot import module '{module}': {type(e).__name__}: {e}") from None


def resolve_reward(target: str) -> RewardFn:
    """A registered reward name, or `pkg.module.fn` (imported now so errors surface at check time)."""
    if target in REWARDS and not ("." in target and _stale(target)):
        return REWARDS[target]
    if "." not in target:
        known = ", ".join(sorted(REWARDS)) or "none"
        raise ResolveError(f"no reward registered as '{target}' (registered: {known})")
    module, _, attr = target.rpartition(".")
    import_module(module)
    if target in REWARDS:  # the import may have registered it under its dotted name
        return REWARDS[target]
    obj = getattr(importlib.import_module(module), attr, None)
    if obj is None:
        raise ResolveError(f"module '{module}' has no attribute '{attr}'")
    if not callable(obj):
        raise ResolveError(f"'{target}' is not callable")
    return RewardFn(target, obj, bool(getattr(obj, "__flowrl_batched__", False)))


def extra_columns(fn: Callable[..., Any], row: Mapping[str, Any]) -> dict[str, Any]:
    """The data row's columns a reward function accepts (all of them if it takes **kwargs)."""
    params = inspect.signature(fn).parameters
    cols = {k: v for k, v in row.items() if k != "prompt"}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return cols
    return {k: v for k, v in cols.items() if k in params}
