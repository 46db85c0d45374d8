"""The jail `code_tests` runs code in (flowrl.rewards.code's process side): who may see what, and `Jailed`, one
process started in a jail of its own.

Strict isolation (util-linux's `unshare`, `mount`, `chroot` and `setpriv`): each jail gets mount, network, PID and
IPC namespaces of its own, in a fresh root that holds only `/usr` read-only, the interpreter (this process's own
Python and its site-packages, read-only: numpy is there), a few devices, its own `/proc`, a small tmpfs `/tmp`
(`/tmp/work` its working directory) and `/dev/shm` (for `multiprocessing`), without capabilities or new privileges.
So it sees no file of the host beyond those (the data set, the flow, the harness are not there), no network (a down
loopback), no process outside its own, no System V IPC object of the host (and none it makes outlives it), and
cannot signal or trace the harness. Killing `unshare` kills the namespace's first process, and with it every process
it started.
Two ways to get there, the first that works:
- as root ("root"): the jail also runs as a user id of its own (solutions one of `UIDS`, the tests' process one of
  `TESTS_UIDS`, no groups), so its process limit counts its own processes only;
- as anyone, where the kernel allows unprivileged user namespaces ("user namespace"): the jail is root of a user
  namespace of its own (the caller's user outside, no capabilities); its process limit is counted against the
  caller's user, so it is set to the caller's count plus `processes` when the jail starts.

Without either (a tool missing, the kernel refusing namespaces) the process runs as the caller, in a temporary
directory, with the rlimits, the socket audit hook and the seccomp filter (`flowrl.rewards.syscalls`: no ptrace,
no other process's memory) only: the solution could read what the caller can read and signal the caller's
processes. `isolation()` says what is missing; the first session that runs so warns
once (`SandboxWarning`), and `require_strict()` (the reward key `sandbox = "strict"`) refuses instead.
"""

from __future__ import annotations

import functools
import itertools
import os
import shlex
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from dataclasses import dataclass
from typing import Protocol

from flowrl.rewards.bounded import end

UIDS = range(200_000, 260_000)  # a user id per solution's jail: its process limit and its files are its own
TESTS_UIDS = range(260_000, 262_000)  # the tests' process: never a solution's
_SEQUENCE = itertools.count()
TOOLS = ("unshare", "mount", "chroot", "setpriv")
THREADS = {k: "1" for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}  # numpy's pools

# Runs as root in the new namespaces (propagation private: nothing it mounts is seen outside), then drops to
# the jail's user in the new root and executes "$@". All the root's mounts are one `mount --all` over a table
# (`_table`, written by the shell's own printf where the scratch tmpfs then hides it): a process per mount was
# most of a jail's start-up.
JAIL = r"""
set -e
mount -t tmpfs -o size=4m,mode=755 flowrl-sandbox {root}
cd {root}
mkdir -p {dirs}
: > dev/null
: > dev/urandom
{links}
printf '%s\n' {table} > tmp/flowrl.fstab
mount --all --fstab tmp/flowrl.fstab
mkdir -m 1777 tmp/work
exec chroot . setpriv {user} --inh-caps=-all --bounding-set=-all --no-new-privs -- "$@"
"""
# Where the new root is put together: a tmpfs mounted over one of these (in the jail's mount namespace only), the
# first that holds none of the folders bound into the root (a mount over it would hide them: a virtual environment
# under /tmp was empty in the jail, so numpy and pytest were missing).
STAGING = ("/tmp", "/mnt", "/media", "/srv", "/opt", "/var/tmp", "/run")
JAIL_WORK = "/tmp/work"  # the solution's working directory: empty (its /tmp may hold a bound folder's mount point)
AS_ITS_OWN_USER = "--reuid=$FLOWRL_UID --regid=$FLOWRL_UID --clear-groups"  # root only


class SandboxWarning(RuntimeWarning):
    """Solutions run without the isolation `code_tests` promises (what is missing is in the message)."""


class SandboxError(RuntimeError):
    """`sandbox = "strict"` where strict isolation is not available here."""


@dataclass(frozen=True)
class Interpreter:
    """The Python a jail runs: this process's own base interpreter, with this environment's site-packages on its
    path (so a solution may import what the flow's environment has: numpy, ...), all read-only."""

    executable: str
    paths: tuple[str, ...]  # put on sys.path by the jailed program (it runs with -I -S: no .pth is read)
    mounts: tuple[str, ...]  # directories bound read-only into the jail's root: those /usr does not hold


