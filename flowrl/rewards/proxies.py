"""The solution as the tests' process sees it (flowrl.rewards.checker): `Link`, the pipe to the solution's process,
and `Remote`, a proxy for something that lives there. Standard library only (it runs in the tests' jail).

A call on a proxy sends its arguments by value (`wire.encode`; a proxy argument by its handle; a function or
object of the tests' own cannot be sent: NoPlainForm), and what comes back is plain data made here
(`wire.decode`): real ints, lists, Counters, ..., compared by the tests' own code. What has no plain form comes
back as another proxy: its attributes, methods, `len`, `str`, indexing, arithmetic and iteration go to the
solution (each answer plain data again). `==`, `!=`, `<`, `<=`, `>`, `>=` and `in` on it raise `NoPlainForm`
(there the solution, not the tests, would decide), unless its class compares as `object` does: then by identity
here, as Python would. Exceptions the solution raises are raised here as the same builtin type (or as a class of
the same name deriving from it, when the solution defines one the test names), with the same arguments; but
StopIteration, which would silently end a test's `map()` or `all(...)`, arrives as RuntimeError (as PEP 479 has
it for generators). A list, dict, set or bytearray argument (positional or by keyword) that the call changed is
changed here too (copied back by value: its contents, not the identity of objects nested in it). An iterator the
solution returns is read in growing batches (1, 2, 4, ... 4,096 items a round trip), so a generator runs that
far ahead.
"""

from __future__ import annotations

import builtins
import collections
import importlib
import json
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowrl.rewards import wire
else:  # in the jail the bootstrap loaded it as flowrl_wire; in the repository it is the package's
    wire = sys.modules.get("flowrl_wire") or importlib.import_module("flowrl.rewards.wire")

ALIASES = {"np": "numpy", "pd": "pandas"}  # `import numpy as np`: the only module names bound under another name
STDLIB = frozenset(getattr(sys, "stdlib_module_names", ())) - {"__future__"}
BINARY = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and_", "or_", "xor", "lshift",
          "rshift")
FORWARDED = ("len", "bool", "int", "float", "index", "abs", "neg", "pos", "invert", "round", "getitem", "setitem",
             "delitem", "str", *BINARY, *("r" + b for b in BINARY))


class SolutionGone(BaseException):
    """The solution's process ended (or closed its side): every later call fails. A BaseException, so that a
    test's `except Exception` cannot take it for an exception the solution raised."""


