"""The harness's side of `code_tests`' processes (flowrl.rewards.code): the programs sent into the jails, the
channel it reads them on (bounded in bytes and by the row's deadline), and the warm tests' process.

- `Program`: a `python -c` program made of flowrl.rewards modules (the jail sees no flowrl): each is loaded as
  module `flowrl_NAME`, then the last one's `main()` runs.
- `Channel`: JSON lines each way over descriptors, every wait bounded by the deadline and every line by
  `reply_bytes`; anything wrong raises `Broken`.
- `Session`: a jailed runner with a channel of its own (the stdin/stdout tests: the harness compares outputs).
- `TestsSide`: the tests' process (`flowrl.rewards.checker`), started once per process, jailed apart from every
  solution; `start(row)` hands it a row's descriptors, `stop(row)` kills that row's child.
"""

from __future__ import annotations

import atexit
import binascii
import functools
import itertools
import json
import marshal
import os
import select
import socket
import subprocess
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowrl.rewards.sandbox import Jailed

START_S = 60.0  # the tests' process's start-up, never counted in a row's time
_HERE = Path(__file__).parent


@dataclass(frozen=True)
class Program:
    """A `-c` program made of flowrl.rewards modules: each loaded as module `flowrl_NAME`, then the last one's
    main() runs. For the interpreter this process runs (the jail's, unless it fell back to the system's), the
    modules travel compiled (marshal, zlib; one argument holds at most 128 KiB): compiling ~30 KB of source was
    a tenth of a row's CPU time."""

    modules: tuple[str, ...]

    def text(self, same_python: bool) -> str:
        return _text(self.modules, same_python)


@functools.cache
def _text(modules: tuple[str, ...], compiled: bool) -> str:
    lines = ["import sys, types" + (", marshal, binascii, zlib" if compiled else ""),
             "def _load(name, code):",
             "    module = types.ModuleType(name)",
             "    sys.modules[name] = module",
             "    exec(code, module.__dict__)",
             "    return module"]
    for i, m in enumerate(modules):
        source = (_HERE / f"{m}.py").read_text()
        if compiled:
            code_object = compile(source, f"flowrl_{m}.py", "exec", dont_inherit=True)
            blob = binascii.b2a_base64(zlib.compress(marshal.dumps(code_object), 9), newline=False)
            code = f"marshal.loads(zlib.decompress(binascii.a2b_base64({blob.decode()!r})))"
        else:
            code = f"compile({source!r}, 'flowrl_{m}.py', 'exec')"
        lines.append(f"_load('flowrl_{m}', {code})" + (".main()" if i == len(modules) - 1 else ""))
    return "\n".join(lines) + "\n"


RUNNER = Program(("wire", "syscalls", "runner"))
CHECKER = Program(("wire", "proxies", "checker"))


class Broken(Exception):
    """The channel can answer no more (why in the message): what was not answered yet fails."""


class Channel:
    """`send` a JSON line, `receive` one, each before `deadline` (time.monotonic) and within `reply_bytes`."""

    def __init__(self, tx: int, rx: int, deadline: float, reply_bytes: int):
        self.tx, self.rx, self.deadline, self.reply_bytes = tx, rx, deadline, reply_bytes
        os.set_blocking(tx, False)
        os.set_blocking(rx, False)
        self.buffer = bytearray()

    def send(self, obj: Any) -> None:
        data = memoryview((json.dumps(obj) + "\n").encode())
        while data:
            self._wait(self.tx, select.POLLOUT)
            try:
                data = data[os.write(self.tx, data):]
            except BlockingIOError:
                continue
            except OSError as e:  # the other side is gone
                raise Broken(str(e)) from None

    def receive(self) -> Any:
        while b"\n" not in self.buffer:
            if len(self.buffer) > self.reply_bytes:
                raise Broken("reply too long")
            self._wait(self.rx, select.POLLIN)
            try:
                chunk = os.read(self.rx, 1 << 16)
            except BlockingIOError:
                continue
            except OSError as e:
                raise Broken(str(e)) from None
            if not chunk:
                raise Broken("the other side ended")
            self.buffer += chunk
        line, _, rest = bytes(self.buffer).partition(b"\n")
        self.buffer = bytearray(rest)
        try:
            return json.loads(line)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            raise Broken("garbled reply") from None

    def _wait(self, fd: int, event: int) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise Broken("time is up")
        poll = select.poll()
        poll.register(fd, event)
        if not poll.poll(left * 1000):
            raise Broken("time is up")


class Session(Channel):
    """One jailed runner and its channel, sent `task` (plus where it runs) first; `close` kills it all."""

    def __init__(self, task: dict[str, Any], deadline: float, reply_bytes: int, processes: int, scratch: int):
        self.jailed = Jailed(RUNNER, subprocess.PIPE, subprocess.PIPE, processes=processes, scratch=scratch)
        proc = self.jailed.proc
        assert proc.stdin is not None and proc.stdout is not None
        super().__init__(proc.stdin.fileno(), proc.stdout.fileno(), deadline, reply_bytes)
        self.send({**task, **self.jailed.task()})

    def close(self) -> None:
        self.jailed.close()


class TestsSide:
    """The warm tests' process of this process (see the module docstring)."""

    _shared: TestsSide | None = None
    _lock = threading.Lock()

    def __init__(self, memory: int, files: int, processes: int, scratch: int):
        self.pid = os.getpid()
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.jailed = Jailed(CHECKER, theirs.fileno(), subprocess.DEVNULL, processes=processes, scratch=scratch,
                             tests=True)
        theirs.close()
        self.rows = itertools.count()
        self.lock = threading.Lock()
        self.control.settimeout(START_S)
        try:
            self.control.send(json.dumps({**self.jailed.task(), "memory": memory, "files": files}).encode())
            hello = json.loads(self.control.recv(1 << 16) or b"null")
        except (OSError, ValueError):
            hello = None
        if hello != {"ready": True}:
            self.close()
            raise Broken("the tests' process did not start")
        self.control.settimeout(None)

    @classmethod
    def shared(cls, memory: int, files: int, processes: int, scratch: int) -> TestsSide:
        """This process's tests' process, started on first use (again after a fork, or when it died)."""
        with cls._lock:
            side = cls._shared
            if side is None or side.pid != os.getpid() or side.jailed.proc.poll() is not None:
                if side is not None and side.pid == os.getpid():
                    side.close()
                side = cls._shared = TestsSide(memory, files, processes, scratch)
                atexit.register(side.close)
            return side

    def start(self, fds: list[int], seconds: float) -> int:
        """Hand it a row: `fds` = [socket to the harness, requests to the solution, replies from it]."""
        row = next(self.rows)
        with self.lock:
            try:
                socket.send_fds(self.control, [json.dumps({"run": row, "seconds": seconds}).encode()], fds)
            except OSError as e:
                raise Broken(f"the tests' process is gone: {e}") from None
        return row

    def stop(self, row: int) -> None:
        with self.lock:
            try:
                self.control.send(json.dumps({"kill": row}).encode())
            except OSError:
                pass

    def close(self) -> None:
        try:
            self.control.close()
        finally:
            self.jailed.close()
