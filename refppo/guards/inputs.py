"""What the math functions accept: the input contracts of :mod:`refppo.functional`,
:mod:`refppo.advantages`, :mod:`refppo.losses`, :mod:`refppo.kl` and :mod:`refppo.rewards`, kept
apart so that those modules read as the formulas. Each check raises ValueError naming the problem
(shape, device, a mask that is not 0/1, NaN or inf where it is read, too few valid tokens) with at
most one host sync; the primitives are in :mod:`refppo.guards.checks`.

Shapes: per-token tensors are response-only, ``(batch, T)``; logits are ``(..., vocab)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refppo.guards.checks import TEMPERATURES, check_ndim, check_number, check_same_shape, check_tensors, check_values


def _check_int(name: str, value, least: int) -> None:
    # cheaper than check_number: a masked reduction runs in the trainer's inner loop
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def check_masked(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None, min_valid: int = 0) -> None:
    """A masked reduction's inputs: one shape and device, the mask 0/1 with at least ``min_valid``
    ones, ``values`` finite where the mask is 1, ``axis`` None or a dimension.

    Args:
        values: (*shape) tensor.
        mask: (*shape) 0/1 tensor.
    """
    check_same_shape(values=values, mask=mask)
    _check_int("min_valid", min_valid, 0)
    if axis is not None and not (isinstance(axis, int) and -values.dim() <= axis < values.dim()):
        raise ValueError(f"axis must be None or an int in [{-values.dim()}, {values.dim()}), got {axis!r}")
    count = ("mask", mask, min_valid) if min_valid else None
    check_values(masks={"mask": mask}, finite={"values": values}, min_valid=count, where=mask)


def check_logits(logits: torch.Tensor, labels: torch.Tensor | None, temperature: float) -> None:
    """Logits of at least 2 dimensions, a temperature in ``TEMPERATURES`` and, unless None, integer
    labels of the logits' shape without the vocabulary (no host sync: the labels' values are
    checked with the result, by :func:`check_log_probs`).

    Args:
        logits: (..., vocab) tensor.
        labels: (...) token ids, or None.
    """
    check_tensors(logits=logits)
    if logits.dim() < 2:
        raise ValueError(f"logits must be (..., vocab), got shape {tuple(logits.shape)}")
    check_number("temperature", temperature, TEMPERATURES)
    if labels is None:
        return
    check_tensors(logits=logits, labels=labels)
    check_labels(labels, logits.shape[:-1], logits.shape[-1])


def check_labels(labels: torch.Tensor, shape: torch.Size, vocab: int) -> None:
    """Integer token ids of ``shape`` (the logits' without the vocabulary) for a vocabulary of
    ``vocab`` (no host sync: whether each id is in [0, vocab) is checked with the result, by
    :func:`check_log_probs`).

    Args:
        labels: (...) token ids.
        shape: the shape they must have.
        vocab: the vocabulary's size.
    """
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"vocab must be a whole number >= 1, got {vocab!r}")
    check_tensors(labels=labels)
    integer = not (labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool)
    if labels.shape != shape or not integer:
        raise ValueError(
            f"labels must be integer token ids of shape {tuple(shape)} (logits' without the vocabulary), "
            f"got {labels.dtype} of shape {tuple(labels.shape)}"
        )


def check_log_probs(picked: torch.Tensor, labels: torch.Tensor, vocab: int) -> None:
    """The value checks of a log-prob function, with one host sync: every label an id in
    [0, vocab), and every picked log-prob finite. The logits themselves are not scanned (a pass
    over the whole vocabulary): NaN or +inf in a row makes its whole log-softmax NaN, and a label
    whose logit is -inf has log-prob -inf, so the small result shows them.

    Args:
        picked: (...) log-probs, computed with each label outside the vocabulary read as id 0.
        labels: (...) the token ids as given.
        vocab: the vocabulary's size.
    """
    check_tensors(picked=picked, labels=labels)
    check_labels(labels, picked.shape, vocab)
    check_values(
        violations={f"labels has an id outside [0, {vocab})": (labels < 0) | (labels >= vocab)},
        finite={"the log-probs picked from the logits": picked},
    )


def work_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype the estimators compute in: float32, or wider if an input is."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _check_discounting(token_level_rewards, response_mask, gamma, **finite) -> torch.dtype:
    check_ndim("token_level_rewards", token_level_rewards, 2)
    check_same_shape(token_level_rewards=token_level_rewards, **finite, response_mask=response_mask)
    check_number("gamma", gamma, "[0, 1]")
    check_values(
        masks={"response_mask": response_mask},
        finite={"token_level_rewards": token_level_rewards, **finite},
        min_valid=("response_mask", response_mask, 2),  # the whitening's unbiased variance
    )
    return work_dtype(token_level_rewards, *finite.values())


def checked_gae_inputs(token_level_rewards, values, response_mask, gamma, lam) -> tuple[torch.Tensor, ...]:
    """GAE's inputs checked (one shape, a 0/1 mask with at least 2 ones, finite rewards and values,
    gamma and lam in [0, 1]) and in one float dtype (:func:`work_dtype`).

    Args:
        token_level_rewards, values, response_mask: (batch, T).

    Returns:
        (rewards, values, mask), each (batch, T).
    """
    check_number("lam", lam, "[0, 1]")
    dtype = _check_discounting(token_level_rewards, response_mask, gamma, values=values)
    return token_level_rewards.to(dtype), values.to(dtype), response_mask.to(dtype)


def checked_return_inputs(token_level_rewards, response_mask, gamma) -> tuple[torch.Tensor, torch.Tensor]:
    """A discounted return's inputs checked as :func:`checked_gae_inputs`', without values.

    Args:
        token_level_rewards, response_mask: (batch, T).

    Returns:
        (rewards, mask), each (batch, T).
    """
    dtype = _check_discounting(token_level_rewards, response_mask, gamma)
    return token_level_rewards.to(dtype), response_mask.to(dtype)


def check_outcome_inputs(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, min_valid: int = 0) -> None:
    """An outcome estimator's inputs: (batch, T) rewards finite, the mask 0/1 of the same shape with at
    least ``min_valid`` ones."""
    _check_int("min_valid", min_valid, 0)
    check_ndim("token_level_rewards", token_level_rewards, 2)
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    check_values(
        masks={"response_mask": response_mask},
        finite={"token_level_rewards": token_level_rewards},
        min_valid=("response_mask", response_mask, min_valid) if min_valid else None,
    )


def group_ids(index: Sequence | torch.Tensor, batch: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Group labels (prompt uids: hashables or a (batch,) tensor) mapped to 0..G-1.

    Returns:
        ((batch,) long ids on ``device``, G).
    """
    if isinstance(index, torch.Tensor) and index.dim() != 1 or not hasattr(index, "__len__"):
        raise ValueError(f"index must be a (batch,) sequence of group labels, got {type(index).__name__}")
    if len(index) != batch:
        raise ValueError(f"index has {len(index)} entries but the batch has {batch} rows")
    if isinstance(index, torch.Tensor):
        if index.is_meta:  # another device is fine (the ids are moved), but meta holds no labels
            raise ValueError("index is on the meta device: it holds no group labels")
        uniq, ids = torch.unique(index, return_inverse=True)
        return ids.to(device), len(uniq)
    lookup: dict = {}
    try:
        ids = [lookup.setdefault(key, len(lookup)) for key in index]
    except TypeError as error:
        raise ValueError(f"index entries must be hashable group labels: {error}") from None
    return torch.tensor(ids, dtype=torch.long, device=device), len(lookup)


