"""Calls with a hard wall-clock limit from any thread (flowrl.rewards): warm helper processes that a call past its
limit kills. What `math_equal` grades in, so that no answer can hang the thread that scores it.

A signal-based limit (`signal.alarm`) works in a process's main thread only, and only between bytecodes: a
C-level computation (sympy raising `9^9^9^9`) holds the interpreter until it ends. A process can always be
killed. `Helpers(script)` keeps processes running `script` (a `-c` program answering one JSON line per JSON line
on stdin/stdout) warm: a call takes an idle one (starting one when none is idle, so concurrent callers each get
their own), sends its request and waits at most `limit` seconds for the answer; past it, or when the process
died, the call gets `None` and the process is killed and forgotten (the next call starts a fresh one). A
process's start-up (imports) is never counted in a call's limit; it has `START_S` of its own. The processes
end when this one closes their stdin (at exit, or when it dies); `close()` kills them.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

START_S = 120.0


class HelperError(RuntimeError):
    """A helper process that could not start (its first line says why)."""


class _Process:
    def __init__(self, script: str):
        self.proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.rx = self.proc.stdout.fileno()
        self.buffer = b""
        self.ready = False

    def line(self, limit: float) -> Any:
        """The next JSON line within `limit` seconds, or None (late, dead, garbled)."""
        deadline = time.monotonic() + limit
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            poll = select.poll()
            poll.register(self.rx, select.POLLIN)
            if left <= 0 or not poll.poll(left * 1000):
                return None
            chunk = os.read(self.rx, 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError:
            return None

    def send(self, request: Any) -> bool:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            return True
        except (OSError, ValueError):
            return False

    def kill(self) -> None:
        end(self.proc)


def end(proc: subprocess.Popen[bytes], group: bool = False) -> None:
    """Kill `proc` (with `group`, its whole process group: it was started in a session of its own), reap it and
    close the pipes this process holds to it. Also what ends the sandbox's jails (flowrl.rewards.sandbox)."""
    try:
        if group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError, OSError):
        pass
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass


class Helpers:
    """Warm processes running `script`; `call(request, limit)` from any thread (see the module docstring)."""

    def __init__(self, script: str):
        self.script = script
        self.idle: list[_Process] = []
        self.lock = threading.Lock()
        self.killed = 0  # calls that ran past their limit or whose process died
        atexit.register(self.close)

    def _take(self) -> _Process:
        with self.lock:
            if self.idle:
                return self.idle.pop()
        proc = _Process(self.script)
        hello = proc.line(START_S)
        if not isinstance(hello, dict) or hello.get("ready") is not True:
            proc.kill()
            why = hello.get("error") if isinstance(hello, dict) else "no answer"
            raise HelperError(f"a helper process did not start: {why}")
        return proc

    def call(self, request: Any, limit: float) -> Any:
        """The answer, or None when it took longer than `limit` seconds or the process died."""
        proc = self._take()
        answer = proc.line(limit) if proc.send(request) else None
        if answer is None:
            proc.kill()
            with self.lock:
                self.killed += 1
            return None
        with self.lock:
            self.idle.append(proc)
        return answer

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for proc in idle:
            proc.kill()
