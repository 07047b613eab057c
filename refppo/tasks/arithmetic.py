"""Addition with a verifiable reward (ch 5), the offline stand-in for GSM8K.

A prompt is "a+b=" and the answer is the decimal sum; the reward is 1 for an exact match of
the response text (up to its EOS) and 0 otherwise, like the GSM8K rule in the notes. Problems
are split once, by a fixed seed, into training and held-out sets, so evaluation never sees a
training problem.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def make_problems(max_operand: int = 49, n_heldout: int = 200, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """All problems a+b with 0 <= a, b <= max_operand, split into (train, held-out).

    Args:
        max_operand: largest operand.
        n_heldout: problems kept out of training.
        seed: the split's seed (the split is a property of the task, not of a run).

    Returns:
        (train problems, held-out problems), disjoint.
    """
    problems = [Problem(f"{a}+{b}=", str(a + b)) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if not 0 < n_heldout < len(problems):
        raise ValueError(f"n_heldout must be in (0, {len(problems)}), got {n_heldout}")
    random.Random(seed).shuffle(problems)
    return problems[n_heldout:], problems[:n_heldout]


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
