"""`math_equal` compares a multi-part gold answer whole (`flowrl.rewards.math_answers`): a pair, an interval, a
list, an equation, a product or a power in bare LaTeX is one answer, right in any equivalent writing and wrong as
one of its numbers; and the ordinary answers of public data sets (gsm8k's integers, MATH's fractions, money,
percentages, degrees, text) keep the scores they had."""

from __future__ import annotations

import pytest

from flowrl.rewards.math import math_equal
from flowrl.rewards.math_answers import final_expression

# gold answer -> (right answers in several writings, partial / one-number / wrong answers). On main every
# "wrong" row marked below scored 1.0 (the gold was read as its last number) and every boxed or `$`-delimited
# right answer scored 0.0.
SHAPES = {
    "(1, 2)": (["\\boxed{(1,2)}", "\\boxed{(1, 2)}.", "The point is (1, 2).", "so the answer is $(1, 2)$.",
                "\\boxed{\\left(1, 2\\right)}", "\\boxed{1, 2}"],  # math-verify: a pair's parts in order
               ["\\boxed{2}", "2", "The answer is 2.", "\\boxed{1}", "\\boxed{(2, 1)}", "\\boxed{2, 1}",
                "\\boxed{[1, 2]}", "\\boxed{(1, 2, 3)}"]),
    "[0, 1)": (["\\boxed{[0,1)}", "$[0, 1)$", "x \\in [0, 1)", "The range is [0, 1).", "$x \\in [0, 1)$"],
               ["\\boxed{1}", "1", "\\boxed{0}", "\\boxed{[0, 1]}", "\\boxed{(0, 1)}", "[0, 1]"]),
    "1, 2, 3": (["\\boxed{1, 2, 3}", "\\boxed{3, 2, 1}", "$1, 2, 3$", "The roots are 1, 2, and 3.",
                 "\\boxed{\\{1, 2, 3\\}}", "x = 1, 2, 3"],
                ["\\boxed{3}", "3", "The roots are 1, 2, and 4.", "\\boxed{1, 2}", "1, 2", "\\boxed{1, 2, 3, 4}"]),
    # an equation whose left side is one variable equals its right side (math-verify's rule, the MATH graders')
    "y = 2x + 3": (["\\boxed{y=2x+3}", "$y=2x+3$", "so y = 2x + 3", "\\boxed{y = 3 + 2x}", "\\boxed{2x+3}",
                    "The line is $y - 3 = 2x$, i.e. $y = 2x + 3$."],
                   ["\\boxed{3}", "3", "\\boxed{2}", "\\boxed{y = 2x}", "y = 3x + 2", "\\boxed{x = 2y + 3}"]),
    "3\\sqrt{2}": (["\\boxed{3\\sqrt{2}}", "\\boxed{\\sqrt{18}}", "$3\\sqrt2$", "The side is 3*sqrt(2).",
                    "\\boxed{\\frac{6}{\\sqrt{2}}}"],
                   ["\\boxed{3}", "3", "\\boxed{2}", "\\boxed{\\sqrt{2}}", "\\boxed{3\\sqrt{3}}", "\\boxed{4.24}"]),
    "2^{10}": (["\\boxed{1024}", "\\boxed{2^{10}}", "1024", "The answer is 2^10.", "$2^{10}$"],
               ["\\boxed{2}", "2", "\\boxed{10}", "10", "\\boxed{2^{11}}", "1000"]),
    "(-\\infty, 3]": (["\\boxed{(-\\infty, 3]}", "x \\in (-\\infty,3]"], ["\\boxed{3}", "3", "\\boxed{(-\\infty, 3)}"]),
    "\\left( 3, \\frac{\\pi}{2} \\right)": (["\\boxed{(3, \\frac{\\pi}{2})}", "(3, \\pi/2)"],
                                            ["\\boxed{3}", "\\boxed{\\frac{\\pi}{2}}", "2"]),
}
PAIRS = [(gold, response, 1.0) for gold, (right, _) in SHAPES.items() for response in right] + \
        [(gold, response, 0.0) for gold, (_, wrong) in SHAPES.items() for response in wrong]


@pytest.mark.parametrize("gold,response,score", PAIRS)
def test_a_multi_part_gold_answer_is_compared_whole(gold: str, response: str, score: float) -> None:
    assert math_equal("a problem", response, answer=gold) == score


def _writings(x: str) -> list[str]:
    return [x, f"The answer is {x}.", f"\\boxed{{{x}}}", f"So the final answer is $\\boxed{{{x}}}$.", f"#### {x}",
            f"Therefore, the answer is ${x}$.", f"First, 3 + 4 = 7.\nThe answer is: {x}"]