class Link:
    """Requests to the solution's process, one at a time, each answered by one line of at most `reply_bytes`."""

    def __init__(self, tx: int, rx: int, reply_bytes: int):
        self.tx, self.rx, self.reply_bytes = tx, rx, reply_bytes
        self.buffer = bytearray()
        self.gone = False
        self.answered = 0  # calls answered (a value or a raise): a check the tests' side made (checker.py)
        self.unplain: list[str] = []  # why values had no plain form, for the verdict's reason
        self.names: dict[str, list[Any]] = {}
        self.bound: dict[str, Any] = {}

    # ---- the wire ------------------------------------------------------------------------------------------

    def send(self, obj: Any) -> None:
        if self.gone:
            raise SolutionGone("the solution's process has ended")
        data = memoryview((json.dumps(obj) + "\n").encode())
        try:
            while data:
                data = data[os.write(self.tx, data):]
        except OSError:
            self.gone = True
            raise SolutionGone("the solution's process has ended") from None

    def read(self) -> Any:
        """The next line as JSON; a line over `reply_bytes` is read to its end and refused (BadReply)."""
        over, start = False, 0
        while (nl := self.buffer.find(b"\n", start)) < 0:
            if len(self.buffer) > self.reply_bytes:
                over, self.buffer = True, bytearray()
            start = len(self.buffer)
            chunk = os.read(self.rx, 1 << 16) if not self.gone else b""
            if not chunk:
                self.gone = True
                raise SolutionGone("the solution's process has ended")
            self.buffer += chunk
        line = bytes(self.buffer[:nl])
        del self.buffer[:nl + 1]
        if over:
            raise wire.BadReply(f"a reply over {self.reply_bytes} bytes")
        try:
            return json.loads(line)
        except (ValueError, RecursionError):
            raise wire.BadReply("a reply that is not JSON") from None

    def ask(self, req: dict[str, Any]) -> dict[str, Any]:
        self.send(req)
        reply = self.read()
        if not isinstance(reply, dict):
            raise wire.BadReply("a reply that is not an object")
        if req["op"] == "call" and ("ok" in reply or "raise" in reply):
            self.answered += 1
        if "raise" in reply and reply["raise"] is not None and "items" not in reply:
            self.throw(reply["raise"])
        if "unplain" in reply:
            raise self.no_plain_form(str(reply["unplain"]))
        if "refused" in reply:
            raise wire.BadReply(f"the solution's side refused the request: {str(reply['refused'])[:200]}")
        return reply

    def no_plain_form(self, why: str) -> wire.NoPlainForm:
        self.unplain.append(why)
        return wire.NoPlainForm(why)

    # ---- values --------------------------------------------------------------------------------------------

    def out(self, x: Any) -> list[Any]:
        try:
            return wire.encode(x, self._ref_of)
        except wire.NoPlainForm as e:
            raise self.no_plain_form(f"an argument: {e}") from None

    def _ref_of(self, x: Any) -> list[Any]:
        if isinstance(x, Remote) and x._link is self:
            return x._ref
        raise wire.NoPlainForm(f"a {type(x).__name__} cannot be sent to the solution")

    def value(self, v: Any) -> Any:
        return wire.decode(v, self._remote)

    def _remote(self, v: list[Any]) -> Remote:
        if v[0] != "handle" or len(v) != 6 or type(v[1]) is not int or not isinstance(v[3], str):
            raise wire.BadReply("a malformed handle")
        own = v[4] if isinstance(v[4], str) else None
        kind = RemoteIterator if v[2] == "iterator" else Remote
        return kind(self, ["ref", v[1]], str(v[2]), v[3], own, v[5] is True)

    def throw(self, info: Any) -> None:
        """Raise what the solution raised: its builtin type, or the mirror of its own class the test named."""
        if not isinstance(info, dict):
            raise wire.BadReply("a malformed exception")
        base = getattr(builtins, str(info.get("type")), None)
        cls = base if isinstance(base, type) and issubclass(base, BaseException) else Exception
        if issubclass(cls, (StopIteration, StopAsyncIteration)):  # as PEP 479 does for generators: raised out of a
            raise RuntimeError(f"the solution raised {cls.__name__}")  # call, it would end a test's map() early
        own = info.get("own")
        if isinstance(own, str) and self.names.get(own, [None])[0] == "exception":
            cls = self.bind(own)
        try:
            args = wire.decode(info.get("args"))
            exc = cls(*args) if isinstance(args, list) else cls()
        except Exception:  # malformed, or arguments its constructor refuses
            exc = cls()
        raise exc

    # ---- requests ------------------------------------------------------------------------------------------

    def call(self, ref: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        reply = self.ask({"op": "call", "ref": ref, "args": [self.out(a) for a in args],
                          "kwargs": [[k, self.out(v)] for k, v in kwargs.items()]})
        result = self.value(reply.get("ok"))
        back = reply.get("back", [])
        for key, v in back if isinstance(back, list) else []:
            if type(key) is int and 0 <= key < len(args):
                _restore(args[key], self.value(v))
            elif type(key) is str and key in kwargs:
                _restore(kwargs[key], self.value(v))
        return result

    def get(self, ref: list[Any], name: str | None = None) -> Any:
        """An attribute of what `ref` names, or (no `name`) that thing itself, as a value."""
        req = {"op": "get", "ref": ref} if name is None else {"op": "attr", "ref": ref, "name": name}
        return self.value(self.ask(req).get("ok"))

    def special(self, ref: list[Any], name: str, *args: Any) -> Any:
        return self.value(self.ask({"op": "special", "ref": ref, "name": name,
                                    "args": [self.out(a) for a in args]}).get("ok"))

    def next_items(self, ref: list[Any], n: int) -> tuple[list[Any], bool, Any]:
        reply = self.ask({"op": "next", "ref": ref, "n": n})
        items = self.value(reply.get("items"))
        if not isinstance(items, list):
            raise wire.BadReply("malformed items")
        return items, reply.get("stop") is True, reply.get("raise")

    # ---- the solution's names ------------------------------------------------------------------------------

    def bind(self, name: str) -> Any:
        """What the tests see under one of the solution's module-level names (the checker's rules)."""
        if name not in self.bound:
            self.bound[name] = self._bind(name, self.names[name])
        return self.bound[name]

    def _bind(self, name: str, entry: list[Any]) -> Any:
        kind = entry[0] if isinstance(entry, list) and entry else None
        if name in STDLIB or name in ALIASES:  # `math` is math here, whatever the solution made of it
            return importlib.import_module(ALIASES.get(name, name))
        if kind == "module":  # the tests' own import of it, under its own name only
            module = str(entry[1])
            if name == module.rsplit(".", 1)[-1]:
                return importlib.import_module(module)
            raise LookupError(f"{name} names module {module}")
        if kind == "exception":  # a class of that name here, deriving from the same builtin exception
            base = getattr(builtins, str(entry[1]), Exception)
            base = base if isinstance(base, type) and issubclass(base, BaseException) else Exception
            return type(name, (base,), {"__module__": "solution"})
        if kind == "import" and len(entry) == 4 and name == str(entry[3]).rsplit(".", 1)[-1]:
            try:  # `from math import sqrt`: the tests' own sqrt, as the name says
                found: Any = importlib.import_module(str(entry[2]))
                for part in str(entry[3]).split("."):
                    found = getattr(found, part)
                return found
            except (ImportError, AttributeError):
                pass
        if kind in ("class", "callable", "import"):
            what = "class" if kind == "class" or (kind == "import" and entry[1] == "class") else "callable"
            return Remote(self, ["ref", name], what, name, name if what == "class" else None, False)
        return self.get(["ref", name])


def _restore(old: Any, new: Any) -> None:
    if type(old) is list and type(new) is list or type(old) is bytearray and type(new) is bytearray:
        old[:] = new
    elif type(old) is dict and type(new) is dict or type(old) is set and type(new) is set:
        old.clear()
        old.update(new)


class Remote:
    """Something in the solution's process (see the module docstring)."""

    __slots__ = ("_link", "_ref", "_kind", "_type", "_own", "_identity", "_items", "_stop", "_error", "_ask")

    def __init__(self, link: Link, ref: list[Any], kind: str, type_name: str, own: str | None, identity: bool):
        """`identity`: its class compares as `object` does (by identity; no order), so this side can too."""
        for k, v in (("_link", link), ("_ref", ref), ("_kind", kind), ("_type", type_name), ("_own", own),
                     ("_identity", identity), ("_items", collections.deque()), ("_stop", False), ("_error", None),
                     ("_ask", 1)):
            object.__setattr__(self, k, v)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._link.call(self._ref, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):  # protocols probed by libraries: not the solution's
            raise AttributeError(name)
        return self._link.get(self._ref, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._link.ask({"op": "setattr", "ref": self._ref, "name": name, "args": [self._link.out(value)]})

    def _refuse(self, *_: Any) -> Any:
        raise self._link.no_plain_form(f"a {self._type} from the solution has no plain form: comparing it would "
                                       "be the solution's decision")

    def __eq__(self, other: object) -> Any:
        if not self._identity:
            self._refuse()
        return True if other is self else NotImplemented

    def __ne__(self, other: object) -> Any:
        if not self._identity:
            self._refuse()
        return False if other is self else NotImplemented

    def _order(self, other: object) -> Any:
        return self._refuse() if not self._identity else NotImplemented

    __lt__ = __le__ = __gt__ = __ge__ = _order
    __contains__ = _refuse
    __hash__ = object.__hash__

    def __iter__(self) -> Any:
        return self._link.special(self._ref, "iter")

    def __repr__(self) -> str:
        try:
            text = self._link.special(self._ref, "repr")
        except (Exception, wire.NoPlainForm, wire.BadReply, SolutionGone):
            text = None
        return text if isinstance(text, str) else f"<{self._type} in the solution's process>"

    def __instancecheck__(self, instance: Any) -> bool:  # `isinstance(x, Cls)` for a class the solution defines
        return self._kind == "class" and isinstance(instance, Remote) and instance._own is not None and \
            instance._own == self._own

    def __subclasscheck__(self, cls: Any) -> bool:
        return False


def _forward(name: str) -> Any:
    def method(self: Remote, *args: Any) -> Any:
        return self._link.special(self._ref, name, *args)
    return method


for _name in FORWARDED:
    setattr(Remote, f"__{_name.rstrip('_')}__", _forward(_name))


class RemoteIterator(Remote):
    """An iterator in the solution's process (a generator, `map`, ...), read in growing batches."""

    __slots__ = ()

    def __iter__(self) -> RemoteIterator:
        return self

    def __len__(self) -> int:
        raise TypeError(f"object of type '{self._type}' has no len()")

    def __contains__(self, x: object) -> bool:  # as Python does for an iterator: compared here, item by item
        return any(item is x or item == x for item in self)

    def __next__(self) -> Any:
        if not self._items:
            if self._error is None and not self._stop:
                items, stop, error = self._link.next_items(self._ref, self._ask)
                object.__setattr__(self, "_ask", min(self._ask * 2, 4096))
                self._items.extend(items)
                object.__setattr__(self, "_stop", stop)
                object.__setattr__(self, "_error", error)
            if not self._items:
                if self._error is not None:
                    error = self._error
                    object.__setattr__(self, "_error", None)
                    object.__setattr__(self, "_stop", True)
                    self._link.throw(error)
                raise StopIteration
        return self._items.popleft()
