"""The jail `code_tests` runs solutions in, and the channel to it (flowrl.rewards.code's process side).

Strict isolation (util-linux's `unshare`, `mount`, `chroot` and `setpriv`): each session gets mount, network
and PID namespaces of its own, in a fresh root that holds only `/usr` read-only, a few devices, its own `/proc`
and a small tmpfs `/tmp` (its working directory), without capabilities or new privileges. So it sees no file of
the host outside `/usr` (the data set, the flow, the harness are not there), no network (a down loopback), no
process outside its own, and cannot signal or trace the harness. Killing `unshare` kills the namespace's first
process, and with it every process the solution started. Two ways to get there, the first that works:
- as root ("root"): the session also runs as a user id of its own (one of `UIDS`, no groups), so its process
  limit counts its own processes only;
- as anyone, where the kernel allows unprivileged user namespaces ("user namespace"): the session is root of a
  user namespace of its own (the caller's user outside, no capabilities); its process limit is counted against
  the caller's user, so it is set to the caller's count plus `processes` when the session starts.

Without either (a tool missing, the kernel refusing namespaces) the session runs as the caller, in a temporary
directory, with the rlimits and the socket audit hook only: the solution could read what the caller can read
and signal the caller's processes. `isolation()` says what is missing; the first session that runs so warns
once (`SandboxWarning`), and `require_strict()` (the reward key `sandbox = "strict"`) refuses instead.
"""

from __future__ import annotations

import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SYSTEM_PYTHON = "/usr/bin/python3"  # inside the jail's root: /usr is all it has
UIDS = range(200_000, 260_000)  # a user id per session: its process limit and its files are its own
_SEQUENCE = itertools.count()
RUNNER = (Path(__file__).parent / "runner.py").read_text()
TOOLS = ("unshare", "mount", "chroot", "setpriv")

# Runs as root in the new namespaces (propagation private: nothing it mounts is seen outside), then drops to
# the session's user in the new root and executes "$@" (the runner).
JAIL = r"""
set -e
mount -t tmpfs -o size=4m,mode=755 flowrl-sandbox /tmp
cd /tmp
mkdir usr proc dev tmp
mount -o bind,ro /usr usr
{links}
touch dev/null dev/urandom
mount -o bind /dev/null dev/null
mount -o bind /dev/urandom dev/urandom
mount -t proc -o nosuid,nodev,noexec proc proc
mount -t tmpfs -o size={scratch},mode=1777,nosuid,nodev flowrl-scratch tmp
exec chroot . setpriv {user} --inh-caps=-all --bounding-set=-all --no-new-privs -- "$@"
"""
AS_ITS_OWN_USER = "--reuid=$FLOWRL_UID --regid=$FLOWRL_UID --clear-groups"  # root only


class SandboxWarning(RuntimeWarning):
    """Solutions run without the isolation `code_tests` promises (what is missing is in the message)."""


class SandboxError(RuntimeError):
    """`sandbox = "strict"` where strict isolation is not available here."""


@dataclass(frozen=True)
class Isolation:
    """What this machine allows: `strict` (by `way`: "root" or "user namespace"), or the reasons it is not."""

    strict: bool
    missing: tuple[str, ...] = ()
    way: str = ""

    def describe(self) -> str:
        if self.strict:
            who = "its own user" if self.way == "root" else "a user namespace of its own"
            return f"strict: namespaces (mount, network, PID), {who}, a root holding /usr only"
        return ("code_tests runs solutions WITHOUT isolation: as this process's user, able to read its files "
                "(the data set's expected outputs among them) and signal its processes; only rlimits and a socket "
                "audit hook hold. Missing: " + "; ".join(self.missing))


_FOUND: list[Isolation] = []
_WARNED: list[bool] = []


def isolation() -> Isolation:
    """Probed once per process: a real session through the jail, or why it cannot be."""
    if not _FOUND:
        _FOUND.append(_probe())
    return _FOUND[0]


def _probe() -> Isolation:
    absent = [t for t in TOOLS if shutil.which(t) is None]
    if absent:
        return Isolation(False, (f"the tools {', '.join(absent)} (util-linux)",))
    if not os.path.exists(SYSTEM_PYTHON):
        return Isolation(False, (f"{SYSTEM_PYTHON} (the jail's interpreter, under /usr)",))
    missing = []
    if os.geteuid() == 0:
        why = _try("root")
        if why is None:
            return Isolation(True, way="root")
        missing.append(f"as root, the kernel refused the jail: {why}")
    else:
        missing.append(f"root (running as uid {os.geteuid()})")
    why = _try("user namespace")
    if why is None:
        return Isolation(True, way="user namespace")
    missing.append(f"unprivileged user namespaces: {why}")
    return Isolation(False, tuple(missing))


