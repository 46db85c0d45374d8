"""`code_tests` with tests of any shape, verdicted on the tests' side: MBPP-shaped rows whose expected values are
computed (both ways: right solutions 1.0, every forging trick 0), correct answers of the kinds that used to score
0, and the rules of the tests' side (what counts as a check, exceptions, arguments changed in place, iterators,
objects, names), each failure's reason in the reward's notes, and replies that cannot stall the harness."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flowrl.rewards import sandbox
from flowrl.rewards.code import code_tests, grade, run_tests
from flowrl.rewards.graded import Graded

needs_strict = pytest.mark.skipif(not sandbox.isolation().strict, reason=sandbox.isolation().describe())

# ---- MBPP-shaped rows: expected values that are expressions, helpers, loops --------------------------------

RIGHT = """
import math
from collections import Counter
def double(x):
    return x * 2
def rev(s):
    return s[::-1]
def common(a, b):
    return list(set(a) & set(b))
def area(r):
    return math.pi * r * r
def squares(n):
    return [i * i for i in range(1, n + 1)]
def freq(xs):
    return Counter(xs)
def add(a, b):
    return a + b
"""
ROWS = [  # each row's tests, all taking what they compare with from their own side (or the solution's `math`)
    ["assert double(3) == 3*2", "assert all(double(x) == x*2 for x in range(5))", "assert double(512) == 2**10"],
    ["assert rev('abc') == 'abc'[::-1]", "expected = 'olleh'\nassert rev('hello') == expected",
     "assert rev(rev('xy')) == 'xy'"],
    ["assert set(common((1, 4, 5), (4, 5, 6))) == set((4, 5))", "assert sorted(common([1, 2], [2, 1])) == [1, 2]",
     "assert set(common([], [1])) == set()"],
    ["assert math.isclose(area(2), 12.566, rel_tol=0.001)", "assert math.isclose(area(1), math.pi)",
     "assert area(0) < 1e-9 and area(3) > area(2)"],
    ["expected = [1, 4, 9]\nassert squares(3) == expected", "assert squares(0) == []",
     "assert len(squares(10)) == 10 and squares(10)[-1] == 100"],
    ["assert freq([10, 10, 10, 10, 20, 20, 20, 20, 40, 40, 50, 50, 30]) == ({10: 4, 20: 4, 40: 2, 50: 2, 30: 1})",
     "assert freq('aab')['a'] == 2"],
    ["def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n\ncheck(add)",
     "def expected(a, b):\n    return a + b\nfor a in range(-3, 4):\n    for b in range(3):\n"
     "        assert add(a, b) == expected(a, b)"],
]
ALL_TESTS = [t for row in ROWS for t in row]
WRONG = """
import math
def double(x):
    return x + 2
def rev(s):
    return s + "!"
def common(a, b):
    return [4]
def area(r):
    return -1.0
def squares(n):
    return [0]
def freq(xs):
    return {}
def add(a, b):
    return a - b
