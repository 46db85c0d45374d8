"""The calculator of examples/calc_tool.flow: the tool (`calc`), its reward (`final_answer`) and the grading they
share; examples/calc_notool.flow scores the same model without the tool with the same reward.

The task: a prompt `13*7=` (a 2-digit and a 1-digit number, either order, whose product has 2 digits: 212
prompts). A 2-layer character model trained from scratch does not learn these products in a few minutes: it has
to memorise 212 answers from a reward alone. With the tool it only has to call it and copy what comes back. A
trajectory that learned reads

    13*7=   ()    91;91;91;    91
    prompt  call  observation  final answer (the text after the last observation)

The call is `(` ... `)` (the flow's `call` and `end` markers); the tool answers with the product and a `;`, `REPEAT`
times: the `;` closes the observation, so the reward can find where the final answer starts, and the repetition is
half of what made the copy learnable in minutes (bench/RESULTS_multiturn.md: shown once, the policy learnt the call
and one digit, 0.44-0.58; shown three times, with 32 x 16 samples and 2 epochs a step, 0.90). Every answer digit
then stands two places before the one the policy writes (`...91;` -> `9`, `...1;9` -> `1`) and three times in the
context, against the prompt's operand digits, which say nothing certain about the product.

The tool reads the question from the row (its `question` column), not from the call's arguments: what is learnt is
*when* to call and to copy the answer, not to copy the question into the call (copying five more characters exactly,
with a reward that only sees the final answer, does not learn in the examples' five-minute budget), so the call's
arguments are accepted and ignored. The reward adds `CALL_BONUS` for a real call, one whose observation came back
(capped at 1): without it the policy stops calling the tool before it has learnt to use it (see `final_answer`).
"""

from __future__ import annotations

import re

__all__ = ["CALL", "CALL_BONUS", "END_OBS", "REPEAT", "calc", "evaluate", "final_answer", "grade", "observed_call"]

CALL = "("  # the flow's `call` marker
END_OBS = ";"  # closes every observation (and each of its `REPEAT` answers)
CALL_BONUS = 0.2  # reward for having called the tool (see `final_answer`)
REPEAT = 3  # how many times an observation shows the answer (see above)
# Bounded ASCII operands: no 10**10**10 from a policy, and no "٣" (a digit to \d and int()).
_EXPR = re.compile(r"^\s*([0-9]{1,12})\s*([*+-])\s*([0-9]{1,12})\s*$")


def evaluate(expr: str) -> int | None:
    """`a*b`, `a+b` or `a-b` on non-negative integers, or None for anything else (no eval of policy text)."""
    m = _EXPR.match(expr)
    if m is None:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return a * b if op == "*" else a + b if op == "+" else a - b


def calc(args: str, question: str = "", **_: object) -> str:
    """The tool: the value of the row's `question` (`13*7`; `args`, the call's text, is ignored, see above)
    followed by `END_OBS`, `REPEAT` times (`91;91;91;`); `?;?;?;` when the row holds no question it can compute."""
    value = evaluate(question)
    return f"{'?' if value is None else value}{END_OBS}" * REPEAT


def grade(answer_text: str, answer: object) -> float:
    """1.0 for the exact answer; else 0.8 x the fraction of the answer's digits in their right place (counted from
    the left): 0.4 for one digit of two. The partial credit lets a randomly initialised policy find the copy one
    digit at a time (an exact copy by chance is about 1 in 400); a mean reward of 0.8 still needs most answers
    exact."""
    target = str(answer).strip()
    got = answer_text.strip()
    if not target or not got:
        return 0.0
    if got == target:
        return 1.0
    same = sum(a == b for a, b in zip(got, target, strict=False))
    return 0.8 * min(same, len(target) - 1) / len(target)


def observed_call(response: str, question: str = "") -> tuple[bool, str]:
    """Whether `response` holds a real tool call, and its final answer.

    A real call is a call marker `(` followed (after the call's arguments) by the tool's own observation for this
    row, `calc(question=question)`: text only the tool writes here, since the policy's turns are 2 tokens and the
    observation 9 characters, and writing it would take the answer itself. The final answer is the text after
    the last such observation, or the whole response when there is none: a `;` the policy writes is part of its
    answer, never the end of an observation (`;9` is the answer `;9`, no call).
    """
    shown = calc("", question=question)
    at = response.rfind(shown)
    if at < 0 or CALL not in response[:at]:
        return False, response
    return True, response[at + len(shown):]


def final_answer(prompt: str, response: str, answer: object = None, question: str = "", **_: object) -> float:
    """The reward: `grade` of the final answer (`observed_call`: the text after the tool's observation, the whole
    response without a real call, as in examples/calc_notool.flow), plus `CALL_BONUS` for a real call followed by
    an answer (calling again instead of answering leaves nothing after the last observation: no bonus), at most 1.

    Why the bonus: at first a call is rare (~8% of trajectories) and its answer is as random as a direct one, while
    a direct answer's partial credit comes a turn sooner; without it the policy stopped calling the tool within 15
    steps (tool calls 0.08 -> 0.01), the collapse verl #1569 reports (where a +0.1 call reward mended it). An exact
    answer scores 1 with or without the call, so the bonus never makes a wrong answer beat a right one; a bonus for
    any call was taken by calling in every turn (tool calls 1.2 of 2 turns, reward stuck at the bonus), and a bonus
    for any `;` (the observation's end) by writing `;` without calling: the no-tool flow's policy learnt `;9`
    (0.6) on every prompt, hence a real call only."""
    if answer is None:
        return 0.0
    called, final = observed_call(response, question)
    bonus = CALL_BONUS if called and final.strip() else 0.0
    return min(1.0, grade(final, answer) + bonus)
