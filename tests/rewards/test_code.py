"""`code_tests`: partial credit by tests passed, both test forms, and hostile solutions scoring 0 (forged results
on every descriptor, always-equal objects, patched builtins and harness, early exits, killing the parent,
reading the harness's files, fork bombs, floods of output, the network)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest

from flowrl.rewards import sandbox
from flowrl.rewards.code import code_tests, extract_code, plan, run_tests

ADD = "def add(a, b):\n    return a + b\n"
TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]
DOUBLE = "n = int(input())\nprint(n * 2)\n"
IO = [{"input": "3\n", "output": "6\n"}, {"input": "21", "output": "42"}]
STRICT = sandbox.isolation().strict
needs_strict = pytest.mark.skipif(not STRICT, reason=sandbox.isolation().describe())


def test_a_correct_solution_passes_every_test() -> None:
    assert code_tests("add two numbers", f"Here it is:\n```python\n{ADD}```\n", tests=TESTS) == 1.0


def test_partial_credit_counts_the_tests_passed() -> None:
    wrong_for_strings = "def add(a, b):\n    return int(a) + int(b)\n"
    assert code_tests("", wrong_for_strings, tests=TESTS) == pytest.approx(2 / 3)


def test_code_that_does_not_load_scores_zero() -> None:
    assert code_tests("", "def add(a, b) return a + b", tests=TESTS) == 0.0
    assert code_tests("", ADD, tests=[]) == 0.0


def test_the_last_fenced_block_is_the_code() -> None:
    assert extract_code("```python\nx = 1\n```\nthen\n```py\nx = 2\n```") == "x = 2\n"
    assert extract_code("x = 3") == "x = 3"


def test_asserts_are_decided_here_as_python_would() -> None:
    tests = ["x = add(1, 2)\nassert x == 3 and x > 2", "assert not add(1, -1)", "assert 0 < add(1, 1) <= 2",
             "assert add(1, 1) in (2, 3)", "assert add(None, None) is None or True", "assert add(1, 1) == 3",
             "assert add(1, 1) < 'a'", "assert add([1], [2]) == [1, 2]", "assert add(1, 2)"]
    nones = "def add(a, b):\n    return None if a is None else a + b\n"
    assert run_tests(nones, tests) == [True, True, True, True, True, False, False, True, True]


SPY = """
import sys
runner = sys.modules.get("flowrl_runner")
SEEN = []
_answer = runner.answer
def answer(req, table):  # the runner's own request handler, wrapped: everything the solution's side is sent
    SEEN.append(repr(req))
    return _answer(req, table)
runner.answer = answer
def add(a, b):
    return a + b
def seen():
    return "\\n".join(SEEN)
