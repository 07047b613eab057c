"""Synthetic preferences (ch 5, 6): a hidden gold reward, noisy pairwise comparisons drawn from
it, and a proxy reward model learned from them, so over-optimisation can be watched.

A prompt is three letters and a colon ("bdf:"); a response is a string of letters a-h. The gold
reward prefers responses that reuse the prompt's letters and are about 5 letters long:
gold = (share of response letters found in the prompt) - 0.1 * |length - 5|. The SFT
distribution is random: uniform letters, uniform length 1-8.
"""

from __future__ import annotations

import math
import random

import torch

LETTERS = "abcdefgh"


def make_prompts(n: int, seed: int) -> list[dict]:
    """``n`` prompt records {"prompt": "xyz:"} with three distinct letters each."""
    rng = random.Random(seed)
    return [{"prompt": "".join(sorted(rng.sample(LETTERS, 3))) + ":"} for _ in range(n)]


def sft_response(rng: random.Random) -> str:
    """One response of the SFT distribution: 1-8 uniform letters."""
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 8)))


def gold_score(prompt: str, response: str) -> float:
    """The hidden reward of one response (see the module docstring); empty responses get -1."""
    if not response:
        return -1.0
    shared = sum(c in prompt[:-1] for c in response) / len(response)
    return shared - 0.1 * abs(len(response) - 5)


def gold_reward(prompts: list[str], responses: list[str], records: list[dict]) -> torch.Tensor:
    """The gold reward as a reward function: (B,) float32."""
    return torch.tensor([gold_score(p, r.strip()) for p, r in zip(prompts, responses)])


def prompt_letters_reward(prompts: list[str], responses: list[str], records: list[dict]) -> torch.Tensor:
    """A verifiable reward on the same prompts (ch 7): 1.0 when every letter of the response is
    one of its prompt's three, else 0.0 (an empty response scores 0). Under the SFT distribution a
    response of length L earns it with probability (3/8)^L, so long responses are mostly wrong.

    Returns:
        (B,) float32 scores.
    """
    return torch.tensor(
        [float(bool(r.strip()) and all(c in p[:-1] for c in r.strip())) for p, r in zip(prompts, responses)]
    )


def make_sft_examples(n: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, response) pairs from the SFT distribution."""
    rng = random.Random(seed)
    return [(rec["prompt"], sft_response(rng)) for rec in make_prompts(n, seed)]


def make_comparisons(n: int, seed: int, noise: float = 0.2) -> list[tuple[str, str, str]]:
    """(prompt, chosen, rejected) triples: two SFT responses labelled by Bradley-Terry noise,
    P(a preferred) = sigmoid((gold(a) - gold(b)) / noise).
    """
    rng = random.Random(seed)
    out = []
    for rec in make_prompts(n, seed):
        p = rec["prompt"]
        a = sft_response(rng)
        b = sft_response(rng)
        p_a = 0.5 * (1.0 + math.tanh((gold_score(p, a) - gold_score(p, b)) / (2 * noise)))  # sigmoid, no overflow
        out.append((p, a, b) if rng.random() < p_a else (p, b, a))
    return out
