"""Updating a model from an evaluated batch (ch 3, 5): ``ppo_epochs`` x shuffled mini-batches x
micro-batches, one optimiser step per mini-batch with the gradient accumulated over its
micro-batches, for the actor and the critic alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from refppo import distributed
from refppo.distributed import World
from refppo.guards.checks import value_checks
from refppo.losses import agg_loss_weight

# Consecutive skipped updates (non-finite gradient) of one model after which the run stops.
MAX_SKIPPED_UPDATES = 8


@dataclass
class Learner:
    """One trained model, the actor or the critic, and what its updates keep from step to step.

    Attributes:
        name: "actor" or "critic", the stats' prefix.
        model, params, optimizer, schedule: the model, its trained parameters, their optimiser and
            learning-rate schedule.
        skipped_in_a_row: updates skipped in a row for a non-finite gradient.
    """

    name: str
    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    skipped_in_a_row: int = 0


@dataclass
class LossTerm:
    """One term of a micro-batch's loss, logged under its name.

    Attributes:
        value: the term aggregated over the micro-batch (scalar, with its gradient).
        mode: the ``loss_agg_mode`` it was aggregated with, which weighs it into its mini-batch's.
        coefficient: its factor in the loss (0: logged only, never differentiated).
    """

    value: torch.Tensor
    mode: str
    coefficient: float = 1.0


@dataclass
class UpdateSettings:
    """How one update splits the batch, read from the config for each update (a setting changed
    between steps is taken at the next one).

    Attributes:
        epochs: ``ppo_epochs``.
        mini_rows: rows per optimiser step (``ppo_mini_batch_size`` x ``rollout.n``).
        micro_rows: rows per forward pass (``ppo_micro_batch_size_per_gpu``; None: the mini-batch).
        shuffle: each epoch's mini-batches in a fresh order (``shuffle``); else the batch's order.
        seed: the order's seed (``data_loader_seed``), the same at every update.
        grad_clip: the model's gradient clip.
        passes: the forward passes of :mod:`refppo.accel`, whose ``micro_batches`` splits a
            mini-batch (by rows, or by a token budget).
    """

    epochs: int
    mini_rows: int
    micro_rows: int | None
    shuffle: bool
    seed: int
    grad_clip: float
    passes: object


def minibatch_updates(
    batch: dict[str, torch.Tensor],
    learner: Learner,
    settings: UpdateSettings,
    micro_loss: Callable,
    world: World,
) -> list[dict[str, torch.Tensor]]:
    """``settings.epochs`` x mini-batches of ``settings.mini_rows`` rows (:func:`minibatch_rows`)
    x micro-batches; returns one dict of stats per mini-batch.

    Each term of a micro-batch's loss is weighted by its mode's share of the mini-batch
    (:func:`refppo.losses.agg_loss_weight`), so the accumulated gradient is the mini-batch loss's
    gradient exactly, and its logged value the mini-batch's, whatever the modes; the other stats
    (token means) get the micro-batch's share of valid tokens; ``<name>/loss`` is the mini-batch's
    whole loss, the terms with their coefficients (verl's ``_postprocess_output`` in
    ``verl/workers/engine_workers.py``). With several processes each takes
    its share of every mini-batch and the stats are summed over them. An update whose gradient
    norm is not finite is skipped (:func:`count_skips`).

    Args:
        batch: an evaluated batch, B rows (B a multiple of ``settings.mini_rows``).
        learner: the model to update.
        settings: how its update splits the batch.
        micro_loss: micro-batch -> ({name: :class:`LossTerm`}, {name: detached scalar}).
        world: the processes.
    """
    rows = batch["response_mask"].shape[0]
    device = batch["response_mask"].device
    per_mini = []
    with value_checks(False):  # evaluate checked the batch once; no host sync per micro-batch
        for idx in minibatch_rows(rows, settings):
            mini = {k: v[idx.to(device)] for k, v in batch.items()}
            mine = distributed.take_share(mini, world)
            learner.optimizer.zero_grad(set_to_none=True)
            stats: dict[str, torch.Tensor] = {}
            for _, mb in settings.passes.micro_batches(mine, settings.micro_rows):
                terms, micro_stats = micro_loss(mb)
                share = mb["response_mask"].sum() / mini["response_mask"].sum()
                loss = 0.0
                for name, term in terms.items():
                    weight = agg_loss_weight(mb["response_mask"], mini["response_mask"], term.mode)
                    if term.coefficient != 0:  # a logged-only term gets no gradient path
                        loss = loss + term.coefficient * weight * term.value
                    stats[name] = stats.get(name, 0.0) + weight * term.value.detach()
                loss.backward()
                # verl's <role>/loss: the mini-batch's whole loss, its micro-batches' summed
                stats[f"{learner.name}/loss"] = stats.get(f"{learner.name}/loss", 0.0) + loss.detach()
                for k, v in micro_stats.items():
                    stats[k] = stats.get(k, 0.0) + share * v
            stats = distributed.sum_stats(stats, world)
            stats |= optimizer_step(learner, settings.grad_clip)
            per_mini.append(stats)
    return per_mini


def minibatch_rows(rows: int, settings: UpdateSettings) -> list[torch.Tensor]:
    """The rows of an update's mini-batches, in the order they are trained on: verl 0.9's
    ``make_iterator`` (``verl/utils/tensordict_utils.py``) on one process, a DataLoader over the
    row numbers for ``settings.epochs`` epochs. Shuffled, each epoch draws a fresh order from one
    generator seeded with ``settings.seed`` at every update, so two updates of as many rows go
    through the same orders; else every epoch is the batch's order. Several processes take the
    one-process order, each its consecutive share of every mini-batch, so a run's numbers do not
    depend on the process count (verl's ranks each shuffle their own rows, seeded seed + rank).

    Args:
        rows: B, the batch's rows (a multiple of ``settings.mini_rows``).
        settings: the update's epochs, mini-batch rows, shuffle and seed.

    Returns:
        epochs x B / mini_rows index tensors of ``settings.mini_rows`` rows each (int64, on the CPU).
    """
    # torch's DataLoader itself, as verl's: it draws a seed from the generator before each epoch's
    # permutation, and the next epoch's order depends on that draw
    generator = torch.Generator().manual_seed(settings.seed)
    rows_loader = DataLoader(
        torch.arange(rows), batch_size=settings.mini_rows, shuffle=settings.shuffle, generator=generator
    )
    return [idx for _ in range(settings.epochs) for idx in rows_loader]


def optimizer_step(learner: Learner, grad_clip: float) -> dict[str, torch.Tensor]:
    """Clip ``learner``'s accumulated gradient to norm ``grad_clip`` and step its optimiser, or skip the step when the
    gradient's norm is not finite (:func:`count_skips`); returns ``<name>/grad_norm`` and
    ``<name>/skipped_nonfinite_grad`` (scalars)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(learner.params, grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2's sharded gradients give a distributed norm
        grad_norm = grad_norm.full_tensor()
    finite = bool(torch.isfinite(grad_norm))
    if finite:
        learner.optimizer.step()
    count_skips(learner, finite)
    learner.optimizer.zero_grad(set_to_none=True)
    return {
        f"{learner.name}/grad_norm": grad_norm.detach(),
        f"{learner.name}/skipped_nonfinite_grad": torch.tensor(float(not finite)),
    }


def count_skips(learner: Learner, finite: bool) -> None:
    """Count ``learner``'s updates skipped in a row (a finite one resets the count); raise
    FloatingPointError at ``MAX_SKIPPED_UPDATES``."""
    learner.skipped_in_a_row = 0 if finite else learner.skipped_in_a_row + 1
    if learner.skipped_in_a_row >= MAX_SKIPPED_UPDATES:
        raise FloatingPointError(
            f"the last {MAX_SKIPPED_UPDATES} {learner.name} updates were all skipped: the gradient norm was NaN or "
            "inf. Check the scores (critic/score/mean), the learning rate and the loss settings"
        )