"""


def test_the_tests_and_expected_values_never_reach_the_solution() -> None:
    """The solution's process is sent calls (the name, the arguments) and nothing else: not a test's source, not an
    expected value (ints travel in hex: 5 is '5', 42 is '2a')."""
    assert plan("assert add(2, 3) == 5") == "assert add(2, 3) == 5"  # code stays code: it runs on the tests' side
    assert plan({"input": "1 2", "output": "3"}) is not None and plan({"input": 1}) is None and plan(3) is None
    log = "log = seen()\nassert \"'add'\" in log and \"'5'\" not in log and \"'2a'\" not in log " \
          "and 'assert' not in log and '==' not in log"
    assert run_tests(SPY, ["assert add(2, 3) == 5", "assert add(40, 2) == 42", log]) == [True, True, True]


def test_stdin_stdout_tests_compare_output_token_by_token() -> None:
    assert run_tests(DOUBLE, [*IO, {"input": "4", "output": "  8 \n\n"}, {"input": "4", "output": "9"}]) == \
        [True, True, True, False]
    fast_io = "import sys\ndata = sys.stdin.buffer.read().split()\nsys.stdout.write(str(sum(map(int, data))))\nexit()\n"
    assert run_tests(fast_io, [{"input": "1 2\n3", "output": "6"}]) == [True]
    crashes_after = "print(int(input()) * 2)\nraise SystemExit(3)\n"
    assert run_tests(crashes_after, IO) == [False, False]  # the right output, then a non-zero status


def test_both_forms_in_one_row() -> None:
    code = ADD + "if __name__ == '__main__':\n    print(add(*map(int, input().split())))\n"
    assert code_tests("", code, tests=["assert add(1, 2) == 3", {"input": "2 2", "output": "4"}]) == 1.0


def test_five_hundred_tests_in_one_row_all_count() -> None:
    many = [f"assert add({i}, 1) == {i + 1}" for i in range(500)]
    assert code_tests("", ADD, tests=many) == 1.0  # within the default limit: ~0.3 s here (bench/rewards.py)
    echo = [{"input": str(i), "output": str(i + 1)} for i in range(500)]
    # a program per test (a fork each, 2-8 ms here under load): a limit that a slow machine also meets
    assert run_tests("print(int(input()) + 1)\n", echo, timeout=60.0) == [True] * 500


# ---- hostile solutions: each scores 0 ----------------------------------------------------------------------

FORGE = ("import os\nfor fd in range(21):\n    try:\n"
         "        os.write(fd, b'[true, true, true]\\n{\"loaded\": true}\\n{\"values\": [], \"error\": null}\\n')\n"
         "    except OSError:\n        pass\n")


@pytest.mark.parametrize("ending", ["", "os._exit(0)\n", "raise SystemExit(0)\n"])
def test_forged_results_written_to_every_descriptor_pass_nothing(ending: str) -> None:
    assert code_tests("", FORGE + ending, tests=TESTS) == 0.0
    assert code_tests("", FORGE + ending, tests=IO) == 0.0


def test_a_reply_made_to_break_the_harness_scores_zero_and_raises_nothing() -> None:
    deep = ("import os\nfor fd in range(3, 21):\n    try:\n"
            "        os.write(fd, b'[' * 100000 + b']' * 100000 + b'\\n')\n    except OSError:\n        pass\n")
    assert code_tests("", deep + ADD, tests=TESTS) == 0.0  # its first answer was the forged line: the rest fail
    huge = "import os\nfor fd in range(3, 21):\n    try:\n        os.write(fd, b'1' * (64 << 20))\n" \
           "    except OSError:\n        pass\n"
    assert code_tests("", huge + ADD, tests=TESTS) == 0.0  # a reply past REPLY_BYTES ends the session


def test_an_always_equal_object_passes_nothing() -> None:
    always = ("class Eq:\n    def __eq__(self, other):\n        return True\n    __ne__ = lambda s, o: False\n"
              "    __hash__ = object.__hash__\n"
              "class Int(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
              "def add(a, b):\n    return Eq() if isinstance(a, int) else Int(0)\n")
    assert code_tests("", always, tests=[*TESTS, "assert add(1, 1) in [2]", "assert [add(1, 1)] == [2]"]) == 0.0


@pytest.mark.parametrize("patch", [
    "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\n__builtins__['print'] = None\n",
    "import __main__\n__main__.plain = lambda x, depth=0: ['bool', True]\n",  # the runner's own serializer
    "import __main__\n__main__.send = lambda fd, obj: __main__.os.write(fd, b'{\"values\": [], \"error\": null}\\n')\n",
    "import builtins\nbuiltins.eval = lambda *a: True\nbuiltins.exec = lambda *a: None\n",
    "import sys\nsys.exit(0)\n",
    "import os\nos._exit(0)\n",
    "import atexit, os\natexit.register(lambda: os.write(1, b'{\"values\": [[\"int\", \"5\"]], \"error\": null}\\n'))\n",
])
def test_patching_builtins_or_the_harness_or_exiting_passes_nothing(patch: str) -> None:
    wrong = "def add(a, b):\n    return -7\n"
    assert code_tests("", patch + wrong, tests=TESTS) == 0.0


@needs_strict  # unjailed, it could kill this process: the one thing a test cannot survive to report
def test_killing_the_parent_fails_and_harms_no_one() -> None:
    kills = (f"import os, signal\nfor pid in (os.getppid(), {os.getpid()}, -1, 0):\n    try:\n"
             "        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n")
    assert code_tests("", kills + "def add(a, b):\n    return -7\n", tests=TESTS) == 0.0
    assert code_tests("", kills + ADD, tests=TESTS) in (0.0, 1.0)  # jailed it may live on; unjailed it dies
    assert code_tests("", ADD, tests=TESTS) == 1.0  # and this process, named by pid above, is alive


@needs_strict
def test_the_harness_files_and_processes_are_out_of_sight(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"  # world-readable, as data sets are
    data.write_text(json.dumps({"prompt": "p", "tests": [{"input": "", "output": "s3cret-42"}]}) + "\n")
    snoop = ("import os\nfound = ''\n"
             f"for path in [{str(data)!r}, '/proc/1/environ', '/etc/passwd', os.path.expanduser('~/.bashrc')]:\n"
             "    try:\n        found += open(path).read()\n    except OSError:\n        pass\n"
             "for pid in os.listdir('/proc'):\n    if pid.isdigit():\n        try:\n"
             "            found += open(f'/proc/{pid}/cmdline').read()\n        except OSError:\n            pass\n"
             "print('s3cret-42' if 's3cret-42' in found else found)\n")
    assert run_tests(snoop, [{"input": "", "output": "s3cret-42"}]) == [False]
    listing = "import os\ndef ls(path):\n    return sorted(os.listdir(path))\n" \
              "PIDS = [p for p in os.listdir('/proc') if p.isdigit()]\n"
    root = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "dev", "proc", "tmp", "usr"}
    shown: dict[str, set[str]] = {"/": set()}  # the interpreter's folders, and each folder on the way to them
    for mount in (sandbox.isolation().python or sandbox.interpreter()).mounts:
        parts = Path(mount).parts
        for depth in range(1, len(parts)):
            shown.setdefault(str(Path(*parts[:depth])), set()).add(parts[depth])
    shown["/tmp"] = shown.get("/tmp", set()) | {"work"}  # the solution's empty working directory, and a mount point
    # on the way to the interpreter's folders when they are under /tmp
    assert run_tests(listing, [f"assert set(ls('/')) <= {root | shown['/']} and 'usr' in ls('/')",
                               "assert PIDS == ['1']",
                               *[f"assert ls({folder!r}) == {sorted(names)}" for folder, names in shown.items()
                                 if folder != "/"]]) == [True] * (len(shown) + 1)
    # /usr and what the host serves from it, and the interpreter's own folders: no /etc, /home, no other file of
    # /root or /work (the data set and the flow), nothing beside the folders on the way to the interpreter


@needs_strict
def test_a_fork_bomb_is_bounded_and_scores_zero() -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n" + ADD
    assert run_tests(bomb, TESTS, timeout=2.0) == [False, False, False]  # returned: the deadline holds
    counted = ("import os\npids = []\nfor _ in range(200):\n    try:\n        pids.append(os.fork())\n"
               "    except OSError:\n        break\n    if pids[-1] == 0:\n        import time; time.sleep(30); os._exit(0)\n"
               "FORKED = len(pids)\n")
    assert run_tests(counted, ["assert FORKED < 20"], timeout=30.0) == [True]  # RLIMIT_NPROC stopped it early


TRACER = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def trace_me():  # PTRACE_TRACEME: allowed to any process the kernel does not filter
    return libc.ptrace(0, 0, 0, 0), ctypes.get_errno()
def read_memory():  # process_vm_readv, here of itself: the call that reads another process's memory
    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
    into, source = ctypes.create_string_buffer(8), ctypes.create_string_buffer(b"1234567")
    mine, theirs = IoVec(ctypes.addressof(into), 8), IoVec(ctypes.addressof(source), 8)
    return libc.process_vm_readv(os.getpid(), ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0), ctypes.get_errno()
"""


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="the filter is written for these")
@pytest.mark.parametrize("isolated", [True, False])
def test_ptrace_and_other_processes_memory_are_refused(isolated: bool, request: pytest.FixtureRequest) -> None:
    """The seccomp filter (flowrl.rewards.syscalls), jailed or not: where no namespace hides the harness, it is
    what keeps a solution from tracing it."""
    if isolated and not STRICT:
        pytest.skip(sandbox.isolation().describe())
    if not isolated:
        request.getfixturevalue("degraded")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sandbox.SandboxWarning)  # said once, tested below
        found = run_tests(TRACER, ["assert trace_me() == (-1, 1)", "assert read_memory() == (-1, 1)"])
    assert found == [True, True]


