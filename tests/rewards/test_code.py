"""`code_tests`: partial credit by tests passed, and hostile code contained (loops, forks, floods of output, files
outside its directory, the network)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from flowrl.rewards.code import code_tests, extract_code, jail, run_tests

ADD = "def add(a, b):\n    return a + b\n"
TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]
AS_ROOT = os.geteuid() == 0


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


def test_an_infinite_loop_is_stopped_and_the_tests_before_it_count() -> None:
    hangs = ADD + "def spin():\n    while True:\n        pass\n"
    assert run_tests(hangs, ["assert add(1, 1) == 2", "spin()", "assert add(2, 2) == 4"], timeout=1.0) == \
        [True, False, False]


@pytest.mark.skipif(not AS_ROOT, reason="RLIMIT_NPROC binds only an unprivileged user: as root the sandbox is nobody")
def test_a_fork_bomb_is_contained() -> None:
    bomb = ("import os\npids = []\nfor _ in range(200):\n    try:\n        pids.append(os.fork())\n"
            "    except OSError:\n        break\n    if pids[-1] == 0:\n        import time; time.sleep(30); os._exit(0)\n"
            "FORKED = len(pids)\n")
    assert run_tests(bomb, ["assert FORKED < 20"], timeout=3.0) == [True]  # RLIMIT_NPROC stopped it early


def test_a_flood_of_output_costs_the_parent_nothing() -> None:
    flood = "import sys\nfor _ in range(10**6):\n    sys.stdout.write('x' * 1000)\nDONE = True\n"
    # a gigabyte of output goes nowhere: the solution runs on to its tests, the parent holds none of it
    assert run_tests(flood + ADD, ["assert DONE", "assert add(1, 2) == 3"], timeout=60.0) == [True, True]


@pytest.mark.skipif(not AS_ROOT, reason="file isolation needs the sandbox to run as its own user (root drops to nobody)")
def test_a_private_file_outside_its_directory_cannot_be_read() -> None:
    assert jail()[0] == "unshare"
    with tempfile.TemporaryDirectory() as other:
        secret = Path(other) / "secret.txt"
        secret.write_text("s3cret")
        os.chmod(other, 0o700)
        reads = f"try:\n    LEAK = open({str(secret)!r}).read()\nexcept OSError:\n    LEAK = None\n"
        assert run_tests(reads, ["assert LEAK is None"]) == [True]
        assert run_tests("import os\nHOME = os.listdir('/root')\n", ["assert HOME"]) == [False]


def test_the_network_is_off() -> None:
    net = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\n    REACHED = True\n"
           "except OSError:\n    REACHED = False\n")
    assert run_tests(net, ["assert REACHED is False"]) == [True]


def test_its_working_directory_is_fresh_and_removed(tmp_path: Path) -> None:
    before = set(Path(tempfile.gettempdir()).glob("flowrl-code-*"))
    writes = "import os\nopen('out.txt', 'w').write('x')\nHERE = os.getcwd()\nFILES = sorted(os.listdir('.'))\n"
    assert run_tests(writes, ["assert FILES == ['out.txt', 'task.json']", "assert 'flowrl-code-' in HERE"]) == \
        [True, True]
    assert set(Path(tempfile.gettempdir()).glob("flowrl-code-*")) == before


def test_memory_is_limited() -> None:
    """4 GiB (this machine has far more) fails under the 1 GiB address-space limit: the code does not load."""
    assert run_tests("BIG = bytearray(4 * 2**30)\n", ["assert len(BIG) > 0"]) == [False]
    assert run_tests("SMALL = bytearray(2**20)\n", ["assert len(SMALL) > 0"]) == [True]
