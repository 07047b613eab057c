"""Optimisation: AdamW with a warm-up and an optional cosine schedule, one per trained model."""

from __future__ import annotations

import math

import torch

from refppo.config import OptimConfig


def make_optimizer(params, optim: OptimConfig, total_steps: int):
    """AdamW and a LambdaLR schedule: linear warm-up, then constant or cosine to 0 at ``total_steps``.

    Returns:
        (optimizer, scheduler); the scheduler steps once per training step.
    """
    optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)

    def factor(step: int) -> float:
        if step < optim.lr_warmup_steps:
            return (step + 1) / optim.lr_warmup_steps
        if optim.lr_scheduler == "cosine":
            done = (step - optim.lr_warmup_steps) / max(1, total_steps - optim.lr_warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