@functools.cache
def interpreter() -> Interpreter:
    executable = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    found = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    paths = tuple(dict.fromkeys(os.path.realpath(p) for p in found if os.path.isdir(p)))
    mounts: list[str] = []
    for folder in (prefix, *paths):
        if not any(_under(folder, m) for m in ("/usr", *mounts)):
            mounts.append(folder)
    if not _under(executable, prefix) and not _under(executable, "/usr"):
        mounts.append(os.path.dirname(executable))
    return Interpreter(executable, paths, tuple(mounts))


SYSTEM = Interpreter("/usr/bin/python3", (), ())  # where this Python's folders cannot be bound (a caller who
# cannot read them): the system's, under /usr, without the environment's packages


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


@dataclass(frozen=True)
class Isolation:
    """What this machine allows: `strict` (by `way`: "root" or "user namespace"), or the reasons it is not."""

    strict: bool
    missing: tuple[str, ...] = ()
    way: str = ""
    python: Interpreter | None = None  # what the jail runs; None: this process's own (`interpreter()`)

    def describe(self) -> str:
        if self.strict:
            who = "its own user" if self.way == "root" else "a user namespace of its own"
            if self.python == SYSTEM and interpreter() != SYSTEM:
                return (f"strict: namespaces (mount, network, PID, IPC), {who}, a root holding /usr only (the "
                        "system's Python: this one's folders could not be bound, so its packages are missing)")
            return f"strict: namespaces (mount, network, PID, IPC), {who}, a root holding /usr and Python only"
        return ("code_tests runs solutions WITHOUT isolation: as this process's user, able to read its files "
                "(the data set's expected outputs among them) and signal its processes; only rlimits, a socket "
                "audit hook and a seccomp filter against tracing hold. Missing: " + "; ".join(self.missing))


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
    missing = []
    if os.geteuid() != 0:
        missing.append(f"root (running as uid {os.geteuid()})")
    for way in ("root", "user namespace") if os.geteuid() == 0 else ("user namespace",):
        pythons = [interpreter()] + ([SYSTEM] if interpreter() != SYSTEM and os.path.exists(SYSTEM.executable) else [])
        whys = [_try(way, python) for python in pythons]
        for python, why in zip(pythons, whys, strict=True):
            if why is None:
                return Isolation(True, way=way, python=python)
        missing.append(f"as root, the kernel refused the jail: {whys[0]}" if way == "root" else
                       f"unprivileged user namespaces: {whys[0]}")
    return Isolation(False, tuple(missing))


def _try(way: str, python: Interpreter) -> str | None:
    """None when a jail of this way runs `python` here, else what went wrong."""
    try:
        # the uid, once the interpreter's packages are there to import (a bind that did not land is an empty folder)
        probe = subprocess.run([*_jail_command(way, python), python.executable, "-I", "-S", "-c",
                                "import os, sys; gone = [p for p in sys.argv[1:] if not os.path.isdir(p) or not "
                                "os.listdir(p)]; print(os.getuid()) if not gone else sys.exit(f'not in the jail: {gone}')",
                                *python.paths], capture_output=True, timeout=60,
                               env=_jail_env(UIDS[next(_SEQUENCE) % len(UIDS)]))
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


def _links() -> tuple[str, list[str]]:
    """The root's other top-level entries /usr serves: symlinks where the host merged them into /usr (made by one
    `ln`), else folders to bind read-only (returned apart, for the mount table)."""
    merged, out, binds = [], [], []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{name}"
        if os.path.islink(path) and os.readlink(path) == f"usr/{name}":
            merged.append(f"usr/{name}")
        elif os.path.islink(path):
            out.append(f"ln -s {shlex.quote(os.readlink(path))} {name}")
        elif os.path.isdir(path):
            binds.append(path)
    if merged:
        out.insert(0, f"ln -s {' '.join(merged)} .")
    return "\n".join(out), binds


def _table(rows: list[tuple[str, str, str, str]]) -> str:
    """Lines of an fstab(5), each a shell word: its fields escaped as fstab wants them (octal, for a space in a
    folder's name)."""
    def field(text: str) -> str:
        return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in text)
    return " ".join(shlex.quote(" ".join(field(f) for f in row) + " 0 0") for row in rows)


