"""pass@k (Chen et al. 2021's unbiased estimator, 1 - C(n-c, k)/C(n, k)), the k's reported and the majority vote,
against values worked out by hand from the formula."""

from __future__ import annotations

import math

import pytest

from flowrl.algos.pass_at_k import majority, pass_at_k, report_ks


@pytest.mark.parametrize(("n", "c", "k", "want"), [
    (1, 0, 1, 0.0),  # one sample, wrong
    (1, 1, 1, 1.0),  # one sample, right
    (4, 0, 1, 0.0), (4, 0, 4, 0.0),  # c = 0: never
    (4, 4, 1, 1.0), (4, 4, 4, 1.0),  # c = n: always
    (4, 1, 1, 0.25),  # 1 - C(3,1)/C(4,1) = 1 - 3/4
    (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (4, 1, 4, 1.0),  # n - c = 3 < k = 4: every draw of 4 holds the right one
    (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (10, 3, 1, 0.3),  # pass@1 = c/n
    (8, 2, 4, 1 - 15 / 70),  # 1 - C(6,4)/C(8,4)
])
def test_pass_at_k_equals_the_formula_on_worked_cases(n: int, c: int, k: int, want: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-15)


def test_pass_at_1_is_the_fraction_right_and_agrees_with_the_papers_stable_form() -> None:
    for n in range(1, 12):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-15)
    # Chen et al.'s numerically stable form: 1 - prod_{i = n-c+1}^{n} (1 - k / i)
    n, c, k = 200, 13, 10
    stable = 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
    assert pass_at_k(n, c, k) == pytest.approx(stable, rel=1e-12)


def test_pass_at_k_refuses_impossible_counts() -> None:
    for n, c, k in ((3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_the_ks_reported_are_powers_of_two_below_n_and_n() -> None:
    assert [report_ks(n) for n in (1, 2, 3, 4, 5, 8, 16)] == [
        (1,), (1, 2), (1, 2, 3), (1, 2, 4), (1, 2, 4, 5), (1, 2, 4, 8), (1, 2, 4, 8, 16)]


def test_the_majority_is_the_most_common_answer_first_given() -> None:
    assert majority(["3", "5", "3"]) == 0
    assert majority(["5", "3", "3", "5"]) == 0  # a tie goes to the answer given first
    assert majority([None, "4", "7", "7"]) == 2
    assert majority([None, "4"]) == 1  # responses without an answer do not vote
    assert majority([None, None]) is None
