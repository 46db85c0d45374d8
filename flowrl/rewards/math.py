"""`math_equal` (flowrl.rewards): 1.0 when a response's final answer equals the row's `answer` (or verl's
`ground_truth`), mathematically.

Parsing and equivalence are the `math-verify` package's (what open-r1 and TRL's math rewards use): `\\frac{1}{2}`,
`1/2` and `0.5` are equal, `1,000` is `1000`, LaTeX and plain text compare alike. Which answer is compared is
`flowrl.rewards.math_answers`'s: the gold answer read whole (`(1, 2)` is a pair, not the number 2; `y = 2x + 3`
an equation, `3\\sqrt{2}` a product), and the response's one answer (`\\boxed{...}` first, else the math at
the end of its last line). A response with no answer, or that cannot be parsed, scores 0.0; it never raises.

Grading runs in a warm helper process (`flowrl.rewards.bounded`), never in the caller: a call has a hard limit of
`TIMEOUT_S` seconds on whatever thread it is made (an asynchronous run scores inline rewards on its rollout
thread), after which the helper is killed and the answer scores 0.0. math-verify's own limits (`signal.alarm`,
`SOFT_S`) hold inside the helper too, where they end an ordinary slow parse without a restart; they cannot stop
a C-level computation such as `9^9^9^9`, which only the kill ends. The helper's address space is limited to
`MEMORY_BYTES`, and each call to a CPU budget of `TIMEOUT_S` + 2 s (so a helper whose caller died mid-call,
a reward worker killed at its own `timeout`, still ends). One helper per concurrent caller; the first call waits for its start (importing sympy, ~1-2 s),
which the limit does not count.
"""

from __future__ import annotations

from pathlib import Path

from flowrl.registry import reward
from flowrl.rewards.bounded import Helpers

TIMEOUT_S = 5.0
SOFT_S = 2
MEMORY_BYTES = 4 << 30
ANSWERS = Path(__file__).with_name("math_answers.py")  # what a gold answer and a response's answer are

GRADER = f"""
import importlib.util, json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_BYTES}, {MEMORY_BYTES}))
try:
    import math_verify
except Exception as e:
    print(json.dumps({{"error": f"cannot import math_verify: {{type(e).__name__}}: {{e}}"}}), flush=True)
    raise SystemExit(1)
# the grading rules, by path: the helper imports the standard library and math-verify, never flowrl's packages
spec = importlib.util.spec_from_file_location("math_answers", {str(ANSWERS)!r})
answers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(answers)

def grade(answer, response):
    return answers.grade(answer, response, {SOFT_S})

def cpu_seconds():
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime

print(json.dumps({{"ready": True}}), flush=True)
for line in sys.stdin:
    answer, response = json.loads(line)
    # a CPU budget for this call (SIGXCPU ends the process past it): a helper whose caller died mid-call, and
    # so can no longer kill it, stops on its own
    resource.setrlimit(resource.RLIMIT_CPU, (int(cpu_seconds() + {TIMEOUT_S}) + 2, resource.RLIM_INFINITY))
    try:
        score = grade(answer, response)
    except BaseException:  # a parse or comparison that fails on odd input (a MemoryError too): no answer found
        score = 0.0
    print(json.dumps(score), flush=True)
"""

HELPERS = Helpers(GRADER)


@reward("math_equal")
def math_equal(prompt: str, response: str, answer: object = None, ground_truth: object = None,
               reward_model: object = None, **_: object) -> float:
    """1.0 when the response's final answer equals the row's reference answer (see the module docstring), else
    0.0. The reference is `answer`, else `ground_truth` (what verl's reward functions take), else the
    `ground_truth` of a `reward_model` column (verl's data layout: `reward_model: {"ground_truth": ..., "style":
    "rule"}`), so a verl parquet file is scored with no `columns` mapping."""
    if answer is None:
        answer = ground_truth
    if answer is None and isinstance(reward_model, dict):
        answer = reward_model.get("ground_truth")
    if answer is None or not str(response).strip():
        return 0.0
    score = HELPERS.call([str(answer), str(response)], TIMEOUT_S)
    return 1.0 if score == 1.0 else 0.0
