"""The answers a majority vote counts (flowrl.rewards.answers): read as the shipped rewards read them."""

from __future__ import annotations

from flowrl.rewards import arith_exact, arith_partial, char_fraction, math_equal
from flowrl.rewards.answers import extractor_of, final_answer, first_integer


def test_arith_rewards_vote_on_the_first_integer_they_grade() -> None:
    assert extractor_of(arith_exact) is first_integer and extractor_of(arith_partial) is first_integer
    assert [first_integer(r) for r in ("12 or 13", "x=007", "-4", "none")] == ["12", "7", "-4", None]
    # the vote's answer is the one the reward grades
    assert arith_exact("1+1=", "2 apples", answer=2) == 1.0 and first_integer("2 apples") == "2"


def test_math_equal_votes_on_the_last_box_else_the_last_number() -> None:
    assert extractor_of(math_equal) is final_answer
    assert final_answer("so \\boxed{1} then \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert final_answer("it is 3, no: 1,000.") == "1000"
    assert final_answer("$ 12 $") == "12"
    assert final_answer("\\boxed{x") is None and final_answer("\\boxed{x 5") == "5"  # an unclosed box holds none
    assert final_answer("no number here") is None
    assert final_answer("1/2") != final_answer("0.5")  # voted as text (the reward still grades the winner)


def test_a_reward_without_a_known_reader_has_no_vote_unless_it_brings_one() -> None:
    assert extractor_of(char_fraction) is None

    def mine(prompt: str, response: str, **_: object) -> float:
        return 1.0

    mine.extract_answer = lambda response: response[:1] or None  # type: ignore[attr-defined]
    reader = extractor_of(mine)
    assert reader is not None and reader("ab") == "a"
