"""Addition with a verifiable reward (ch 5), the offline stand-in for GSM8K.

A prompt is "a+b=" and the answer is the decimal sum; the reward is 1 for an exact match of
the response text (up to its EOS) and 0 otherwise, like the GSM8K rule in the notes. Problems
are split once, by a fixed seed, into training and held-out sets, so evaluation never sees a
training problem.

The demonstrations SFT learns from come from a sloppy teacher: on a problem whose units digits
carry (27+35), it forgets the carry (writes 52 instead of 62) with probability
``carry_error``. SFT imitates the teacher, mistakes included; PPO with the exact-match reward
can then end up better than the teacher it was taught by (chapter 5).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Problem:
    """The problem a+b, with its prompt, its answer and the teacher's typical mistake."""

    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    @property
    def carry(self) -> bool:
        """The units digits sum to 10 or more, so the tens digit gets a carry."""
        return self.a % 10 + self.b % 10 >= 10

    @property
    def answer_without_carry(self) -> str:
        """The sum with the carry forgotten: each digit added on its own, mod 10 for the units."""
        return str((self.a // 10 + self.b // 10) * 10 + (self.a + self.b) % 10)


MAX_OPERAND = 49  # the task's problems: a+b with 0 <= a, b <= MAX_OPERAND


def make_problems(
    max_operand: int = MAX_OPERAND, n_heldout: int = 200, seed: int = 0
) -> tuple[list[Problem], list[Problem]]:
    """All problems a+b with 0 <= a, b <= max_operand, split into (train, held-out).

    Args:
        max_operand: largest operand.
        n_heldout: problems kept out of training.
        seed: the split's seed (the split is a property of the task, not of a run).

    Returns:
        (train problems, held-out problems), disjoint.
    """
    problems = [Problem(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if not 0 < n_heldout < len(problems):
        raise ValueError(f"n_heldout must be in (0, {len(problems)}), got {n_heldout}")
    random.Random(seed).shuffle(problems)
    return problems[n_heldout:], problems[:n_heldout]


def make_demonstrations(problems: list[Problem], carry_error: float, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, response) pairs written by a teacher who forgets carries.

    Each problem gets one demonstration: the correct sum, except that a problem with a carry
    gets ``answer_without_carry`` with probability ``carry_error``.

    Args:
        problems: the problems to demonstrate.
        carry_error: in [0, 1]; 0 is a perfect teacher.
        seed: which carry problems get the mistake.

    Returns:
        len(problems) (prompt, response) pairs.
    """
    if not 0.0 <= carry_error <= 1.0:
        raise ValueError(f"carry_error must be in [0, 1], got {carry_error}")
    rng = random.Random(seed)
    out = []
    for p in problems:
        wrong = p.carry and rng.random() < carry_error
        out.append((p.prompt, p.answer_without_carry if wrong else p.answer))
    return out


def exact_match_reward(prompts: list[str], responses: list[str], records: list[dict]) -> torch.Tensor:
    """1.0 where the response text equals the record's answer, else 0.0.

    Args:
        prompts: B prompt texts (unused; part of the reward-function signature).
        responses: B response texts, decoded without special tokens.
        records: B dicts with an "answer" string.

    Returns:
        (B,) float32 scores.
    """
    return torch.tensor([float(r.strip() == rec["answer"]) for r, rec in zip(responses, records)])