def test_huge_output_is_bounded() -> None:
    endless = "while True:\n    print('x' * 10000)\n"
    assert run_tests(endless, IO) == [False, False]  # cut at OUTPUT_BYTES each, the row still answered
    flood = "import sys\nfor _ in range(10**5):\n    sys.stdout.write('x' * 1000)\nDONE = True\n"
    # in the snippet form its output goes nowhere: the solution runs on to its tests
    assert run_tests(flood + ADD, ["assert DONE", "assert add(1, 2) == 3"], timeout=60.0) == [True, True]


def test_an_infinite_loop_is_stopped_and_the_tests_before_it_count() -> None:
    hangs = ADD + "def spin():\n    while True:\n        pass\n"
    assert run_tests(hangs, ["assert add(1, 1) == 2", "spin()", "assert add(2, 2) == 4"], timeout=3.0) == \
        [True, False, False]


def test_the_network_is_off() -> None:
    net = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\n    REACHED = True\n"
           "except OSError:\n    REACHED = False\n")
    assert run_tests(net, ["assert REACHED is False"]) == [True]


def test_its_working_directory_is_fresh_and_removed() -> None:
    before = set(Path(tempfile.gettempdir()).glob("flowrl-code-*"))
    writes = "import os\nopen('out.txt', 'w').write('x')\nFILES = sorted(os.listdir('.'))\n"
    assert run_tests(writes, ["assert FILES == ['out.txt']"]) == [True]
    assert set(Path(tempfile.gettempdir()).glob("flowrl-code-*")) == before


