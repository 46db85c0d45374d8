"""The tests' side of `code_tests` (flowrl.rewards.code): the jailed process that runs a row's tests, standard
library only, sent as source with `wire` and `proxies` (`flowrl.rewards.sandbox.TestsSide` starts it).

It never loads the solution. One such process per harness process waits, warm, in a jail of its own (another user
and other namespaces than any solution's); for each row the harness hands it three descriptors over its control
socket (SCM_RIGHTS): a socket to the harness, and the two pipes to that row's solution process. It forks a child
for the row (fresh state, its own memory and CPU limits and a wall-clock alarm), which forwards the solution's task
to it, reads the names it defines, then runs each test and writes one verdict line per test to the harness:
`{"i", "passed", "reason"}`. The harness kills the child at the row's deadline (`{"kill": row}`).

A test's code runs here, in a namespace holding the names it uses from the solution (`bind`):
- a function or class the solution defines is a proxy (`proxies.Remote`): a call runs there, what it returns comes
  back as plain data, and `==`, `all(...)`, `math.isclose`, helper functions and computed expected values run here
  on real values;
- a module the solution imported is the tests' own import of it, under its own name only; a name that is a
  standard module's (`math`, `re`, ...), `np` or `pd` is always that module, imported here, whatever the solution
  bound to it: a solution cannot hand the tests a `math` whose `isclose` says yes;
- a name the solution takes from a module (`from math import sqrt`) is the tests' own, when the name is the
  object's; a constant is its value; an exception class is a class of that name deriving from the same builtin;
- a builtin is never shadowed: a solution defining `set`, `sorted` or `all` does not change the tests', and
  `from solution import *` leaves them out (`from solution import sorted`, asked for by name, is the solution's).

The rule for a verdict: a test passes when its code runs to its end here without an exception and made at least
one check: an `assert` that held (counted here at every depth, so `def check(candidate): assert ...` counts) or a
call into the solution that was answered, by a value or a raise (so `if add(2, 2) != 4: raise ValueError` and
`with pytest.raises(ValueError): f(-1)` are tests). A test that asserts nothing and calls nothing (`x = 1`)
fails. A failed test's reason: `assert`, `raised` (any other exception, one the solution raised among them),
`no_plain_form` (a value that has none was compared or sent), `bad_reply`, `solution_ended`, `no_check`,
`not_loaded` (the code did not load), `bad_test` (not Python); the harness adds `timeout`.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import json
import os
import resource
import signal
import socket
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowrl.rewards import proxies, wire
else:  # in the jail the bootstrap loaded them as flowrl_NAME; in the repository they are the package's
    wire = sys.modules.get("flowrl_wire") or importlib.import_module("flowrl.rewards.wire")
    proxies = sys.modules.get("flowrl_proxies") or importlib.import_module("flowrl.rewards.proxies")

CHECKED = "__flowrl_assert_held__"


def prepare(source: str) -> tuple[types.CodeType, set[str]]:
    """The test compiled with its asserts counted (`assert x` becomes `assert x; CHECKED()`, wherever it stands;
    never optimized away), and the names it uses. One walk over the tree does both."""
    tree = ast.parse(source, "test")
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
            continue
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and any(isinstance(s, ast.Assert) for s in stmts):
                counted = [(s, _count(s)) if isinstance(s, ast.Assert) else (s,) for s in stmts]
                setattr(node, field, [c for pair in counted for c in pair])
    return compile(tree, "test", "exec", dont_inherit=True, optimize=0), names


def _count(at: ast.Assert) -> ast.stmt:
    name = ast.Name(CHECKED, ast.Load())
    call = ast.Call(name, [], [])
    count = ast.Expr(call)
    for node in (count, call, name):  # the assert's place, for the compiler and tracebacks
        ast.copy_location(node, at)
    return count


def solution_module(link: proxies.Link) -> types.ModuleType:
    """`import solution` / `from solution import add` on the tests' side: the same bindings, made on first use."""

    class Solution(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name in link.names and not (name.startswith("__") and name.endswith("__")):
                try:
                    return link.bind(name)
                except LookupError:
                    pass
            raise AttributeError(f"module 'solution' has no attribute {name!r}")

    mod = Solution("solution")
    # `from solution import *` brings no builtin's name: a solution's `sorted` would become the test's
    public = [n for n in link.names if not n.startswith("_") and not hasattr(builtins, n)]
    mod.__all__ = public  # type: ignore[attr-defined]
    return mod


def namespace(names: set[str], link: proxies.Link) -> dict[str, Any]:
    ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    for name in sorted(names & link.names.keys()):
        if hasattr(builtins, name):  # never shadowed (the module docstring)
            continue
        try:
            ns[name] = link.bind(name)
        except (LookupError, ImportError):  # a module under another name, or not importable here
            pass
    return ns


def run_test(source: str, link: proxies.Link) -> tuple[bool, str | None]:
    try:
        code, names = prepare(source)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False, "bad_test"
    held = [0]
    before, link.unplain = link.answered, []
    try:
        ns = namespace(names, link)
        ns[CHECKED] = lambda: held.__setitem__(0, held[0] + 1)
        exec(code, ns)
    except AssertionError:
        reason: str | None = "assert"
    except wire.NoPlainForm:
        reason = "no_plain_form"
    except wire.BadReply:
        reason = "bad_reply"
    except proxies.SolutionGone:
        reason = "solution_ended"
    except BaseException:
        reason = "raised"
    else:
        reason = None if held[0] + link.answered - before > 0 else "no_check"
    if reason is not None and link.unplain and reason in ("assert", "raised"):
        reason = "no_plain_form"  # a test that caught the refusal and failed after it: the refusal is why
    return reason is None, reason


def _send(fd: int, obj: Any) -> None:
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def run_row(chan: int, req_w: int, rep_r: int) -> None:
    """One row, in a child of its own: the task from the harness, then a verdict line per test."""
    with os.fdopen(os.dup(chan), "rb") as f:
        task = json.loads(f.readline())
    tests = task["tests"]
    link = proxies.Link(req_w, rep_r, int(task["reply_bytes"]))
    try:
        link.send(task["solution"])
        hello = link.read()
    except (proxies.SolutionGone, wire.BadReply):
        hello = {"loaded": False}
    if not (isinstance(hello, dict) and hello.get("loaded") is True and isinstance(hello.get("names"), dict)):
        for i in range(len(tests)):
            _send(chan, {"i": i, "passed": False, "reason": "not_loaded"})
        return
    link.names = hello["names"]
    sys.modules["solution"] = solution_module(link)
    for i, source in enumerate(tests):
        passed, reason = run_test(source, link) if isinstance(source, str) else (False, "bad_test")
        _send(chan, {"i": i, "passed": passed, "reason": reason})


def _child(req: dict[str, Any], fds: list[int], config: dict[str, Any]) -> None:
    """A row's child: its limits, then the row; it never returns."""
    try:
        seconds = max(1, int(req.get("seconds", 5)) + 1)
        signal.alarm(seconds + 1)  # a backstop: the harness kills it at the deadline
        for which, value in ((resource.RLIMIT_AS, config["memory"]), (resource.RLIMIT_CPU, seconds),
                             (resource.RLIMIT_FSIZE, config["files"]), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(which, (value, value))
        run_row(*fds)
    finally:
        os._exit(0)


def _reap(children: dict[int, int]) -> None:
    """Reap every child that ended (they are all rows'), and forget them: a zombie kept counts against the
    process limit, and its pid cannot be reused while it is one (so a token never names another row's child)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        for token in [t for t, p in children.items() if p == pid]:
            del children[token]


def serve(control: socket.socket, config: dict[str, Any]) -> None:
    """Fork a child per `{"run": token}` (with its three descriptors), kill one on `{"kill": token}`, until the
    harness closes the control socket."""
    children: dict[int, int] = {}
    while True:
        msg, fds, _, _ = socket.recv_fds(control, 1 << 16, 3)
        if not msg:
            break
        _reap(children)
        try:
            req = json.loads(msg)
            if "kill" in req and req["kill"] in children:
                os.kill(children[req["kill"]], signal.SIGKILL)  # reaped (and forgotten) with the next message
            elif "run" in req and len(fds) == 3:
                pid = os.fork()
                if pid == 0:
                    control.close()
                    _child(req, fds, config)
                children[req["run"]] = pid
        except (ValueError, TypeError, OSError):
            pass
        for fd in fds:
            os.close(fd)
    for pid in children.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def main() -> None:
    for module in ("datetime", "decimal", "fractions"):  # what decoding may need: imported once here, not per row
        importlib.import_module(module)
    control = socket.socket(fileno=os.dup(0))
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    config = json.loads(control.recv(1 << 16))
    os.chdir(config["cwd"])
    resource.setrlimit(resource.RLIMIT_NPROC, (config["nproc"], config["nproc"]))  # its rows' children and more
    sys.path.extend(config.get("paths", []))
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)
    control.send(json.dumps({"ready": True}).encode())
    serve(control, config)


if __name__ == "__main__":
    main()
