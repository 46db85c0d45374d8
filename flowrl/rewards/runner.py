"""The solution's side of `code_tests` (flowrl.rewards.code): runs inside the sandbox, standard library only.

flowrl never imports this module: `flowrl.rewards.sandbox` passes its source to `python -I -S -c` in the jail.
It speaks JSON lines on its stdin/stdout (moved to private descriptors at once; 0, 1 and 2 become /dev/null):
the first line is the task (`code`, `mode`, limits), each later line one test's request, answered by one line.
It never sees an expected value and never says whether a test passed: it reports what the solution computed
(values serialized to plain data, or a program's output) and the harness compares outside this process. All of
it runs beside the solution, which may rewrite any of it; what it can forge is only what it could have
computed anyway.

- mode "assert": the solution runs once in a namespace; each request is `steps`, `["run", source]` (executed)
  or `["probe", expression]` (evaluated, its value serialized by `plain`); answered `{"values", "error"}`.
- mode "io": each request is `{"stdin": text}`; a forked child runs the solution with that input on fd 0, its
  fd 1 read here up to `output` bytes (it holds no other descriptor); answered `{"stdout", "status", "over"}`.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import sys
from typing import Any

MAX_DEPTH = 64


def plain(x: Any, depth: int = 0) -> list[Any]:
    """`x` as tagged JSON of builtin types only, decided by exact type: a subclass (an int with its own `__eq__`)
    or any other object is refused (TypeError), so nothing the solution defines reaches the comparison."""
    if depth > MAX_DEPTH:
        raise TypeError("nested too deep")
    t = type(x)
    if x is None:
        return ["none"]
    if t is bool:
        return ["bool", x]
    if t is int:
        return ["int", str(x)]
    if t is float:
        return ["float", repr(x)]
    if t is complex:
        return ["complex", repr(x.real), repr(x.imag)]
    if t is str:
        return ["str", x]
    if t is bytes:
        return ["bytes", x.hex()]
    if t in (list, tuple, set, frozenset):
        return [t.__name__, [plain(v, depth + 1) for v in x]]
    if t is dict:
        return ["dict", [[plain(k, depth + 1), plain(v, depth + 1)] for k, v in x.items()]]
    raise TypeError(f"not plain data: {t.__name__}")


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


def serve_asserts(code: str, requests: Any, tx: int) -> None:
    space: dict[str, Any] = {"__name__": "solution"}  # a program's `if __name__ == "__main__":` part stays off
    try:
        exec(compile(code, "solution.py", "exec"), space)
        loaded = True
    except BaseException:  # a syntax error, a raise, sys.exit: the code does not load
        loaded = False
    send(tx, {"loaded": loaded})
    for line in requests:
        env = dict(space)
        values: list[Any] = []
        error = None
        for kind, source in json.loads(line)["steps"]:
            try:
                if kind == "run":
                    exec(compile(source, "test", "exec"), env)
                else:
                    values.append(plain(eval(compile(source, "test", "eval"), env)))
            except BaseException as e:
                if kind == "run":
                    error = type(e).__name__
                    break
                values.append(["raised", type(e).__name__])
        send(tx, {"values": values, "error": error})


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
                exec(program, {"__name__": "__main__"})
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
    sys.set_int_max_str_digits(0)
    import builtins
    builtins.exit = builtins.quit = sys.exit  # type: ignore[assignment]  # -S leaves them out; programs use them
    limit(task["cpu"], task["memory"], task["nproc"], task["files"])
    sys.addaudithook(no_network)
    if task["mode"] == "io":
        serve_io(task["code"], requests, tx, task["output"])
    else:
        serve_asserts(task["code"], requests, tx)


if __name__ == "__main__":
    main()