def _jail_command(way: str, python: Interpreter, scratch: int = 64 << 20) -> list[str]:
    user = ["--user", "--map-root-user"] if way != "root" else []
    links, bound = _links()
    binds = [*bound, *python.mounts]
    root = staging(["/usr", "/dev", "/proc", *binds])
    folders = ["usr", "proc", "dev/shm", "tmp", *("." + m for m in binds)]
    tmpfs = f"size={scratch},mode=1777,nosuid,nodev"
    # a bound folder under the jail's /tmp gets its mount point in the scratch tmpfs, once that is mounted
    table = _table([("/usr", root + "/usr", "none", "bind,ro"), ("/dev/null", root + "/dev/null", "none", "bind"),
                    ("/dev/urandom", root + "/dev/urandom", "none", "bind"),
                    ("proc", root + "/proc", "proc", "nosuid,nodev,noexec"),
                    ("flowrl-scratch", root + "/tmp", "tmpfs", tmpfs),
                    ("flowrl-shm", root + "/dev/shm", "tmpfs", tmpfs),
                    *((m, root + m, "none", "bind,ro,X-mount.mkdir") for m in binds)])
    script = JAIL.format(root=shlex.quote(root), dirs=" ".join(shlex.quote(f) for f in folders), links=links,
                         table=table, user=AS_ITS_OWN_USER if way == "root" else "")
    return ["unshare", *user, "--mount", "--net", "--pid", "--ipc", "--fork", "--kill-child", "--propagation",
            "private", "sh", "-c", script, "flowrl-jail"]


def staging(sources: list[str]) -> str:
    """The folder the jail's root is put together in: the first of `STAGING` that exists and is none of `sources`
    nor holds one (else /tmp, and a probe finds the packages missing)."""
    for folder in STAGING:
        if os.path.isdir(folder) and not os.path.islink(folder) and not any(_under(src, folder) for src in sources):
            return folder
    return STAGING[0]


def _jail_env(uid: int) -> dict[str, str]:
    return {"FLOWRL_UID": str(uid), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", **THREADS}


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


class Program(Protocol):
    """What a jail runs: `python -I -S -c text(same_python)`; `same_python`: the jail runs this process's own
    interpreter (so code compiled here runs there: flowrl.rewards.sessions.Program)."""

    def text(self, same_python: bool) -> str: ...


class Jailed:
    """One process running `program` (`python -I -S -c`) in a jail of its own, with `stdin` and `stdout` the
    descriptors given (or pipes: `subprocess.PIPE`). `task()` is what the program must be told of where it runs
    (its working directory, its process limit, its interpreter's paths); `close()` kills it and everything it
    started, and removes its directory when it had one of the host's."""

    def __init__(self, program: Program, stdin: int, stdout: int, *, processes: int, scratch: int,
                 tests: bool = False):
        self.work: str | None = None
        found = isolation()
        python = found.python or interpreter()
        if found.strict:
            pool = TESTS_UIDS if tests else UIDS
            uid = pool[(os.getpid() if tests else os.getpid() * 7919 + next(_SEQUENCE)) % len(pool)]
            command, env, cwd = [*_jail_command(found.way, python, scratch), python.executable], _jail_env(uid), "/"
            self.cwd, self.nproc = JAIL_WORK, processes if found.way == "root" else _tasks_of(os.getuid()) + processes
        else:
            warn_once()
            self.work = tempfile.mkdtemp(prefix="flowrl-code-")
            command, env, cwd = [python.executable], dict(THREADS), self.work
            self.cwd, self.nproc = self.work, _tasks_of(os.getuid()) + processes
        self.paths = list(python.paths)
        text = program.text(python.executable == interpreter().executable)
        self.proc = subprocess.Popen([*command, "-I", "-S", "-c", text], stdin=stdin, stdout=stdout,
                                     stderr=subprocess.DEVNULL, cwd=cwd, env=env, start_new_session=True)

    def task(self) -> dict[str, object]:
        return {"cwd": self.cwd, "nproc": self.nproc, "paths": self.paths}

    def close(self) -> None:
        end(self.proc, group=True)  # unshare and what it runs; the namespaces die with them
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)
