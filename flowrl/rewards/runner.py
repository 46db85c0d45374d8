"""The solution's side of `code_tests` (flowrl.rewards.code): runs inside the sandbox, standard library only.

flowrl never imports this module to grade: `flowrl.rewards.sandbox` passes its source (with `wire`'s) to
`python -I -S -c` in the jail. It speaks JSON lines on descriptors of its own (0, 1 and 2 become /dev/null at
once): the first line is the task (`code`, `mode`, limits), each later line a request, answered by one line. It
never sees a test and never says whether one passed: everything it says is what the solution computed, and all of
it runs beside the solution, which may rewrite any of it; what it can forge is only what it could have computed.

- mode "calls": the code is loaded once as module `solution` (in `sys.modules`, so dataclasses, pickle and
  `multiprocessing` find it; its `if __name__ == "__main__":` part stays off) and its names are listed (`describe`).
  The requests come from the tests' process (`flowrl.rewards.checker`), not from the harness: `call` a name or a
  handle with arguments, get an `attr`, `setattr`, a `special` operation (`len`, `str`, `getitem`, `add`, ...) or
  the `next` items of an iterator. The answer is `{"ok": value}` (`wire.encode`: plain data by value, a handle for
  an object with no plain form), with `back`: the list, dict, set or bytearray arguments the call changed, by
  value; or `{"raise": ...}`: the exception's nearest builtin type, its class name when the solution defines it,
  and its arguments.
- mode "io": each request is `{"stdin": text}`; a forked child runs the solution as `__main__` with that input on
  fd 0, its fd 1 read here up to `output` bytes (it holds no other descriptor); answered `{"stdout", "status",
  "over"}`, compared by the harness.
"""

from __future__ import annotations

import importlib
import json
import operator
import os
import resource
import select
import signal
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowrl.rewards import syscalls, wire
else:  # in the jail the bootstrap loaded them as flowrl_NAME; in the repository they are the package's
    wire = sys.modules.get("flowrl_wire") or importlib.import_module("flowrl.rewards.wire")
    syscalls = sys.modules.get("flowrl_syscalls") or importlib.import_module("flowrl.rewards.syscalls")

MAX_NAMES = 10_000
MAX_HANDLES = 100_000
MAX_ITEMS = 4096  # iterator items per `next` request
COMPARISONS = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__")
BINARY = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and_", "or_", "xor", "lshift",
          "rshift")
SPECIAL: dict[str, Any] = {
    "len": len, "str": str, "repr": repr, "bool": bool, "iter": iter, "int": int, "float": float,
    "index": operator.index, "abs": abs, "neg": operator.neg, "pos": operator.pos, "invert": operator.invert,
    "round": round, "getitem": operator.getitem, "setitem": operator.setitem, "delitem": operator.delitem,
    **{name: getattr(operator, name) for name in BINARY},
    **{"r" + name: (lambda f: lambda a, b: f(b, a))(getattr(operator, name)) for name in BINARY},
}


def send(fd: int, obj: Any) -> None:
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def limit(cpu: int, memory: int, nproc: int, files: int) -> None:
    for which, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory), (resource.RLIMIT_NPROC, nproc),
                         (resource.RLIMIT_FSIZE, files), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):
            pass


def no_network(event: str, args: Any) -> None:
    if event.startswith("socket."):
        raise PermissionError("code_tests: network access is off")


# ---- mode "calls" ------------------------------------------------------------------------------------------


