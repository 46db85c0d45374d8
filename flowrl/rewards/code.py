"""`code_tests` (flowrl.rewards): runs a response's Python code against the row's tests in a sandboxed process;
partial credit by tests passed.

The row's `tests` column is a list of Python snippets, each run after the solution in its namespace (usually one
`assert`: `"assert add(2, 3) == 5"`); a snippet passes when it raises nothing. The code is the response's last
```python fenced block, or the whole response. Score = passed / len(tests); 0.0 when the code does not load.

What the sandbox enforces (each tested with hostile code, tests/rewards/test_code.py):
- wall-clock limit (`TIMEOUT_S`): the process group is killed; tests that finished before count (each result is
  reported as it comes), later ones fail. CPU-time, address-space (`MEMORY_BYTES`), file-size and open-file
  limits (setrlimit in the child);
- no new processes beyond a few (RLIMIT_NPROC, enforced for an unprivileged user: as root the child runs as
  `nobody` through `unshare -n -- setpriv`), so a fork bomb fails at its first forks;
- no network: a network namespace of its own (as root) whose only interface is a down loopback, and an audit
  hook in the child that refuses every `socket.*` event either way;
- a fresh temporary working directory, removed afterwards; as root the child runs as `nobody` without groups,
  so files the parent's user keeps private (mode 0600/0700, /root) cannot be read; world-readable files can (no
  mount namespace or container here: that is the limit of what this sandbox hides). Not as root (a developer's
  machine), the child runs as the caller with the limits and the audit hook only;
- an isolated interpreter (`python -I -S`: no site-packages, no environment variables, an empty environment),
  its output discarded (a flood of output costs nothing but its time) and its result read from a pipe, at most
  `RESULT_BYTES`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from flowrl.registry import reward

TIMEOUT_S = 5.0
MEMORY_BYTES = 1 << 30
MAX_PROCESSES = 8  # RLIMIT_NPROC for the sandbox's user
RESULT_BYTES = 1 << 16
NOBODY = 65534
FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)

# Runs inside the sandbox: limits first, then the solution and each test in a copy of its namespace, reporting
# after each test on fd 3.
RUNNER = r"""
import json, os, resource, sys
for limit, value in ((resource.RLIMIT_CPU, {cpu}), (resource.RLIMIT_AS, {memory}), (resource.RLIMIT_NPROC, {nproc}),
                     (resource.RLIMIT_FSIZE, 1 << 20), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    try:
        resource.setrlimit(limit, (value, value))
    except (ValueError, OSError):
        pass
def guard(event, args):
    if event.startswith("socket."):
        raise PermissionError("code_tests: network access is off")
sys.addaudithook(guard)
os.dup2({fd}, 3)
report = os.fdopen(3, "w")
with open("task.json") as f:
    task = json.load(f)
done = []
try:
    space = {{"__name__": "__main__"}}
    exec(compile(task["code"], "solution.py", "exec"), space)
except BaseException:
    space = None
for test in task["tests"]:
    if space is None:
        done.append(False)
    else:
        try:
            exec(compile(test, "test", "exec"), dict(space))
            done.append(True)
        except BaseException:
            done.append(False)
    report.write(json.dumps(done) + "\n")
    report.flush()
"""

def extract_code(response: str) -> str:
    """The last ```python fenced block of a response, or the whole response."""
    blocks = FENCE.findall(response)
    return str(blocks[-1]) if blocks else response


SYSTEM_PYTHON = "/usr/bin/python3"  # readable by `nobody` (a venv under /root usually is not)
_JAIL: list[list[str]] = []  # the command prefix that drops to nobody without network, once probed


def jail() -> list[str]:
    """`unshare -n -- setpriv ... --` (a network namespace of its own, then user nobody without groups) with the
    system Python, where that works here (as root, with util-linux); else this interpreter, with the limits and
    the audit hook only."""
    if not _JAIL:
        prefix = ["unshare", "-n", "--", "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                  "--", SYSTEM_PYTHON]
        usable = os.geteuid() == 0 and all(shutil.which(t) for t in ("unshare", "setpriv")) and \
            os.path.exists(SYSTEM_PYTHON)
        if usable:
            probe = subprocess.run([*prefix, "-I", "-S", "-c", "pass"], capture_output=True, timeout=30)
            usable = probe.returncode == 0
        _JAIL.append(prefix if usable else [sys.executable])
    return _JAIL[0]


def run_tests(code: str, tests: Sequence[str], timeout: float = TIMEOUT_S) -> list[bool]:
    """Each test's outcome (False for those not reached within `timeout`)."""
    command = jail()
    dropped = command[0] == "unshare"
    work = tempfile.mkdtemp(prefix="flowrl-code-")
    read_fd, write_fd = os.pipe()
    try:
        with open(os.path.join(work, "task.json"), "w") as f:
            json.dump({"code": code, "tests": list(tests)}, f)
        if dropped:  # its own directory is the one place it may write
            os.chown(work, NOBODY, NOBODY)
            os.chmod(os.path.join(work, "task.json"), 0o644)
        runner = RUNNER.format(cpu=int(timeout) + 1, memory=MEMORY_BYTES, nproc=MAX_PROCESSES, fd=write_fd)
        proc = subprocess.Popen([*command, "-I", "-S", "-c", runner], cwd=work, env={}, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(write_fd,),
                                start_new_session=True)
        os.close(write_fd)
        write_fd = -1
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the solution and anything it started
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        raw = _read_at_most(read_fd, RESULT_BYTES)
    finally:
        if write_fd >= 0:
            os.close(write_fd)
        os.close(read_fd)
        shutil.rmtree(work, ignore_errors=True)
    return _last_report(raw, len(tests))


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks, size = [], 0
    os.set_blocking(fd, False)
    while size < limit:
        try:
            chunk = os.read(fd, min(4096, limit - size))
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _last_report(raw: bytes, count: int) -> list[bool]:
    done: list[Any] = []
    for line in raw.decode(errors="replace").splitlines():
        try:
            parsed = json.loads(line)
        except ValueError:
            continue
        if isinstance(parsed, list):
            done = parsed
    outcome = [bool(x) for x in done[:count]]
    return outcome + [False] * (count - len(outcome))


@reward("code_tests")
def code_tests(prompt: str, response: str, tests: object = None, **_: object) -> float:
    """The fraction of the row's `tests` the response's code passes (see the module docstring)."""
    cases = [str(t) for t in tests] if isinstance(tests, (list, tuple)) else ([str(tests)] if tests else [])
    if not cases:
        return 0.0
    return sum(run_tests(extract_code(response), cases)) / len(cases)
