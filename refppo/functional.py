"""Masked statistics and memory-bounded log-probs / entropy from logits.

Shapes: ``values`` and ``mask`` are any matching shape, usually ``(batch, response_len)``;
``logits`` is ``(..., vocab)`` and ``labels`` is ``logits.shape[:-1]``.
"""

from __future__ import annotations

import torch

from refppo.checks import check_same_shape, check_values, value_checks

# Elements (rows x vocab) of float32 scratch per chunk: 4M elements = 16 MiB.
_CHUNK_ELEMENTS = 1 << 22


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1.

    Values outside the mask are replaced by 0 first, so a NaN in padding cannot leak in.

    Args:
        values: (*shape) tensor.
        mask: (*shape) tensor of 0/1.
        axis: reduce this axis only; None reduces everything.

    Returns:
        Scalar, or (*shape without axis) when ``axis`` is given.
    """
    valid = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return (valid * mask).sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (verl: sum / (count + 1e-8)).

    A slice with no valid position gives 0, not NaN.

    Args:
        values: (*shape) tensor.
        mask: (*shape) tensor of 0/1.
        axis: reduce this axis only; None reduces everything.

    Returns:
        Scalar, or (*shape without axis) when ``axis`` is given.
    """
    return masked_sum(values, mask, axis) / (mask.sum(dim=axis) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over all positions where ``mask`` is 1.

    Args:
        values: (*shape) tensor.
        mask: (*shape) tensor of 0/1.
        unbiased: apply Bessel's correction n / (n - 1), as verl does.

    Returns:
        Scalar tensor.

    Raises:
        ValueError: fewer than 2 valid tokens (unbiased) or none (biased).
    """
    check_same_shape(values=values, mask=mask)
    check_values(min_valid=("mask", mask, 2 if unbiased else 1))
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        variance = variance * n / (n - 1)
    return variance


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
        ValueError: mismatched shapes, a mask that is not 0/1, NaN or inf at a valid position,
            fewer than 2 valid positions.

    Returns:
        (*shape) tensor.
    """
    check_same_shape(values=values, mask=mask)
    check_values(masks={"mask": mask}, finite={"values": values}, min_valid=("mask", mask, 2), where=mask)
    with value_checks(False):  # checked above, in one host sync
        mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of a 0/1 mask (0 for a row with none).

    Args:
        mask: (batch, T) 0/1 tensor.

    Returns:
        (batch,) int64 indices.
    """
    positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    return (mask.long() * positions).argmax(dim=-1)


def _scaled(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    z = chunk.float()
    return z if temperature == 1.0 else z / temperature


class _ChunkedLogSoftmax(torch.autograd.Function):
    """log p(label) and (optionally) entropy from logits, one block of rows at a time, in float32.

    Nothing of size rows x vocab is kept between forward and backward: the backward pass
    recomputes the softmax of each block from the saved logits.
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_size, want_entropy):
        flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        n = flat.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        ent = torch.empty(n if want_entropy else 0, dtype=torch.float32, device=logits.device)
        for s in range(0, n, chunk_size):
            z = _scaled(flat[s : s + chunk_size], temperature)
            lse = torch.logsumexp(z, dim=-1)
            logp[s : s + chunk_size] = z.gather(-1, flat_labels[s : s + chunk_size, None]).squeeze(-1) - lse
            if want_entropy:
                ent[s : s + chunk_size] = lse - (torch.exp(z - lse[:, None]) * z).sum(-1)
        ctx.save_for_backward(logits, labels)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        if not want_entropy:
            ctx.mark_non_differentiable(ent)
        return logp.view(labels.shape), ent.view(labels.shape) if want_entropy else ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        logits, labels = ctx.saved_tensors
        t, c = ctx.temperature, ctx.chunk_size
        flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        grad = torch.empty_like(flat)
        g_lp = grad_logp.reshape(-1).float()
        g_en = grad_ent.reshape(-1).float() if grad_ent.numel() else None
        for s in range(0, flat.shape[0], c):
            z = _scaled(flat[s : s + c], t)
            p = torch.softmax(z, dim=-1)
            # d log p_y / dz = onehot(y) - p
            g = p * -g_lp[s : s + c, None]
            g.scatter_add_(-1, flat_labels[s : s + c, None], g_lp[s : s + c, None])
            if g_en is not None:
                # dH / dz = -p * (z - E_p[z])
                mean_z = (p * z).sum(-1, keepdim=True)
                g.addcmul_(p * (z - mean_z), g_en[s : s + c, None], value=-1.0)
            grad[s : s + c] = g if t == 1.0 else g / t
        return grad.view_as(logits), None, None, None, None


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    calculate_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature)[label] (and the entropy), in float32, chunked over rows.

    Peak extra memory is a few chunk x vocab float32 buffers instead of a full
    (..., vocab) float32 log-softmax; gradients flow to ``logits`` (recomputed per chunk).

    Args:
        logits: (..., vocab) tensor, any float dtype.
        labels: (...) int64 token ids.
        temperature: the sampling temperature; logits are divided by it.
        chunk_size: rows per chunk; default keeps a chunk near 4M elements.
        calculate_entropy: also return the entropy (nats) of each softmax, from the same pass.

    Returns:
        (...) float32 log-probabilities; with ``calculate_entropy`` a (log_probs, entropy) pair.
    """
    if logits.dim() < 2 or labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"logits must be (..., vocab) and labels (...): got logits {tuple(logits.shape)}, labels shape {tuple(labels.shape)}"
        )
    if not float(temperature) > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rows = chunk_size if chunk_size is not None else max(1, _CHUNK_ELEMENTS // logits.shape[-1])
    logp, ent = _ChunkedLogSoftmax.apply(logits, labels, float(temperature), rows, calculate_entropy)
    return (logp, ent) if calculate_entropy else logp