class Table:
    """The objects the tests' side holds handles to, by index."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module
        self.objects: list[Any] = []

    def add(self, x: Any) -> list[Any]:
        if len(self.objects) >= MAX_HANDLES:
            raise wire.NoPlainForm("too many objects held by the tests' side")
        self.objects.append(x)
        if isinstance(x, type):
            kind, name = "class", x.__name__
            own = x.__name__ if x.__module__ == "solution" else None
        else:
            t = type(x)
            kind = "iterator" if hasattr(t, "__next__") and hasattr(t, "__iter__") else \
                "callable" if callable(x) else "object"
            name, own = t.__name__, (t.__name__ if t.__module__ == "solution" else None)
        identity = all(getattr(type(x), op, None) is getattr(object, op) for op in COMPARISONS)
        return ["handle", len(self.objects) - 1, kind, str(name), own, identity]

    def get(self, v: Any) -> Any:
        """What `["ref", index]` or `["ref", "name"]` (a name of the solution's module) stands for."""
        if isinstance(v, list) and len(v) == 2 and v[0] == "ref" and type(v[1]) is str:
            return getattr(self.module, v[1])
        if not (isinstance(v, list) and len(v) == 2 and v[0] == "ref" and type(v[1]) is int
                and 0 <= v[1] < len(self.objects)):
            raise wire.BadReply("an unknown handle")
        return self.objects[v[1]]


def builtin_base(cls: type) -> type:
    return next(c for c in cls.__mro__ if c.__module__ == "builtins")


def entry(obj: Any) -> list[Any]:
    """What a name of the solution's module is, for the tests' side to bind (see flowrl.rewards.checker)."""
    if isinstance(obj, types.ModuleType):
        return ["module", str(obj.__name__)]
    if isinstance(obj, type) and issubclass(obj, BaseException):
        return ["exception", builtin_base(obj).__name__]
    if isinstance(obj, type) or callable(obj):
        kind = "class" if isinstance(obj, type) else "callable"
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if isinstance(module, str) and isinstance(qualname, str) and module not in ("solution", "__main__"):
            return ["import", kind, module, qualname]
        return [kind]
    return ["value"]


def describe(mod: types.ModuleType) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for name, obj in list(vars(mod).items()):
        if len(out) >= MAX_NAMES:
            break
        if not (name.startswith("__") and name.endswith("__")):
            try:
                out[name] = entry(obj)
            except Exception:  # a metaclass that raises on inspection: the name is not offered
                pass
    return out


def raised(e: BaseException) -> dict[str, Any]:
    own = type(e).__name__ if type(e).__module__ == "solution" else None
    try:
        args = wire.encode(list(e.args))
    except BaseException:
        try:
            args = wire.encode([str(e)])
        except BaseException:
            args = wire.encode([])
    return {"type": builtin_base(type(e)).__name__, "own": own, "args": args}


def _next(it: Any, n: Any, table: Table) -> dict[str, Any]:
    items, stop, error = [], False, None
    for _ in range(max(1, min(n if type(n) is int else 1, MAX_ITEMS))):
        try:
            items.append(next(it))
        except StopIteration:
            stop = True
            break
        except BaseException as e:
            error = raised(e)
            break
    return {"items": wire.encode(items, table.add), "stop": stop, "raise": error}


def answer(req: dict[str, Any], table: Table) -> dict[str, Any]:
    """One request's answer (see the module docstring)."""
    op, sent, sent_kw = req.get("op"), req.get("args", []), {str(k): a for k, a in req.get("kwargs", [])}
    try:
        args = [wire.decode(a, table.get) for a in sent]
        kwargs = {k: wire.decode(a, table.get) for k, a in sent_kw.items()}
    except BaseException as e:  # the tests' side's mistake, not the solution's
        return {"refused": f"bad arguments: {type(e).__name__}: {e}"}
    ref = req.get("ref")
    if not (isinstance(ref, list) and len(ref) == 2 and type(ref[1]) in (int, str)):
        return {"refused": "not a reference"}
    if type(ref[1]) is int and not 0 <= ref[1] < len(table.objects):
        return {"refused": "an unknown handle"}
    result: Any = None
    try:
        target = table.get(ref)  # a name the solution deleted raises here, as its own AttributeError
        if op == "get":
            result = target
        elif op == "call":
            result = target(*args, **kwargs)
        elif op == "attr":
            result = getattr(target, str(req["name"]))
        elif op == "setattr":
            setattr(target, str(req["name"]), args[0])
        elif op == "special":
            result = SPECIAL[req["name"]](target, *args)
        elif op == "next":
            return _next(target, req.get("n"), table)
        else:
            return {"refused": f"unknown op {op!r}"}
    except BaseException as e:  # the solution raised (or exited): the tests' side sees it raised there
        return {"raise": raised(e)}
    try:
        out: dict[str, Any] = {"ok": wire.encode(result, table.add)}
        if op == "call":  # arguments the call changed in place, by value: `f(xs)` sorting `xs` is seen
            given: list[tuple[int | str, Any, Any]] = [(i, a, sent[i]) for i, a in enumerate(args)]
            given += [(k, a, sent_kw[k]) for k, a in kwargs.items()]
            now = [(key, wire.encode(a, table.add), before) for key, a, before in given
                   if type(a) in (list, dict, set, bytearray)]
            out["back"] = [[key, v] for key, v, before in now if v != before]
        return out
    except BaseException as e:  # nested too deep, too many handles, an object lying about its class
        return {"unplain": f"{type(e).__name__}: {e}"[:300]}


def serve_calls(code: str, requests: Any, tx: int) -> None:
    mod = types.ModuleType("solution")
    sys.modules["solution"] = mod
    try:
        exec(compile(code, "solution.py", "exec"), mod.__dict__)
    except BaseException as e:  # a syntax error, a raise, sys.exit: the code does not load
        try:
            why = f"{type(e).__name__}: {e}"[:300]
        except Exception:
            why = "it raised"
        send(tx, {"loaded": False, "error": why})
        return
    send(tx, {"loaded": True, "names": describe(mod)})
    table = Table(mod)
    for line in requests:
        try:
            req = json.loads(line)
            reply = answer(req, table) if isinstance(req, dict) else {"refused": "not a request"}
        except (ValueError, RecursionError):
            reply = {"refused": "not JSON"}
        send(tx, reply)


# ---- mode "io" ---------------------------------------------------------------------------------------------


def run_once(program: Any, stdin: bytes, output: int) -> dict[str, Any]:
    """One run of the solution in a forked child reading `stdin`; its output, exit status, and whether it
    passed `output` bytes (then it is killed)."""
    given = os.memfd_create("stdin")
    os.write(given, stdin)
    os.lseek(given, 0, os.SEEK_SET)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.setpgid(0, 0)
            os.dup2(given, 0)
            os.dup2(w, 1)
            os.closerange(3, 1 << 16)  # the channel to the harness among them
            sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)
            sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
            try:
                main = types.ModuleType("__main__")  # what pickle and dataclasses look the program's classes up in
                sys.modules["__main__"] = main
                exec(program, main.__dict__)
                status = 0
            except SystemExit as e:
                status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            sys.stdout.flush()
        finally:
            os._exit(status)
    os.close(w)
    os.close(given)
    ended = os.pidfd_open(pid)
    poll = select.poll()
    poll.register(r, select.POLLIN)
    poll.register(ended, select.POLLIN)
    out, over = bytearray(), False
    while True:
        ready = {fd for fd, _ in poll.poll()}
        if r in ready:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            out += chunk
            if len(out) > output:
                over = True
                break
        if ended in ready:  # it exited: what it left behind (a child holding the pipe) goes with it
            poll.unregister(ended)
            _kill_group(pid)
    _kill_group(pid)
    _, code = os.waitpid(pid, 0)
    os.close(r)
    os.close(ended)
    status = os.waitstatus_to_exitcode(code)
    return {"stdout": out[:output].decode("utf-8", errors="replace"), "status": status, "over": over}


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def serve_io(code: str, requests: Any, tx: int, output: int) -> None:
    try:
        program = compile(code, "solution.py", "exec")
    except BaseException:
        send(tx, {"loaded": False})
        return
    send(tx, {"loaded": True})
    for line in requests:
        send(tx, run_once(program, json.loads(line)["stdin"].encode("utf-8", errors="replace"), output))


def main() -> None:
    rx, tx = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    requests = os.fdopen(rx, "rb")
    task = json.loads(requests.readline())
    os.chdir(task["cwd"])
    sys.path.extend(task.get("paths", []))  # the interpreter's site-packages (numpy), read-only in the jail
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)
    import builtins
    builtins.exit = builtins.quit = sys.exit  # type: ignore[assignment]  # -S leaves them out; programs use them
    limit(task["cpu"], task["memory"], task["nproc"], task["files"])
    syscalls.deny()  # no ptrace of anyone, no other process's memory (where the kernel has seccomp)
    sys.addaudithook(no_network)
    if task["mode"] == "io":
        serve_io(task["code"], requests, tx, task["output"])
    else:
        serve_calls(task["code"], requests, tx)


if __name__ == "__main__":
    main()
