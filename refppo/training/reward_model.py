"""Reward-model training (ch 5): Bradley-Terry on pairwise comparisons.

P(chosen preferred over rejected) = sigmoid(r_chosen - r_rejected); the loss is its negative
log-likelihood, -log sigmoid(r_chosen - r_rejected), averaged over pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from refppo.distributed import SINGLE, World
from refppo.rollout.forward import compute_scores, response_scores
from refppo.rollout.models import value_head
from refppo.rollout.prompts import build_batch
from refppo.training.data import EpochSampler
from refppo.training.sft import train_steps


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean -log sigmoid(chosen - rejected), and the accuracy (chosen scored higher).

    Args:
        chosen: (P,) scores of the preferred responses.
        rejected: (P,) scores of the other responses.

    Returns:
        (loss scalar, accuracy scalar, detached).
    """
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(
            f"chosen and rejected must be matching (P,) tensors, got {tuple(chosen.shape)}, {tuple(rejected.shape)}"
        )
    margin = chosen - rejected
    return -F.logsigmoid(margin).mean(), (margin > 0).float().mean().detach()


def train_reward_model(
    reward_model,
    tokenizer,
    comparisons: list[tuple[str, str, str]],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    log=None,
    progress_bar: bool = False,
    world: World = SINGLE,
    chat_template_kwargs: dict | None = None,
) -> list[dict[str, float]]:
    """Train a scalar-head model on (prompt, chosen, rejected) texts with AdamW.

    Args:
        reward_model: from ``refppo.rollout.models.load_value_model`` (e.g. initialised from the SFT model).
        tokenizer: a prepared tokenizer.
        comparisons: (prompt, chosen response, rejected response) triples.
        steps, batch_size, lr: optimisation; pairs are drawn without replacement per epoch.
        seed: data order.
        log: optional ``log(step, metrics)``.
        progress_bar: show a tqdm bar with the loss and the accuracy.
        world: the processes (each takes its share of every batch).
        chat_template_kwargs: keyword arguments to the chat template of chat prompts
            (``data.apply_chat_template_kwargs``).

    Returns:
        Per-step ``{"rm/loss", "rm/accuracy", "rm/lr"}``.
    """
    if not comparisons:
        raise ValueError("no comparisons to train the reward model on")
    optimizer = torch.optim.AdamW(reward_model.parameters(), lr=lr)

    def step_loss(batch):
        prompts, chosen, rejected = zip(*batch)
        # One forward pass over chosen and rejected together.
        pairs = build_batch(tokenizer, prompts * 2, chosen + rejected, chat_template_kwargs=chat_template_kwargs)
        scores = response_scores(reward_model, pairs)
        loss, acc = bradley_terry_loss(scores[: len(batch)], scores[len(batch) :])
        return loss, {"rm/loss": loss.detach(), "rm/accuracy": acc}, torch.tensor(float(len(batch)), device=loss.device)

    sampler = EpochSampler(comparisons, batch_size, seed)
    shown = {"loss": ("rm/loss", ".3f"), "acc": ("rm/accuracy", ".2f")}
    return train_steps(reward_model, optimizer, sampler, steps, step_loss, None, log, progress_bar, "rm", shown, world)


@torch.no_grad()
def held_out_comparisons(
    reward_model, tokenizer, comparisons: list[tuple], batch_size: int = 64, chat_template_kwargs: dict | None = None
) -> dict[str, float]:
    """How a reward model ranks comparisons it did not train on: ``val/accuracy``, the share whose
    chosen response scores higher, and ``val/margin``, the mean of score(chosen) - score(rejected).

    Args:
        reward_model: a scalar-head model.
        tokenizer: its tokenizer.
        comparisons: (prompt, chosen, rejected) triples, the prompt a text or a chat.
        batch_size: comparisons per forward pass.
        chat_template_kwargs: keyword arguments to the chat template of chat prompts
            (``data.apply_chat_template_kwargs``).
    """
    if not comparisons:
        raise ValueError("no held-out comparisons")
    margins = []
    for start in range(0, len(comparisons), batch_size):
        chunk = comparisons[start : start + batch_size]
        prompts = [prompt for prompt, _, _ in chunk]
        responses = [chosen for _, chosen, _ in chunk] + [rejected for _, _, rejected in chunk]
        batch = build_batch(tokenizer, prompts * 2, responses, chat_template_kwargs=chat_template_kwargs)
        scores = compute_scores(reward_model, batch)
        margins.append(scores[: len(chunk)] - scores[len(chunk) :])
    margin = torch.cat(margins)
    return {"val/accuracy": float((margin > 0).float().mean()), "val/margin": float(margin.mean())}


@torch.no_grad()
def center_reward_model(
    reward_model,
    tokenizer,
    prompts: list,
    responses: list[str],
    chat_template_kwargs: dict | None = None,
    batch_size: int = 64,
) -> float:
    """Shift the head's bias so these samples (a file's training responses, or SFT samples) score 0
    on average; returns the shift.

    Args:
        reward_model: a scalar-head model.
        tokenizer: its tokenizer.
        prompts, responses: the samples, each prompt a text or a chat (rendered with
            ``chat_template_kwargs``).
        batch_size: samples per forward pass, so a whole training file never makes one batch.
    """
    if not prompts or len(prompts) != len(responses):
        raise ValueError(f"center on matching prompts and responses, got {len(prompts)} and {len(responses)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
    total = 0.0
    for start in range(0, len(prompts), batch_size):
        end = start + batch_size
        batch = build_batch(
            tokenizer, prompts[start:end], responses[start:end], chat_template_kwargs=chat_template_kwargs
        )
        total += compute_scores(reward_model, batch).sum().item()
    mean = total / len(prompts)
    value_head(reward_model).bias.sub_(mean)
    return -mean
