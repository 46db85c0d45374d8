"""The multi-turn examples (issue 26): examples/calc_tool.flow, calc_notool.flow and guess_number.flow compile and
run two steps end to end on the local backend, reporting their environment metrics; their environments' logic
(examples/envs/: the calculator and its grading, the hidden-number game, the benchmark's latency) is tested directly,
with the actions a policy may write: garbage, nothing, huge numbers, digits Python reads as digits."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

import flowrl
from flowrl import run
from flowrl.envs.load import load_env_class
from flowrl.envs.pool import EnvPool
from flowrl.envs.protocol import EnvSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))  # as the flows' folder is wherever their environments run

from envs.calc import CALL_BONUS, REPEAT, calc, evaluate, final_answer, grade, observed_call  # noqa: E402
from envs.guess import Guess, feedback  # noqa: E402
from envs.latency import Latency, draw, p99_over_p50  # noqa: E402

FLOWS = ("calc_tool", "calc_notool", "guess_number")


def test_evaluate_reads_only_small_integer_arithmetic() -> None:
    assert evaluate("13*7") == 91
    assert evaluate(" 40 + 2 ") == 42
    assert evaluate("2-5") == -3
    for hostile in ("", "13*", "*7", "1/0", "2**64", "__import__('os')", "13*7*2", "9" * 13 + "*9", "٣*2", "1e9*2"):
        assert evaluate(hostile) is None, hostile


def test_the_tool_answers_the_rows_question_and_ignores_its_arguments() -> None:
    assert REPEAT == 3  # the answer shown three times: what made the copy learnable (envs/calc.py)
    assert calc("", question="13*7") == "91;91;91;"
    assert calc("99*99 garbage ))((", question="2*36") == "72;72;72;"
    assert calc("13*7") == "?;?;?;"  # no question in the row: nothing to compute, said in the observation
    assert calc("", question="not a question") == "?;?;?;"


def test_grade_is_exact_match_with_partial_credit_below_it() -> None:
    assert grade("91", 91) == 1.0
    assert grade(" 91", "91") == 1.0
    assert grade("93", 91) == pytest.approx(0.4)  # one digit of two, in its place
    assert grade("19", 91) == 0.0
    assert grade("911", 91) == pytest.approx(0.4)  # both leading digits right but not the answer: never 1
    assert grade("", 91) == 0.0
    assert grade("x;()", 91) == 0.0
    assert grade("9" * 10_000, 91) == pytest.approx(0.4)
    assert grade("1786", 1786) == 1.0
    assert grade("1787", 1786) == pytest.approx(0.6)


def test_the_reward_grades_the_text_after_the_last_observation() -> None:
    q = {"answer": 91, "question": "13*7"}
    assert final_answer("13*7=", "()91;91;91;91", **q) == 1.0  # the call's bonus never passes 1
    assert final_answer("13*7=", "(13*7)91;91;91;91", **q) == 1.0  # the call's arguments are ignored
    assert final_answer("13*7=", "9(91;91;91;91", **q) == 1.0  # a call cut by the turn's token cap
    assert final_answer("13*7=", "()91;91;91;19", **q) == CALL_BONUS  # digits swapped: none in place
    assert final_answer("13*7=", "()91;91;91;93", **q) == pytest.approx(0.4 + CALL_BONUS)
    assert final_answer("13*7=", "()91;91;91;", **q) == 0.0  # called, never answered: no bonus
    assert final_answer("13*7=", "()91;91;91;x", **q) == CALL_BONUS
    assert final_answer("13*7=", "91", **q) == 1.0  # no tool: the whole response is the answer
    assert final_answer("13*7=", "93", **q) == pytest.approx(0.4)
    assert final_answer("13*7=", "()91;91;91;91;", **q) == 0.0  # a `;` of its own hides the answer
    assert final_answer("13*7=", "()91;91;91;91", answer=None, question="13*7") == 0.0


def test_the_call_bonus_is_for_a_real_call_only() -> None:
    """A call whose observation came back, never a `;` written without calling: `;9` was 0.6 (0.4 for the tens
    digit after the `;`, 0.2 for the `;`), what the no-tool flow's policy learnt on every prompt."""
    q = {"answer": 91, "question": "13*7"}
    assert observed_call("()91;91;91;91", "13*7") == (True, "91")
    assert observed_call(";9", "13*7") == (False, ";9")
    for forged in (";9", ";91", "9;", "();91", "(;9", "()91;91", "()93;93;93;91", "91;91;91;91"):
        assert final_answer("13*7=", forged, **q) == grade(forged, 91), forged  # no bonus: the whole is the answer
    assert final_answer("13*7=", ";9", **q) == 0.0  # was 0.6
    assert final_answer("13*7=", "()91;91;91;91", answer=91, question="13*8") == 0.0  # another row's question
    assert final_answer("13*7=", "()?;?;?;91", answer=91) == 1.0  # a row without a question: `?;?;?;` came back
    assert final_answer("13*7=", "()91;91;91;9", **q) == pytest.approx(0.4 + CALL_BONUS)  # the real call