def test_memory_is_limited() -> None:
    """4 GiB (this machine has far more) fails under the 1 GiB address-space limit: the code does not load."""
    assert run_tests("BIG = bytearray(4 * 2**30)\n", ["assert len(BIG) > 0"]) == [False]
    assert run_tests("SMALL = bytearray(2**20)\n", ["assert len(SMALL) > 0"]) == [True]


# ---- where strict isolation is missing ---------------------------------------------------------------------


@pytest.fixture
def degraded(monkeypatch: pytest.MonkeyPatch) -> sandbox.Isolation:
    """This process as if the machine allowed no namespaces: sessions really run unjailed, as the caller."""
    found = sandbox.Isolation(False, ("root (running as uid 1000: namespaces and a user of its own need it)",))
    monkeypatch.setattr(sandbox, "_FOUND", [found])
    monkeypatch.setattr(sandbox, "_WARNED", [])
    return found


def test_without_isolation_it_warns_once_saying_what_is_missing(degraded: sandbox.Isolation) -> None:
    with pytest.warns(sandbox.SandboxWarning, match=r"WITHOUT isolation.*Missing: root \(running as uid 1000"):
        assert code_tests("", ADD, tests=TESTS) == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert code_tests("", FORGE, tests=TESTS) == 0.0  # no second warning; verdicts are still made here


def test_strict_refuses_without_isolation(degraded: sandbox.Isolation) -> None:
    with pytest.raises(sandbox.SandboxError, match="Missing: root"):
        sandbox.require_strict()


@needs_strict
def test_strict_is_available_here() -> None:
    sandbox.require_strict()
    assert sandbox.isolation().describe().startswith("strict: namespaces")


def test_the_jailed_programs_fit_in_one_argument() -> None:
    """They travel as `python -c PROGRAM`: one argument holds at most 128 KiB (MAX_ARG_STRLEN)."""
    from flowrl.rewards.sessions import CHECKER, RUNNER

    assert max(len(p.text(same).encode()) for p in (RUNNER, CHECKER) for same in (True, False)) < 128 * 1024


