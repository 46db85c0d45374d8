"""A seccomp filter for the solution's process (flowrl.rewards.runner), standard library only (ctypes): the system
calls that reach into another process, or the kernel's keyring, return EPERM.

Denied: `ptrace` (the parent, the tests' process, the harness: whatever the namespaces leave visible, and all of
them where strict isolation is missing), `process_vm_readv` / `process_vm_writev` (another process's memory),
`pidfd_getfd` (another process's descriptors), `kcmp`, `perf_event_open`, `bpf`, `userfaultfd`, `add_key`,
`request_key`, `keyctl`; any call of another ABI than the process's own (x32, i386) too. Installed after
`no_new_privs`, it holds for the solution and every process it starts. Where the machine is neither x86_64 nor
aarch64, or the kernel has no seccomp, `deny()` returns why it did not install it and the rest of the sandbox
still holds.
"""

from __future__ import annotations

import ctypes
import os

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
DENIED = {  # name: (x86_64, aarch64)
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "pidfd_getfd": (438, 438), "kcmp": (312, 272), "perf_event_open": (298, 241), "bpf": (321, 280),
    "userfaultfd": (323, 282), "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219),
}
X32 = 0x40000000  # x86_64's x32 ABI: the same calls under other numbers
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
LD_W_ABS, JEQ_K, JGE_K, RET_K = 0x20, 0x15, 0x35, 0x06
RET_ALLOW, RET_EPERM = 0x7FFF0000, 0x00050000 | 1


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter for `machine`, as (code, jt, jf, k) instructions over `struct seccomp_data` (nr at 0, arch
    at 4)."""
    which = 0 if machine == "x86_64" else 1
    numbers = sorted({v[which] for v in DENIED.values()})
    checks = [(JGE_K, 0, 0, X32)] if machine == "x86_64" else []
    checks += [(JEQ_K, 0, 0, n) for n in numbers]
    out = [(LD_W_ABS, 0, 0, 4), (JEQ_K, 1, 0, AUDIT_ARCH[machine]), (RET_K, 0, 0, RET_EPERM), (LD_W_ABS, 0, 0, 0)]
    for i, (code, _, _, k) in enumerate(checks):  # a match jumps past the rest and the ALLOW to the EPERM
        out.append((code, len(checks) - i, 0, k))
    return out + [(RET_K, 0, 0, RET_ALLOW), (RET_K, 0, 0, RET_EPERM)]


def deny() -> str | None:
    """Install the filter on this process (and what it starts); None when installed, else why not."""
    machine = os.uname().machine
    if machine not in AUDIT_ARCH:
        return f"no filter written for {machine}"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        code = program(machine)
        filters = (_Filter * len(code))(*[_Filter(*ins) for ins in code])
        prog = _Program(len(code), filters)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return f"no_new_privs refused (errno {ctypes.get_errno()})"
        if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
            return f"the kernel refused the filter (errno {ctypes.get_errno()})"
    except (OSError, AttributeError) as e:
        return f"no prctl here ({e})"
    return None