def check_score_inputs(scores: torch.Tensor, response_mask: torch.Tensor) -> None:
    """Sequence scores to place on tokens: (batch,) finite scores, a (batch, T) 0/1 mask with a
    valid token in every row."""
    check_ndim("scores", scores, 1)
    check_ndim("response_mask", response_mask, 2)
    check_tensors(scores=scores, response_mask=response_mask)
    if scores.shape[0] != response_mask.shape[0]:
        raise ValueError(f"scores has {scores.shape[0]} rows but response_mask has {response_mask.shape[0]}")
    check_values(
        masks={"response_mask": response_mask},
        finite={"scores": scores},
        min_valid=("the emptiest row of response_mask", response_mask.sum(dim=-1).min(), 1),
    )


def check_loss_inputs(response_mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    """A loss's inputs: every tensor of ``response_mask``'s shape and device, the mask 0/1 with a
    valid token, the tensors finite and ``rollout_is_weights`` >= 0 where the mask is 1.

    Args:
        response_mask: (batch, T) 0/1.
        **tensors: name -> (batch, T) tensor, or None for an absent optional input.
    """
    tensors = {k: v for k, v in tensors.items() if v is not None}
    check_same_shape(response_mask=response_mask, **tensors)
    weights = {k: tensors[k] for k in ("rollout_is_weights",) if k in tensors}
    check_values(
        masks={"response_mask": response_mask},
        finite=tensors,
        min_valid=("response_mask", response_mask, 1),
        where=response_mask,
        nonnegative=weights,  # a negative weight would flip the sign of its token's loss
    )


def check_pair_inputs(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
) -> None:
    """:func:`check_loss_inputs` for a policy loss that compares the new policy with the old.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (batch, T).
        rollout_is_weights: optional (batch, T) weights >= 0.
    """
    tensors = dict(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages)
    check_loss_inputs(response_mask, **tensors, rollout_is_weights=rollout_is_weights)


def clip_bounds(clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None) -> tuple[float, float]:
    """The clip's epsilons below and above 1: ``clip_ratio`` for a side given as None; ValueError
    unless both are in [0, inf) (``clip_ratio`` in [0, 1)). A low of 1 or more puts no lower
    bound on the ratio, as verl allows (CISPO's recipe).

    Returns:
        (low, high) floats.
    """
    check_number("clip_ratio", clip_ratio, "[0, 1)")
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    check_number("clip_ratio_low", low, "[0, inf)")
    check_number("clip_ratio_high", high, "[0, inf)")
    return low, high


def check_kl_update(current_kl: float, n_steps: int) -> None:
    """A KL controller's update: a real KL (k1's batch mean may be below 0) and an int ``n_steps`` >= 1."""
    check_number("current_kl", current_kl, "(-inf, inf)")
    _check_int("n_steps", n_steps, 1)
