"""Updating a model from an evaluated batch (ch 3, 5): ``ppo_epochs`` x shuffled mini-batches x
micro-batches, one optimiser step per mini-batch with the gradient accumulated over its
micro-batches, for the actor and the critic alike."""

from __future__ import annotations

from collections.abc import Callable

import torch

from refppo.guards.checks import value_checks
from refppo.losses import agg_loss_weight

# Stats aggregated with loss_agg_mode, as the loss is: micro-batches combine like the loss.
LOSS_STATS = frozenset({"actor/pg_loss", "actor/entropy_loss", "actor/kl_loss", "critic/vf_loss"})
# Consecutive skipped updates (non-finite gradient) of one model after which the run stops.
MAX_SKIPPED_UPDATES = 8


def minibatch_updates(
    batch: dict[str, torch.Tensor],
    name: str,
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    micro_loss: Callable,
    *,
    micro_batches: Callable,
    epochs: int,
    mini_rows: int,
    agg_mode: str,
    grad_clip: float,
    shuffle_gen: torch.Generator,
    skipped: dict[str, int],
    reduce: Callable[[dict], dict] = lambda stats: stats,
) -> list[dict[str, torch.Tensor]]:
    """``epochs`` x shuffled mini-batches of ``mini_rows`` rows x micro-batches; returns one dict of
    stats per mini-batch.

    Each micro-batch's loss is weighted so the accumulated gradient is the mini-batch loss's
    gradient exactly; the stats in ``LOSS_STATS`` get the same weights (so they log the
    mini-batch's value in every ``loss_agg_mode``), the others (token means) the micro-batch's
    share of valid tokens. An update whose gradient norm is not finite is skipped
    (:func:`count_skips`).

    Args:
        batch: an evaluated batch, B rows (B a multiple of ``mini_rows``).
        name: "actor" or "critic", the stats' prefix and the key in ``skipped``.
        params, optimizer: the trained parameters and their optimiser.
        micro_loss: micro-batch -> (loss scalar, {name: detached scalar}).
        micro_batches: mini-batch -> its micro-batches (with several processes, this process's).
        epochs, agg_mode, grad_clip: ``ppo_epochs``, ``loss_agg_mode``, ``grad_clip``.
        shuffle_gen: the mini-batches' order, drawn again every epoch.
        skipped: name -> updates skipped in a row, updated here.
        reduce: the stats of a mini-batch's micro-batches -> the whole mini-batch's (with several
            processes, their sum over the processes).
    """
    rows = batch["response_mask"].shape[0]
    device = batch["response_mask"].device
    per_mini = []
    with value_checks(False):  # evaluate checked the batch once; no host sync per micro-batch
        for _ in range(epochs):
            order = torch.randperm(rows, generator=shuffle_gen).to(device)
            for idx in order.split(mini_rows):
                mini = {k: v[idx] for k, v in batch.items()}
                optimizer.zero_grad(set_to_none=True)
                stats: dict[str, torch.Tensor] = {}
                for mb in micro_batches(mini):
                    loss, micro_stats = micro_loss(mb)
                    weight = agg_loss_weight(mb["response_mask"], mini["response_mask"], agg_mode)
                    (loss * weight).backward()
                    share = mb["response_mask"].sum() / mini["response_mask"].sum()
                    for k, v in micro_stats.items():
                        stats[k] = stats.get(k, 0.0) + (weight if k in LOSS_STATS else share) * v
                stats = reduce(stats)
                grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
                if hasattr(grad_norm, "full_tensor"):  # FSDP2's sharded gradients give a distributed norm
                    grad_norm = grad_norm.full_tensor()
                finite = bool(torch.isfinite(grad_norm))
                if finite:
                    optimizer.step()
                count_skips(skipped, name, finite)
                optimizer.zero_grad(set_to_none=True)
                stats[f"{name}/grad_norm"] = grad_norm.detach()
                stats[f"{name}/skipped_nonfinite_grad"] = torch.tensor(float(not finite))
                per_mini.append(stats)
    return per_mini


def count_skips(skipped: dict[str, int], name: str, finite: bool) -> None:
    """Count ``name``'s updates skipped in a row (a finite one resets the count); raise
    FloatingPointError at ``MAX_SKIPPED_UPDATES``."""
    skipped[name] = 0 if finite else skipped.get(name, 0) + 1
    if skipped[name] >= MAX_SKIPPED_UPDATES:
        raise FloatingPointError(
            f"the last {MAX_SKIPPED_UPDATES} {name} updates were all skipped: the gradient norm was NaN or inf. "
            "Check the scores (critic/score/mean), the learning rate and the loss settings"
        )
