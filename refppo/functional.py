"""Masked statistics, and log-probs, entropies and sums of squared probabilities from logits.

Shapes: ``values`` and ``mask`` are any matching shape, usually ``(batch, response_len)``;
``logits`` is ``(..., vocab)`` and ``labels`` is ``logits.shape[:-1]``.
"""

from __future__ import annotations

import torch

from refppo.guards.checks import check_flag, check_ndim, check_same_shape, check_values, checks_once
from refppo.guards.inputs import check_log_probs, check_logits, check_masked


@checks_once
def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1.

    Values outside the mask are replaced by 0 first, so a NaN in padding cannot leak in.

    Args:
        values: (*shape) tensor.
        mask: (*shape) tensor of 0/1.
        axis: reduce this axis only; None reduces everything.

    Returns:
        Scalar, or (*shape without axis) when ``axis`` is given.

    Raises:
        ValueError: mismatched shapes or devices, a mask that is not 0/1, NaN or inf where the
            mask is 1, an axis out of range.
    """
    check_masked(values, mask, axis)
    valid = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return (valid * mask).sum(dim=axis)


@checks_once
def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (verl: sum / (count + 1e-8)).

    A slice with no valid position gives 0, not NaN.

    Args:
        values: (*shape) tensor.
        mask: (*shape) tensor of 0/1.
        axis: reduce this axis only; None reduces everything.

    Returns:
        Scalar, or (*shape without axis) when ``axis`` is given.

    Raises:
        ValueError: as :func:`masked_sum`.
    """
    check_masked(values, mask, axis)
    return masked_sum(values, mask, axis) / (mask.sum(dim=axis) + 1e-8)


@checks_once
def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over all positions where ``mask`` is 1.

    Args:
        values: (*shape) tensor.
        mask: (*shape) tensor of 0/1.
        unbiased: apply Bessel's correction n / (n - 1), as verl does.

    Returns:
        Scalar tensor.

    Raises:
        ValueError: as :func:`masked_sum`, and fewer than 2 valid tokens (unbiased) or none
            (biased).
    """
    check_flag("unbiased", unbiased)
    check_masked(values, mask, min_valid=2 if unbiased else 1)
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        variance = variance * n / (n - 1)
    return variance


@checks_once
def masked_max_min(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest and smallest of ``values`` where ``mask`` is 1.

    Args:
        values: (*shape) floating tensor, finite where ``mask`` is 1.
        mask: (*shape) tensor of 0/1 with at least one 1.

    Returns:
        (max, min) scalar tensors.

    Raises:
        ValueError: shapes differ, no valid position, or a NaN or inf at one.
    """
    check_same_shape(values=values, mask=mask)
    check_values(masks={"mask": mask}, finite={"values": values}, min_valid=("mask", mask, 1), where=mask)
    valid = mask.bool()
    return values.masked_fill(~valid, -torch.inf).max(), values.masked_fill(~valid, torch.inf).min()


@checks_once
def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``values`` to zero mean and unit variance over the mask (verl's masked_whiten).

    ``(values - mean) * rsqrt(var + 1e-8)`` with the unbiased variance; with ``shift_mean=False``
    the mean is added back, so only the scale changes. Masked positions are transformed too
    (they never reach a loss).

    Args:
        values: (*shape) tensor.
        mask: (*shape) tensor of 0/1 with at least 2 ones.
        shift_mean: subtract the mean (True) or keep it (False).

    Raises:
        ValueError: as :func:`masked_sum`, and fewer than 2 valid positions.

    Returns:
        (*shape) tensor.
    """
    check_flag("shift_mean", shift_mean)
    check_masked(values, mask, min_valid=2)
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


@checks_once
def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of a 0/1 mask (0 for a row with none).

    Args:
        mask: (batch, T) 0/1 tensor.

    Returns:
        (batch,) int64 indices.
    """
    check_ndim("mask", mask, 2)
    check_values(masks={"mask": mask})
    positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    return (mask.long() * positions).argmax(dim=-1)


@checks_once
def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[label], in float32.

    Args:
        logits: (..., vocab) tensor, any float dtype.
        labels: (...) int64 token ids.
        temperature: the sampling temperature; logits are divided by it.

    Returns:
        (...) float32 log-probabilities.
    """
    check_logits(logits, labels, temperature)
    vocab = logits.shape[-1]
    # an id outside the vocabulary reads id 0 here and is refused just below, so that the checks
    # of the labels and of the result share one host sync
    in_vocab = labels.where((labels >= 0) & (labels < vocab), 0)
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    picked = log_probs.gather(-1, in_vocab.unsqueeze(-1)).squeeze(-1)
    check_log_probs(picked, labels, vocab)
    return picked


@checks_once
def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy (nats) of softmax(logits / temperature), in float32: logsumexp(z) - E_p[z].

    Args:
        logits: (..., vocab) tensor, any float dtype.
        temperature: the sampling temperature; logits are divided by it.

    Returns:
        (...) float32 entropies.
    """
    check_logits(logits, None, temperature)
    z = logits.float() / temperature
    entropy = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)
    check_values(finite={"logits": entropy})  # NaN or +inf logits, or -inf ones (0 x -inf)
    return entropy


@checks_once
def calculate_sum_pi_squared_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Sum over the vocabulary of the squared probabilities, sum_v pi_v^2 with pi =
    softmax(logits / temperature): what verl 0.9's actor returns as ``sum_pi_squared`` with
    ``actor.calculate_sum_pi_squared=True``, for the optimal token baseline
    (:mod:`refppo.algorithms.verl_advantages`). As verl's
    ``verl.utils.torch_functional.calculate_sum_pi_squared_from_logits``, on logits its engine has
    already divided by the temperature: exp(logsumexp(2 z) - 2 logsumexp(z)), z = logits /
    temperature, which is sum softmax(z)^2 without forming the probabilities. In float32, or the
    logits' dtype if wider.

    Args:
        logits: (..., vocab) tensor, any float dtype.
        temperature: the sampling temperature; logits are divided by it.

    Returns:
        (...) sums, each in [1 / vocab, 1].
    """
    check_logits(logits, None, temperature)
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    sum_pi_squared = torch.exp(torch.logsumexp(2.0 * z, dim=-1) - 2.0 * torch.logsumexp(z, dim=-1))
    check_values(finite={"logits": sum_pi_squared})  # NaN or +inf logits
    return sum_pi_squared