@needs_strict
@pytest.mark.skipif(not os.path.exists(sandbox.SYSTEM.executable), reason="no system Python")
def test_the_systems_python_serves_where_this_ones_cannot_be_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback of a caller who cannot read this interpreter's folders: the modules travel as source."""
    from flowrl.rewards.sessions import TestsSide

    found = sandbox.isolation()
    monkeypatch.setattr(sandbox, "_FOUND", [sandbox.Isolation(True, way=found.way, python=sandbox.SYSTEM)])
    monkeypatch.setattr(TestsSide, "_shared", None)  # a tests' process of its own, on that Python, for this test
    try:
        assert run_tests(ADD + "import sys\nEXE = sys.executable\n",
                         [*TESTS, f"assert EXE == {sandbox.SYSTEM.executable!r}", {"input": "", "output": ""}]) == \
            [True] * 5
    finally:
        if TestsSide._shared is not None:
            TestsSide._shared.close()


NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
AS_NOBODY = """
import json, sys
from flowrl.rewards import sandbox
from flowrl.rewards.code import run_tests
found = sandbox.isolation()
out = {"describe": found.describe()}
if found.strict:
    data = sys.argv[1]
    snoop = f"try:\\n    print(open({data!r}).read())\\nexcept OSError:\\n    print('none')\\n"
    out["snoop"] = run_tests(snoop, [{"input": "", "output": open(data).read()}])
    out["seen"] = run_tests("import os\\nPIDS = [p for p in os.listdir('/proc') if p.isdigit()]\\n",
                            ["assert PIDS == ['1']"])
    out["bomb"] = run_tests("import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n"
                            "        pass\\n", ["assert True"], timeout=2.0)
    out["add"] = run_tests("def add(a, b):\\n    return a + b\\n", ["assert add(2, 3) == 5"])
print(json.dumps(out))
"""


@needs_strict
def test_an_unprivileged_caller_is_jailed_in_a_user_namespace_or_told_why_not() -> None:
    """Run as another user (no root): where the kernel allows user namespaces the jail is as strict (a file
    that user can read is out of the solution's sight, no other process, a fork bomb bounded); where it does
    not, isolation says what is missing."""
    import subprocess
    import sys

    folder = Path(tempfile.mkdtemp(prefix="flowrl-visible-"))
    try:
        folder.chmod(0o755)
        data = folder / "data.jsonl"
        data.write_text("s3cret-42")
        data.chmod(0o644)
        visible = subprocess.run([*NOBODY, "cat", str(data)], capture_output=True, text=True, timeout=60)
        assert visible.stdout == "s3cret-42"  # outside the jail, this user can read it
        run = subprocess.run([*NOBODY, sys.executable, "-c", AS_NOBODY, str(data)], capture_output=True, text=True,
                             cwd=Path(__file__).parents[2], timeout=300)
    finally:
        shutil.rmtree(folder)
    if run.returncode != 0:
        pytest.skip(f"this interpreter is not usable by nobody: {run.stderr.strip()[-200:]}")
    out = json.loads(run.stdout.splitlines()[-1])
    if not out["describe"].startswith("strict"):
        assert "Missing: root (running as uid 65534); unprivileged user namespaces: " in out["describe"]
        return
    assert out["describe"] in (  # its own Python where that user can read it, else the system's
        "strict: namespaces (mount, network, PID, IPC), a user namespace of its own, a root holding /usr and "
        "Python only", "strict: namespaces (mount, network, PID, IPC), a user namespace of its own, a root holding "
        "/usr only (the system's Python: this one's folders could not be bound, so its packages are missing)")
    assert out == {**out, "snoop": [False], "seen": [True], "bomb": [False], "add": [True]}


def test_the_root_is_put_together_where_no_bound_folder_is() -> None:
    """A virtual environment under /tmp (a clone in /tmp/check): the jail's root is not staged over /tmp, which
    would hide the packages being bound (before, numpy and pytest were missing in the jail, and its probe passed)."""
    assert sandbox.staging(["/usr", "/dev", "/proc", "/work/x/.venv/lib/python3.11/site-packages"]) == "/tmp"
    assert sandbox.staging(["/usr", "/tmp/check/.venv/lib/python3.11/site-packages"]) not in ("/tmp", "/usr")
    assert run_tests("import numpy\nX = numpy.arange(3).sum()\n", ["import pytest\nassert X == 3"]) == [True]
