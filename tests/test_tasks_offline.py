"""The arithmetic and synthetic-preference tasks."""

import math

import pytest

from refppo.tasks import arithmetic, preference


def test_arithmetic_split_and_reward():
    train, held = arithmetic.make_problems(max_operand=9, n_heldout=20)
    assert len(train) + len(held) == 100 and not {p.prompt for p in train} & {p.prompt for p in held}
    assert all(str(eval(p.prompt[:-1])) == p.answer for p in train + held)
    assert arithmetic.make_problems(9, 20) == (train, held)  # a fixed split
    scores = arithmetic.exact_match_reward(["1+2="] * 4, ["3", " 3", "03", "4"], [{"answer": "3"}] * 4)
    assert scores.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_arithmetic_carry_and_the_teachers_mistake():
    # Independent of the Problem properties: digit-wise addition written out.
    for a in range(50):
        for b in range(50):
            p = arithmetic.Problem(a, b)
            units = a % 10 + b % 10
            assert p.prompt == f"{a}+{b}=" and p.answer == str(a + b)
            assert p.carry == (units >= 10)
            assert p.answer_without_carry == str(10 * (a // 10 + b // 10) + units % 10)
            assert (p.answer_without_carry == p.answer) == (not p.carry)
    assert arithmetic.Problem(27, 35).answer_without_carry == "52"


def test_teacher_forgets_carries_at_the_stated_rate():
    train, _ = arithmetic.make_problems()
    carries = [p for p in train if p.carry]
    assert arithmetic.make_demonstrations(train, 0.0) == [(p.prompt, p.answer) for p in train]
    always = dict(arithmetic.make_demonstrations(train, 1.0))
    assert all(always[p.prompt] == (p.answer_without_carry if p.carry else p.answer) for p in train)
    demos = dict(arithmetic.make_demonstrations(train, 0.75, seed=0))
    wrong = sum(demos[p.prompt] != p.answer for p in carries)
    assert all(demos[p.prompt] == p.answer for p in train if not p.carry)
    assert abs(wrong / len(carries) - 0.75) < 4 * math.sqrt(0.75 * 0.25 / len(carries))
    assert demos == dict(arithmetic.make_demonstrations(train, 0.75, seed=0))  # seeded
    assert demos != dict(arithmetic.make_demonstrations(train, 0.75, seed=1))
    with pytest.raises(ValueError, match=r"carry_error must be in \[0, 1\], got 1.5"):
        arithmetic.make_demonstrations(train, 1.5)


def test_gold_score_worked_examples():
    assert preference.gold_score("abc:", "abcab") == 1.0  # all letters shared, length 5
    assert math.isclose(preference.gold_score("abc:", "ah"), 0.5 - 0.3)
    assert preference.gold_score("abc:", "") == -1.0
    assert preference.gold_reward(["abc:"], ["abcab"], [{}]).tolist() == [1.0]


def test_prompt_letters_reward_worked_examples():
    prompts = ["abc:"] * 5
    responses = ["cab", " a ", "abd", "", "abcabcabca"]
    assert preference.prompt_letters_reward(prompts, responses, [{}] * 5).tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    # the colon closes the prompt: it is not one of the prompt's letters
    assert preference.prompt_letters_reward(["abc:"], ["a:"], [{}]).tolist() == [0.0]


def test_comparisons_follow_bradley_terry():
    noise = 0.2
    pairs = preference.make_comparisons(4000, seed=0, noise=noise)
    # Chosen responses should win with the probability the model assigns, on average.
    expected = sum(
        1 / (1 + math.exp(-abs(preference.gold_score(p, c) - preference.gold_score(p, r)) / noise)) for p, c, r in pairs
    )
    agree = sum(preference.gold_score(p, c) >= preference.gold_score(p, r) for p, c, r in pairs)
    assert abs(agree - expected) < 4 * math.sqrt(len(pairs) * 0.25)
    assert all(set(c) <= set(preference.LETTERS) for _, c, _ in pairs)