"""
ALWAYS = "class Eq:\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n" \
         "        return False\n    __hash__ = object.__hash__\n"
FORGING = {
    "wrong": WRONG,
    "always_equal": "import math\n" + ALWAYS + "".join(
        f"def {f}(*args):\n    return Eq()\n" for f in ("double", "rev", "common", "area", "squares", "freq", "add")),
    "int_and_str_subclasses": "import math\nclass I(int):\n    def __eq__(self, other):\n        return True\n"
        "    __hash__ = int.__hash__\nclass S(str):\n    def __eq__(self, other):\n        return True\n"
        "    __hash__ = str.__hash__\n" + "".join(f"def {f}(*args):\n    return {v}\n" for f, v in (
            ("double", "I(0)"), ("rev", "S('')"), ("common", "[I(0)]"), ("area", "I(0)"), ("squares", "[I(0)]"),
            ("freq", "{I(0): I(0)}"), ("add", "I(0)"))),
    "serializer": "import sys\nwire = sys.modules.get('flowrl_wire')\nwire.encode = lambda x, h=None, d=0: "
                  "['bool', True]\n" + WRONG,
    "old_serializer": "import __main__\n__main__.plain = lambda x, depth=0: ['bool', True]\n" + WRONG,
    "reply_channel": "import os, sys\nrunner = sys.modules.get('flowrl_runner')\nrunner.send = lambda fd, obj: "
                     "os.write(fd, b'{\"loaded\": true, \"names\": {}, \"ok\": [\"bool\", true]}\\n')\n" + WRONG,
    "forged_lines": "import os\nfor fd in range(64):\n    try:\n        os.write(fd, b'{\"ok\": [\"bool\", true]}\\n' * 50)"
                    "\n    except OSError:\n        pass\n" + WRONG,
    "frame_reader": "import math, sys\ndef steal(*mine):\n    frame, found = sys._getframe(1), []\n"
                    "    while frame is not None:\n        for v in list(frame.f_locals.values()):\n"
                    "            if isinstance(v, (int, float, str, list)) and v not in mine:\n"
                    "                found.append(v)\n        frame = frame.f_back\n"
                    "    return found[-1] if found else None\n" + "".join(
                        f"def {f}(*args):\n    return steal(*args)\n"
                        for f in ("double", "rev", "common", "area", "squares", "freq", "add")),
    "assert_stripping_compile": "import ast, builtins\n_compile = builtins.compile\n"
        "class Strip(ast.NodeTransformer):\n    def visit_Assert(self, node):\n        return ast.Pass()\n"
        "def compile(source, *args, **kwargs):\n    try:\n"
        "        tree = ast.parse(source) if isinstance(source, str) else source\n"
        "        return _compile(ast.fix_missing_locations(Strip().visit(tree)), *args, **kwargs)\n"
        "    except Exception:\n        return _compile(source, *args, **kwargs)\nbuiltins.compile = compile\n" + WRONG,
    "shadowed_builtins_and_math": WRONG + "math.isclose = lambda *a, **k: True\n" + "".join(
        f"def {f}(*args, **kwargs):\n    return {v}\n" for f, v in (
            ("set", "{4, 5}"), ("all", "True"), ("sorted", "[1, 2]"), ("len", "10"), ("isinstance", "True"))),
    "fake_math_class": WRONG.replace("import math\n", "") + "class math:\n    pi = 0\n"
        "    isclose = staticmethod(lambda *a, **k: True)\n",
    "exits": "import os\n" + "".join(f"def {f}(*args):\n    os._exit(0)\n"
                                     for f in ("double", "rev", "common", "area", "squares", "freq", "add")),
}


def test_mbpp_shaped_rows_with_computed_expected_values_score_one() -> None:
    for row in ROWS:
        assert code_tests("", RIGHT, tests=row) == 1.0, row


@pytest.mark.parametrize("name", list(FORGING))
def test_every_forging_solution_passes_no_test(name: str) -> None:
    found = grade(FORGING[name], ALL_TESTS)
    assert found.passed == (False,) * len(ALL_TESTS), [t for t, ok in zip(ALL_TESTS, found.passed, strict=True) if ok]


# ---- correct answers of the kinds that used to score 0 ----------------------------------------------------

CORRECT = {
    "Counter (MBPP #88's own reference)": (
        "import collections\ndef freq_count(list1):\n    freq_count = collections.Counter(list1)\n"
        "    return freq_count\n",
        ["assert freq_count([10,10,10,10,20,20,20,20,40,40,50,50,30])==({10: 4, 20: 4, 40: 2, 50: 2, 30: 1})"]),
    "defaultdict": ("from collections import defaultdict\ndef group(xs):\n    d = defaultdict(list)\n"
                    "    for x in xs:\n        d[x % 2].append(x)\n    return d\n",
                    ["assert group([1, 2, 3]) == {1: [1, 3], 0: [2]}", "assert group([2])[1] == []"]),
    "namedtuple": ("from collections import namedtuple\nPoint = namedtuple('Point', 'x y')\ndef f():\n"
                   "    return Point(1, 2)\n", ["assert f() == (1, 2)", "assert f().y == 2"]),
    "Fraction": ("from fractions import Fraction\ndef half(x):\n    return Fraction(x, 2)\n",
                 ["assert half(1) == 0.5", "from fractions import Fraction\nassert half(1) == Fraction(1, 2)"]),
    "IntEnum": ("from enum import IntEnum\nclass Color(IntEnum):\n    RED = 1\ndef f():\n    return Color.RED\n",
                ["assert f() == 1"]),
    "dict.keys()": ("def keys(d):\n    return d.keys()\n",
                    ["assert keys({'a': 1}) == {'a'}", "assert list(keys({'a': 1, 'b': 2})) == ['a', 'b']"]),
    "range": ("def r(n):\n    return range(n)\n", ["assert list(r(3)) == [0, 1, 2]", "assert r(3) == range(3)"]),
    "an int of 5,736 digits": ("import math\ndef f(n):\n    return math.factorial(n)\n",
                               ["assert f(2000) == math.factorial(2000)", "assert str(f(2000)).startswith('3316')"]),
    "a dataclass under future annotations": (
        "from __future__ import annotations\nfrom dataclasses import dataclass\n@dataclass\nclass P:\n    x: int\n"
        "    y: int\ndef make():\n    return P(1, 2)\n",
        ["assert make().x == 1", "p = make()\nassert (p.x, p.y) == (1, 2)", "assert isinstance(make(), P)"]),
    "from solution import": ("def add(a, b):\n    return a + b\n",
                             ["from solution import add\nassert add(1, 2) == 3",
                              "import solution\nassert solution.add(2, 2) == 4"]),
    "numpy": ("import numpy as np\ndef total(xs):\n    return np.sum(xs)\ndef arr():\n    return np.array([1, 2])\n",
              ["assert total([1, 2, 3]) == 6", "assert np.array_equal(arr(), [1, 2])"]),
    "multiprocessing.Pool": ("from multiprocessing import Pool\ndef sq(x):\n    return x * x\ndef f(xs):\n"
                             "    with Pool(2) as pool:\n        return pool.map(sq, xs)\n",
                             ["assert f([1, 2, 3]) == [1, 4, 9]"]),
    "pickling its own class": ("import pickle\nclass A:\n    def __init__(self, v):\n        self.v = v\n"
                               "def rt(v):\n    return pickle.loads(pickle.dumps(A(v))).v\n", ["assert rt(3) == 3"]),
    "a program pickling its own class": (
        "import pickle\nclass A:\n    def __init__(self, v):\n        self.v = v\n"
        "print(pickle.loads(pickle.dumps(A(int(input())))).v)\n", [{"input": "3", "output": "3"}]),
    "a program's dataclass under future annotations": (
        "from __future__ import annotations\nfrom dataclasses import dataclass\n@dataclass\nclass P:\n    x: int\n"
        "print(P(int(input())).x)\n", [{"input": "3", "output": "3"}]),
}


@pytest.mark.parametrize("name", list(CORRECT))
def test_a_correct_answer_scores_one(name: str) -> None:
    code, tests = CORRECT[name]
    assert grade(code, tests, timeout=30).reasons == (None,) * len(tests)


# ---- the rules of the tests' side ----------------------------------------------------------------------------

ADD = "def add(a, b):\n    return a + b\n"


def test_a_test_passes_only_on_a_check_made_on_the_tests_side() -> None:
    """An assert that held, or a call answered (by a value or a raise); a test that does neither fails."""
    tests = ["add(1, 2)", "x = 1", "if add(2, 2) != 4:\n    raise ValueError('wrong')",
             "if add(2, 2) != 5:\n    raise ValueError('wrong')", "import pytest\nwith pytest.raises(TypeError):\n"
             "    add(1, 'a')", "assert True", "def helper():\n    assert add(1, 1) == 2\n"]
    found = grade(ADD, tests)
    assert found.passed == (True, False, True, False, True, True, False)
    assert found.reasons == (None, "no_check", None, "raised", None, None, "no_check")


def test_exceptions_reach_the_tests_as_the_same_type() -> None:
    code = ("class Bad(ValueError):\n    pass\ndef f(x):\n    if x < 0:\n        raise ValueError('negative', x)\n"
            "    if x == 0:\n        raise Bad('zero')\n    return {}[x]\n")
    tests = ["import pytest\nwith pytest.raises(ValueError, match='negative'):\n    f(-1)",
             "try:\n    f(-2)\nexcept ValueError as e:\n    assert e.args == ('negative', -2)",
             "try:\n    f(0)\nexcept Bad:\n    pass\nelse:\n    assert False",
             "try:\n    f(0)\nexcept ValueError as e:\n    assert str(e) == 'zero'",
             "try:\n    f(1)\nexcept KeyError as e:\n    assert e.args == (1,)",
             "f(-1)"]
    found = grade(code, tests)
    assert found.passed == (True,) * 5 + (False,) and found.reasons[-1] == "raised"


def test_an_exit_in_a_call_is_no_exception_a_test_can_catch() -> None:
    tests = ["try:\n    f()\nexcept Exception:\n    pass", "import pytest\nwith pytest.raises(Exception):\n    f()"]
    exits = grade("import os\ndef f():\n    os._exit(0)\n", tests)
    assert exits.passed == (False, False) and exits.reasons == ("solution_ended", "solution_ended")
    assert run_tests("import sys\ndef f():\n    sys.exit(3)\n", ["try:\n    f()\nexcept SystemExit as e:\n"
                                                                 "    assert e.code == 3"]) == [True]


def test_arguments_changed_in_place_are_seen_by_the_tests() -> None:
    code = ("def sort_in_place(xs):\n    xs.sort()\ndef fill(d):\n    d['k'] = [1]\ndef inner(rows):\n"
            "    rows[0].append(9)\ndef keep(xs):\n    return len(xs)\n")
    tests = ["xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]",
             "d = {}\nfill(d)\nassert d == {'k': [1]}",
             "rows = [[1], [2]]\ninner(rows)\nassert rows == [[1, 9], [2]]",
             "t = ([3, 1],)\nsort_in_place(t[0])\nassert t == ([1, 3],)",
             "xs = [1]\nassert keep(xs) == 1 and xs == [1]",
             "xs = [2, 1]\nsort_in_place(xs=xs)\nassert xs == [1, 2]"]
    assert run_tests(code, tests) == [True] * 6


def test_iterators_are_read_as_the_tests_need_them() -> None:
    code = ("def squares(n):\n    for i in range(n):\n        yield i * i\ndef count():\n    i = 0\n"
            "    while True:\n        yield i\n        i += 1\ndef breaks():\n    yield 1\n    raise KeyError('two')\n"
            "def pairs():\n    return zip('ab', [1, 2])\n")
    tests = ["assert list(squares(4)) == [0, 1, 4, 9]",
             "import itertools\nassert list(itertools.islice(count(), 5)) == [0, 1, 2, 3, 4]",  # never ends there
             "g = breaks()\nassert next(g) == 1\ntry:\n    next(g)\nexcept KeyError:\n    pass\nelse:\n    assert False",
             "assert squares(3) != [0, 1, 4]",  # a generator is not a list, as in Python
             "assert 9 in squares(5) and dict(pairs()) == {'a': 1, 'b': 2}",
             "assert sum(squares(10_000)) == sum(i * i for i in range(10_000))"]
    assert run_tests(code, tests) == [True] * 6


def test_objects_of_the_solutions_classes_are_used_through_handles() -> None:
    code = ("from dataclasses import dataclass\nclass Stack:\n    def __init__(self):\n        self.items = []\n"
            "    def push(self, x):\n        self.items.append(x)\n        return self\n"
            "    def pop(self):\n        return self.items.pop()\n    def __len__(self):\n"
            "        return len(self.items)\n    def __repr__(self):\n        return f'Stack({self.items})'\n"
            "@dataclass\nclass P:\n    x: int\ndef make(x):\n    return P(x)\ndef apply(fn, x):\n    return fn(x)\n")
    tests = ["s = Stack()\ns.push(1).push(2)\nassert s.pop() == 2 and len(s) == 1 and s.items == [1]",
             "s = Stack()\nassert repr(s.push(3)) == 'Stack([3])' and isinstance(s, Stack) and not isinstance(3, Stack)",
             "s = Stack()\nassert s == s and Stack() != Stack()",  # compared by identity, as `object` does
             "assert make(1).x == 1",
             "assert make(1) == P(1)",  # its own __eq__ would decide: refused
             "assert apply(lambda x: x, 1) == 1"]  # a function of the tests' cannot be sent
    found = grade(code, tests)
    assert found.passed == (True, True, True, True, False, False)
    assert found.reasons[4:] == ("no_plain_form", "no_plain_form")


def test_the_tests_builtins_and_modules_are_their_own() -> None:
    code = ("import math\ndef sorted(xs):\n    return [0]\ndef f(x):\n    return x\nclass re:\n    match = None\n"
            "import numpy as np\nnp = None\n")
    tests = ["assert sorted([2, 1]) == [1, 2]", "assert math.sqrt(f(4)) == 2", "assert re.match('a', 'a')",
             "assert np.array([f(1)]).sum() == 1", "from solution import sorted\nassert sorted([2, 1]) == [0]",
             "from solution import *\nassert sorted([2, 1]) == [1, 2] and f(3) == 3"]
    assert run_tests(code, tests) == [True] * 6


def test_a_stop_iteration_from_a_call_cannot_end_a_tests_loop_early() -> None:
    """In Python `all(map(f, xs))` is True when f raises StopIteration at once: arriving as RuntimeError, it fails."""
    code = "def ok(x):\n    raise StopIteration\ndef count():\n    yield 1\n"
    found = grade(code, ["assert all(map(ok, [1, 2]))", "assert list(count()) == [1]"])
    assert found.reasons == ("raised", None)


def test_each_failure_is_counted_by_its_reason_in_the_rewards_notes() -> None:
    code = "class Opaque:\n    def __eq__(self, other):\n        return True\n" + ADD + \
           "def opaque():\n    return Opaque()\n"
    tests = ["assert add(1, 1) == 2", "assert add(1, 1) == 3", "assert opaque() == 1", "x = 1", "assert (",
             {"input": "1", "output": "1"}, 5]
    score = code_tests("", code, tests=tests)
    assert isinstance(score, Graded) and score == pytest.approx(1 / 7)
    assert score.notes == {"failed/assert": 1, "failed/no_plain_form": 1, "failed/no_check": 1,
                           "failed/bad_test": 2, "failed/wrong_output": 1}


# ---- replies and tests that could stall the harness --------------------------------------------------------

FLOOD = ("import sys\ndef f():\n    return 1\nwire = sys.modules['flowrl_wire']\n_encode = wire.encode\n"
         "FLOOD = ['set', [['int', format(i * (2**61 - 1), 'x')] for i in range(50_000)]]\n"  # one hash: quadratic
         "wire.encode = lambda x, h=None, d=0: FLOOD if x == 1 else _encode(x, h, d)\ndef g():\n    return 2\n")


def test_a_hash_flooding_reply_fails_its_test_and_the_row_goes_on() -> None:
    """50,000 distinct ints on one hash (25.8 s to build as a set, issue 34): refused, not waited out."""
    found = grade(FLOOD, ["assert len(f()) == 50_000", "assert g() == 2"], timeout=60)
    assert found.reasons == ("bad_reply", None)


def test_a_reply_past_the_limit_fails_its_test_and_the_row_goes_on() -> None:
    big = "def f():\n    return 'x' * (9 << 20)\ndef g():\n    return 2\n"
    assert grade(big, ["assert len(f()) > 0", "assert g() == 2"], timeout=60).reasons == ("bad_reply", None)


def test_a_test_that_never_ends_is_stopped_at_the_rows_deadline() -> None:
    never = "import threading\nthreading.Event().wait()"  # waits without end (and without a CPU, at no one's cost)
    found = grade(ADD, ["assert add(1, 1) == 2", never, "assert add(1, 2) == 3"], timeout=5)
    assert found.reasons == (None, "timeout", "timeout")
    assert run_tests(ADD, ["assert add(2, 2) == 4"]) == [True]  # the tests' process serves the next row


def test_the_tests_process_leaves_no_zombie_behind() -> None:
    """Every row's child is reaped, the ones killed at their row's end too: kept as zombies, they counted against
    the tests' process's limit of processes until no row could start (seen after ~1,000 HumanEval rows)."""
    import psutil

    from flowrl.rewards.sessions import TestsSide

    for _ in range(3):  # a row's child still running at the deadline: killed then, reaped with a later message
        assert grade(ADD, ["import threading\nthreading.Event().wait()"], timeout=1).reasons == ("timeout",)
    for _ in range(5):
        assert run_tests(ADD, ["assert add(1, 1) == 2"]) == [True]
    side = TestsSide._shared
    assert side is not None
    kept = 0
    for proc in psutil.Process(side.jailed.proc.pid).children(recursive=True):
        try:
            kept += proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:  # reaped since the listing
            pass
    assert kept <= 1  # the last row's, reaped when the next row comes


@needs_strict
def test_system_v_ipc_made_inside_does_not_outlive_the_jail() -> None:
    key = 0x5EED0000 + os.getpid() % 4096
    shm = f"import ctypes\nSEGMENT = ctypes.CDLL(None).shmget({key}, 1 << 20, 0o1600)\n"
    assert run_tests(shm, ["assert SEGMENT >= 0"]) == [True]  # made, inside
    keys = [int(line.split()[0]) for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]]
    assert key not in keys
