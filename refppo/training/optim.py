"""Optimisation: AdamW with a warm-up and an optional cosine schedule, one per trained model."""

from __future__ import annotations

import math

import torch

from refppo.settings.config import OptimConfig


def _parameter_groups(params: list, decay_1d_params: bool) -> list[dict]:
    """AdamW's parameter groups: one, or with ``decay_1d_params=false`` the 1-D parameters apart,
    without weight decay."""
    if decay_1d_params:
        return [{"params": params}]
    return [
        {"params": [p for p in params if p.dim() != 1]},
        {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0},
    ]


def make_optimizer(params, optim: OptimConfig, total_steps: int):
    """AdamW and verl's LambdaLR schedules (``get_constant_schedule_with_warmup``,
    ``get_cosine_schedule_with_warmup``), the learning rate at step s being lr x factor(s).

    The weight decay (decoupled, ``weight_decay``) applies to every parameter, as verl's FSDP
    engine's optimizer has it, or with ``decay_1d_params=false`` only to those of two or more
    dimensions, as Megatron-Core's default parameter groups have it in verl's Megatron engine
    (``_get_param_groups``: no decay on names ending in ``.bias`` or on 1-D parameters; a bias is
    1-D). The schedule's factor:

    - warm-up, s < W: s / W, so the first update runs at lr 0, as in verl; W = ``lr_warmup_steps``,
      or when that is <= 0 ``lr_warmup_steps_ratio`` x ``total_steps`` rounded down;
    - then ``lr_scheduler_type=constant``: 1;
    - or ``cosine``: m + (1 - m)(1 + cos(pi p)) / 2, p = (s - W) / max(1, total_steps - W),
      m = ``min_lr_ratio``: from 1 to m at ``total_steps``.

    Args:
        params: the parameters to train.
        optim: the role's ``optim`` settings.
        total_steps: the steps the schedule spans (:func:`refppo.training.data.schedule_steps`).

    Returns:
        (optimizer, scheduler); the scheduler steps once per training step.
    """
    groups = _parameter_groups(list(params), decay_1d_params=optim.decay_1d_params)
    optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)
    warmup = optim.lr_warmup_steps
    floor = optim.min_lr_ratio
    if warmup <= 0:
        warmup = int(optim.lr_warmup_steps_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return step / warmup
        if optim.lr_scheduler_type == "constant":
            return 1.0
        done = (step - warmup) / max(1, total_steps - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