def test_the_call_bonus_is_paid_for_calls_the_environment_answered() -> None:
    """Through the tool as the flow runs it (the pool, two turns): the response the rollout builds from the
    actions and the tool's observation earns the bonus; the same actions without the tool do not."""
    spec = EnvSpec(name="calc", target="envs.calc.calc", kind="tool", max_turns=2, stop=(")",), call="(",
                   workers=0, timeout=5.0, folder=str(EXAMPLES))
    pool = EnvPool(spec)
    try:
        row = {"prompt": "13*7=", "question": "13*7", "answer": 91}
        pool.reset(0, row).result()
        observation = pool.step(0, "()").result().observation
    finally:
        pool.close()
    with_tool = "()" + observation + "93"
    assert final_answer(row["prompt"], with_tool, answer=91, question="13*7") == pytest.approx(0.4 + CALL_BONUS)
    assert final_answer(row["prompt"], "()93", answer=91, question="13*7") == 0.0  # written without the tool


def test_feedback_says_where_the_number_is_and_refuses_anything_but_one_digit() -> None:
    assert feedback("5", 3) == "<"
    assert feedback("2", 3) == ">"
    assert feedback("3", 3) == "="
    for hostile in ("", "  ", "10", "35", "x", "<", "٣", "²", "-1", "9" * 1000):
        assert feedback(hostile, 3) == "?", hostile


def test_a_game_rewards_the_hit_and_charges_each_miss_and_more_for_nonsense() -> None:
    game = Guess(hit=1.0, miss=-0.1, invalid=-0.5)
    assert game.reset({"prompt": "?", "number": 7}) == ""
    assert game.step("5") == (">", -0.1, False)
    assert game.step("?") == ("?", -0.5, False)
    assert game.step("") == ("?", -0.5, False)  # the action of a turn cut by the end of sequence: quitting
    assert game.step("8") == ("<", -0.1, False)
    assert game.step("7") == ("=", 1.0, True)
    with pytest.raises(ValueError, match="0-9"):
        Guess().reset({"number": 12})


def test_the_latency_is_seeded_per_trajectory_and_turn_and_long_tailed() -> None:
    assert draw(0, 3, 1, 0.05, 0.8) == draw(0, 3, 1, 0.05, 0.8)
    assert draw(0, 3, 1, 0.05, 0.8) != draw(0, 3, 2, 0.05, 0.8)
    waits = sorted(draw(0, i, k, 0.05, 0.8) for i in range(2000) for k in range(4))
    p50, p99 = waits[len(waits) // 2], waits[int(len(waits) * 0.99)]
    assert p50 == pytest.approx(0.05, rel=0.1)
    assert p99 / p50 >= 5 and p99_over_p50(0.8) == pytest.approx(math.exp(0.8 * 2.3263), rel=1e-4)
    env = Latency(median=0.0, turns=2, obs="ab")
    assert env.reset({"id": 4}) == ""
    assert env.step("x") == ("ab", 0.0, False)
    assert env.step("y") == ("ab", 0.0, True)


def test_the_pool_loads_the_examples_environments() -> None:
    folder = str(EXAMPLES)
    load_env_class(EnvSpec(name="calc", target="envs.calc.calc", kind="tool", stop=(")",), call="(", folder=folder))
    load_env_class(EnvSpec(name="game", target="envs.guess.Guess", folder=folder, options={"hit": 1.0, "miss": 0}))
    load_env_class(EnvSpec(name="lat", target="envs.latency.Latency", folder=folder, options={"median": 0.01}))


def test_the_calculator_as_the_pool_runs_it_answers_a_call_and_ends_at_the_answer() -> None:
    spec = EnvSpec(name="calc", target="envs.calc.calc", kind="tool", max_turns=2, stop=(")",), call="(",
                   workers=0, timeout=5.0, folder=str(EXAMPLES))
    pool = EnvPool(spec)
    try:
        row = {"prompt": "13*7=", "question": "13*7", "answer": 91}
        assert pool.reset(0, row).result().observation == ""
        called = pool.step(0, "()").result()
        assert (called.observation, called.done, called.error) == ("91;91;91;", False, None)
        answered = pool.step(0, "91").result()
        assert answered.done and answered.error is None
    finally:
        pool.close()


@pytest.mark.parametrize("name", FLOWS)
def test_the_flow_runs_two_steps_on_the_local_backend(tmp_path: Path, name: str) -> None:
    res = run(flowrl.load(str(EXAMPLES / f"{name}.flow")), out_dir=tmp_path, steps=2)
    assert [r["step"] for r in res.metrics] == [1, 2]
    for r in res.metrics:
        assert 0.0 <= r["reward_mean"] <= 1.0 or name == "guess_number"
        if name == "calc_notool":
            assert not any(k.startswith("env/") for k in r)
            continue
        assert r["env/errors"] == 0 and r["env/timeouts"] == 0
        assert 1.0 <= r["env/turns_mean"] <= (2.0 if name == "calc_tool" else 5.0)
        if name == "calc_tool":  # the tool-call path: an untrained policy writes `(` in ~8% of trajectories
            assert 0.0 < r["env/tool_calls_mean"] <= 2.0
        if name == "guess_number":  # every guess is answered, the last one maybe with `=` (done, not a call)
            assert r["env/tool_calls_mean"] >= r["env/turns_mean"] - 1
            assert -2.5 <= r["env/return_mean"] <= 1.0