def _try(way: str) -> str | None:
    """None when a jail of this way runs a process here, else what went wrong."""
    try:
        probe = subprocess.run([*_jail_command(way), SYSTEM_PYTHON, "-I", "-S", "-c", "import os; print(os.getuid())"],
                               capture_output=True, timeout=60, env=_jail_env(next(_SEQUENCE)))
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"it did not start ({e})"
    uid = probe.stdout.strip()
    if probe.returncode == 0 and uid.isdigit() and (int(uid) != 0) == (way == "root"):
        return None
    err = probe.stderr.decode(errors="replace").strip().splitlines()
    return err[-1] if err else f"exit status {probe.returncode}"


def require_strict() -> None:
    found = isolation()
    if not found.strict:
        raise SandboxError(found.describe())


def warn_once() -> None:
    found = isolation()
    if not found.strict and not _WARNED:
        _WARNED.append(True)
        warnings.warn(found.describe(), SandboxWarning, stacklevel=3)
        print(f"flowrl: WARNING: {found.describe()}", file=sys.stderr, flush=True)


def _links() -> str:
    """The root's other top-level entries /usr serves: symlinks where the host merged them into /usr (made by
    one `ln`), read-only binds where it did not."""
    merged, out = [], []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{name}"
        if os.path.islink(path) and os.readlink(path) == f"usr/{name}":
            merged.append(f"usr/{name}")
        elif os.path.islink(path):
            out.append(f"ln -s {os.readlink(path)} {name}")
        elif os.path.isdir(path):
            out.append(f"mkdir {name} && mount -o bind,ro {path} {name}")
    if merged:
        out.insert(0, f"ln -s {' '.join(merged)} .")
    return "\n".join(out)


def _jail_command(way: str, scratch: int = 64 << 20) -> list[str]:
    user = ["--user", "--map-root-user"] if way != "root" else []
    script = JAIL.format(links=_links(), scratch=scratch, user=AS_ITS_OWN_USER if way == "root" else "")
    return ["unshare", *user, "--mount", "--net", "--pid", "--fork", "--kill-child", "--propagation", "private",
            "sh", "-c", script, "flowrl-jail"]


def _jail_env(n: int) -> dict[str, str]:
    return {"FLOWRL_UID": str(UIDS[(os.getpid() * 7919 + n) % len(UIDS)]), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


def _tasks_of(uid: int) -> int:
    """Threads this user has now (what RLIMIT_NPROC counts), for a limit that binds the caller's own user."""
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    return count


class Session:
    """One jailed runner and its channel: `send` a JSON request, `receive` one JSON line, each before
    `deadline` (time.monotonic) and within `reply_bytes`. Anything wrong (a late, long or garbled reply, the
    runner gone) raises `Broken`; `close` kills everything it started."""

    def __init__(self, task: dict[str, Any], deadline: float, reply_bytes: int, processes: int, scratch: int):
        self.deadline, self.reply_bytes = deadline, reply_bytes
        self.work: str | None = None
        found = isolation()
        if found.strict:
            command = [*_jail_command(found.way, scratch), SYSTEM_PYTHON]
            nproc = processes if found.way == "root" else _tasks_of(os.getuid()) + processes
            env, cwd, task = _jail_env(next(_SEQUENCE)), "/", {**task, "cwd": "/tmp", "nproc": nproc}
        else:
            warn_once()
            self.work = tempfile.mkdtemp(prefix="flowrl-code-")
            command, env, cwd = [sys.executable], {}, self.work
            task = {**task, "cwd": self.work, "nproc": _tasks_of(os.getuid()) + processes}
        self.proc = subprocess.Popen([*command, "-I", "-S", "-c", RUNNER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=cwd, env=env,
                                     start_new_session=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.tx, self.rx = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self.tx, False)
        os.set_blocking(self.rx, False)
        self.buffer = bytearray()
        self.send(task)

    def send(self, obj: Any) -> None:
        data = memoryview((json.dumps(obj) + "\n").encode())
        while data:
            self._wait(self.tx, select.POLLOUT)
            try:
                data = data[os.write(self.tx, data):]
            except BlockingIOError:
                continue
            except OSError as e:  # the runner is gone
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
            if not chunk:
                raise Broken("the runner ended")
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

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # unshare and the runner; the namespace dies with them
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)


class Broken(Exception):
    """The session can answer no more (why in the message): the tests not yet answered fail."""