# Gold answers as public data sets write them (gsm8k's final answers, MATH's `answer` field), each with right
# answers as a policy writes them. ORDINARY: every row (each answer in each of `_writings`) scored 1.0 on main
# too, and must not regress; NEWLY_RIGHT: rows main scored 0.0 (a gold `\\$5` never parsed; bare LaTeX in a
# plain-text response was not read), right now. Both checked against main's grader run on these tables.
ORDINARY = {
    "72": ["72", "48 + 24 = 72", "x = 72", "72.0", "72 \\text{ clips}"],
    "1000": ["1,000", "1000"],
    "-3": ["-3", "x = -3"],
    "0": ["0"],
    "18": ["18", "18 cm", "18 \\text{ cm}"],
    "3.5": ["3.5", "\\frac{7}{2}", "7/2"],
    "0.25": ["0.25", "1/4"],
    "\\frac{3}{4}": ["\\frac{3}{4}", "3/4", "0.75", "\\frac{6}{8}"],
    "\\dfrac{3}{4}": ["\\frac{3}{4}", "3/4"],
    "\\frac{1}{2}": ["0.5", "1/2", "\\frac{1}{2}"],
    "-\\frac{1}{2}": ["-1/2", "-0.5", "-\\frac{1}{2}"],
    "50\\%": ["50\\%", "50%", "50"],
    "90^\\circ": ["90", "90^\\circ"],
    "5 \\text{ cm}": ["5", "5 cm"],
    "10 dollars": ["10"],
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72": ["72"],
    "x=5": ["5", "x = 5"],
}
NEWLY_RIGHT = {
    "1000": ["1{,}000"],
    "\\dfrac{3}{4}": ["\\dfrac{3}{4}"],
    "\\sqrt{8}": ["2\\sqrt{2}", "\\sqrt{8}"],
    "\\$5": ["5", "\\$5"],
    "\\$18.90": ["18.90", "18.9"],
    "\\text{Monday}": ["\\text{Monday}"],
    "\\text{(C)}": ["\\text{(C)}", "C"],
    "x^2+1": ["x^2+1", "1+x^2"],
}
# whole responses that end in prose (main scored the last one 0.0)
PROSE = [("72", "She sold 72 clips."), ("72", "72 clips in total. Hope this helps!"), ("1000", "Total: 1,000 apples"),
         ("5 \\text{ cm}", "The side is 5 cm long."), ("\\$5", "It costs $5.")]
ORDINARY_WRONG = {"72": ["71", "73", "(72, 1)", "x = 71"], "\\frac{3}{4}": ["3/5", "\\frac{4}{3}", "3"],
                  "50\\%": ["40\\%", "5"], "\\$5": ["6"], "90^\\circ": ["180"], "\\text{Monday}": ["\\text{Tuesday}"],
                  "10 dollars": ["11"], "-3": ["3"], "1000": ["100"]}


@pytest.mark.parametrize("gold", sorted(set(ORDINARY) | set(NEWLY_RIGHT)))
def test_ordinary_answers_keep_their_scores(gold: str) -> None:
    for answer in ORDINARY.get(gold, []) + NEWLY_RIGHT.get(gold, []):
        for response in _writings(answer):
            assert math_equal("a problem", response, answer=gold) == 1.0, (gold, response)
    for answer in ORDINARY_WRONG.get(gold, []):
        for response in _writings(answer):
            assert math_equal("a problem", response, answer=gold) == 0.0, (gold, response)
    for answer, response in PROSE:
        if answer == gold:
            assert math_equal("a problem", response, answer=gold) == 1.0, (gold, response)


@pytest.mark.parametrize("response,expression", [
    ("The point is (1, 2).", "(1, 2)"),
    ("so y = 2x + 3", "y = 2x + 3"),
    ("The roots are 1, 2, and 3", "1, 2, and 3"),
    ("x \\in [0, 1)", "x \\in [0, 1)"),
    ("x in [0, 1)", "[0, 1)"),  # a plain `in` is a word
    ("It is a 5", "5"),  # a lone letter starting the answer is a word unless a relation follows
    ("The answer is: C", "C"),  # or it is the whole answer
    ("The side is 3*sqrt(2).", "3*sqrt(2)"),
    ("#### 72", "72"),
    ("Answer: 18 \\text{ cm}", "18 \\text{ cm}"),
    ("first line (1, 2)\nthen 7", "7"),  # the last line only
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
    ("4 4", "4"),  # two plain numbers side by side are not one expression: the last is the answer
    ("0 .5", ".5"),
    ("It is 12 3.", "3"),
    ("3 \\sqrt{2}", "3 \\sqrt{2}"),  # a number beside other math is a product, as written
    ("1,000 2", "2"),
    ("72 apples", None),  # no math at the end: math-verify's own reading (its last number) decides
    ("It is 72. Hope this helps!", None),
    ("", None),
])
def test_the_answer_at_the_end_of_a_plain_response(response: str, expression: str | None) -> None:
    assert final_expression(response) == expression


# Responses a policy can write to any gold answer 0 (or any number): letters whose value vanishes. Each scored 1.0
# for the gold `0` before (latex2sympy reads `we0d` as w*e*0*d, `0 .5` as 0*0.5, and verify simplified them to 0);
# found comparing the grader before and after the multi-part change on random 4-character responses of
# examples/math_word.flow's alphabet.
VANISHING = [("0", "we0d"), ("0", "p0xy"), ("0", "g0h8"), ("0", "0x"), ("0", "x - x"), ("0", "0 .5"), ("0", "0 q6"),
             ("0", "$0y$"), ("0", "\\boxed{0 \\cdot y}"), ("5", "5 + 0z"), ("3", "3 j"), ("4", "3 4 x")]
STILL_RIGHT = [("0", "0"), ("0", "x = 0"), ("0", "\\boxed{0}"), ("0", "0 apples"), ("4", "4 4"), ("4", "3 4"),
               ("0.5", "0 .5"), ("18", "18 cm"), ("x^2+1", "1 + x^2"), ("y = 2x + 3", "2x + 3"), ("5", "x = 5")]


@pytest.mark.parametrize("gold,response", VANISHING)
def test_letters_whose_value_vanishes_are_not_a_number(gold: str, response: str) -> None:
    assert math_equal("a problem", response, answer=gold) == 0.0


@pytest.mark.parametrize("gold,response", STILL_RIGHT)
def test_numbers_and_expressions_beside_them_stay_right(gold: str, response: str) -> None:
    assert math_equal("a problem", response, answer=gold) == 1.0
