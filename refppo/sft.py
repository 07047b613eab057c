"""Supervised fine-tuning (ch 5): the masked next-token loss on responses only.

The batch has the rollout layout (``refppo.rollout.build_batch``), so the loss is the negative
mean log-prob of the response tokens (EOS included) that PPO later computes the same way.
"""

from __future__ import annotations

import torch

from refppo.losses import agg_loss
from refppo.models import check_fused_kernels
from refppo.optim import train_steps
from refppo.rollout import build_batch, response_log_probs
from refppo.data import EpochSampler


def sft_loss(model, batch: dict[str, torch.Tensor], fused: bool = False) -> torch.Tensor:
    """Mean negative log-likelihood of the valid response tokens (prompt tokens are not trained).

    Args:
        model: a causal LM.
        batch: rollout-layout batch (``input_ids``, ``attention_mask``, ``position_ids``,
            ``responses``, ``response_mask``).
        fused: from the final hidden states, without whole logits (``model.use_fused_kernels``).

    Returns:
        Scalar loss (token-mean over the batch).
    """
    log_probs, _ = response_log_probs(model, batch, temperature=1.0, fused=fused)
    return -agg_loss(log_probs, batch["response_mask"].to(log_probs.device), "token-mean")


def train_sft(
    model,
    tokenizer,
    examples: list[tuple[str, str]],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    log=None,
    progress_bar: bool = False,
    fused: bool = False,
) -> list[dict[str, float]]:
    """Train ``model`` on (prompt, response) pairs with AdamW and a cosine schedule.

    Args:
        model: a causal LM (trained in place).
        tokenizer: a prepared tokenizer.
        examples: (prompt, response) texts; each response gets EOS appended.
        steps: optimiser steps.
        batch_size: examples per step, drawn without replacement within an epoch.
        lr: peak learning rate.
        seed: data order.
        log: optional ``log(step, metrics)`` called every step.
        progress_bar: show a tqdm bar with the loss.
        fused: the loss from the final hidden states (``model.use_fused_kernels``; the model
            must pass :func:`refppo.models.check_fused_kernels`).

    Returns:
        Per-step metrics ``{"sft/loss", "sft/lr"}``.
    """
    if not examples:
        raise ValueError("no SFT examples")
    if fused:
        check_fused_kernels(model, "SFT model")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)

    def step_loss(batch):
        prompts, responses = zip(*batch)
        loss = sft_loss(model, build_batch(tokenizer, prompts, responses), fused)
        return loss, {"sft/loss": loss.detach(), "sft/lr": schedule.get_last_lr()[0]}

    sampler = EpochSampler(examples, batch_size, seed)
    shown = {"loss": ("sft/loss", ".3f")}
    return train_steps(model, optimizer, sampler, steps, step_loss, schedule, log, progress_bar, "sft", shown)
