"""The arithmetic and synthetic-preference tasks."""

import math

from refppo.tasks import arithmetic, preference


def test_arithmetic_split_and_reward():
    train, held = arithmetic.make_problems(max_operand=9, n_heldout=20)
    assert len(train) + len(held) == 100 and not {p.prompt for p in train} & {p.prompt for p in held}
    assert all(str(eval(p.prompt[:-1])) == p.answer for p in train + held)
    assert arithmetic.make_problems(9, 20) == (train, held)  # a fixed split
    scores = arithmetic.exact_match_reward(["1+2="] * 4, ["3", " 3", "03", "4"], [{"answer": "3"}] * 4)
    assert scores.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_gold_score_worked_examples():
    assert preference.gold_score("abc:", "abcab") == 1.0  # all letters shared, length 5
    assert math.isclose(preference.gold_score("abc:", "ah"), 0.5 - 0.3)
    assert preference.gold_score("abc:", "") == -1.0
    assert preference.gold_reward(["abc:"], ["abcab"], [{}]).tolist() == [1.0]


def test_comparisons_follow_bradley_terry():
    noise = 0.2
    pairs = preference.make_comparisons(4000, seed=0, noise=noise)
    # Chosen responses should win with the probability the model assigns, on average.
    expected = sum(1 / (1 + math.exp(-abs(preference.gold_score(p, c) - preference.gold_score(p, r)) / noise)) for p, c, r in pairs)
    agree = sum(preference.gold_score(p, c) >= preference.gold_score(p, r) for p, c, r in pairs)
    assert abs(agree - expected) < 4 * math.sqrt(len(pairs) * 0.25)
    assert all(set(c) <= set(preference.LETTERS) for _, c, _ in pairs)
