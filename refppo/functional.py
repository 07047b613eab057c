"""Masked statistics and memory-bounded log-probs / entropy from logits.

Shapes: ``values`` and ``mask`` are any matching shape, usually ``(batch, response_len)``;
``logits`` is ``(..., vocab)`` and ``labels`` is ``logits.shape[:-1]``.
"""

from __future__ import annotations

import torch

from refppo.checks import check_same_shape, check_values

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

    Returns:
        (*shape) tensor.
    """
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


def _chunk_rows(vocab: int, chunk_size: int | None) -> int:
    return chunk_size if chunk_size is not None else max(1, _CHUNK_ELEMENTS // vocab)


def _scaled(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    z = chunk.float()
    return z if temperature == 1.0 else z / temperature


class _ChunkedLogSoftmax(torch.autograd.Function):
    """log p(label) and entropy from logits, one block of rows at a time, in float32.

    Nothing of size rows x vocab is kept between forward and backward: the backward pass
    recomputes the softmax of each block from the saved logits.
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_size, want_entropy):
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        flat_labels = labels.reshape(-1) if labels is not None else None
        n = flat.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=logits.device) if labels is not None else None
        ent = torch.empty(n, dtype=torch.float32, device=logits.device) if want_entropy else None
        for s in range(0, n, chunk_size):
            z = _scaled(flat[s : s + chunk_size], temperature)
            lse = torch.logsumexp(z, dim=-1)
            if logp is not None:
                logp[s : s + chunk_size] = z.gather(-1, flat_labels[s : s + chunk_size, None]).squeeze(-1) - lse
            if ent is not None:
                p = torch.exp(z - lse[:, None])
                ent[s : s + chunk_size] = lse - (p * z).sum(-1)
        ctx.save_for_backward(logits, labels)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        shape = logits.shape[:-1]
        return (
            logp.view(shape) if logp is not None else None,
            ent.view(shape) if ent is not None else None,
        )

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        logits, labels = ctx.saved_tensors
        t, c = ctx.temperature, ctx.chunk_size
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        grad = torch.empty_like(flat)
        g_lp = grad_logp.reshape(-1).float() if grad_logp is not None else None
        g_en = grad_ent.reshape(-1).float() if grad_ent is not None else None
        flat_labels = labels.reshape(-1) if labels is not None else None
        for s in range(0, flat.shape[0], c):
            z = _scaled(flat[s : s + c], t)
            p = torch.softmax(z, dim=-1)
            g = torch.zeros_like(z)
            if g_lp is not None:
                # d log p_y / dz = onehot(y) - p
                g.addcmul_(p, g_lp[s : s + c, None], value=-1.0)
                g.scatter_add_(-1, flat_labels[s : s + c, None], g_lp[s : s + c, None])
            if g_en is not None:
                # dH / dz = -p * (z - E_p[z])
                mean_z = (p * z).sum(-1, keepdim=True)
                g.addcmul_(p * (z - mean_z), g_en[s : s + c, None], value=-1.0)
            grad[s : s + c] = g if t == 1.0 else g / t
        return grad.view_as(logits), None, None, None, None


def _check_logits(logits: torch.Tensor, temperature: float, labels: torch.Tensor | None = None) -> None:
    if logits.dim() < 2:
        raise ValueError(f"logits must have shape (..., vocab), got {tuple(logits.shape)}")
    if labels is not None and labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without vocab {tuple(logits.shape[:-1])}"
        )
    if not float(temperature) > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> torch.Tensor:
    """log softmax(logits / temperature)[label], in float32, chunked over rows.

    Peak extra memory is a few chunk x vocab float32 buffers instead of a full
    (..., vocab) float32 log-softmax; gradients flow to ``logits`` (recomputed per chunk).

    Args:
        logits: (..., vocab) tensor, any float dtype.
        labels: (...) int64 token ids.
        temperature: the sampling temperature; logits are divided by it.
        chunk_size: rows per chunk; default keeps a chunk near 4M elements.

    Returns:
        (...) float32 log-probabilities.
    """
    _check_logits(logits, temperature, labels)
    c = _chunk_rows(logits.shape[-1], chunk_size)
    return _ChunkedLogSoftmax.apply(logits, labels, float(temperature), c, False)[0]


def entropy_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> torch.Tensor:
    """Entropy of softmax(logits / temperature), in float32, chunked over rows.

    Args:
        logits: (..., vocab) tensor, any float dtype.
        temperature: the sampling temperature.
        chunk_size: rows per chunk; default keeps a chunk near 4M elements.

    Returns:
        (...) float32 entropies (nats).
    """
    _check_logits(logits, temperature)
    c = _chunk_rows(logits.shape[-1], chunk_size)
    return _ChunkedLogSoftmax.apply(logits, None, float(temperature), c, True)[1]


def logprobs_and_entropy_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both log-probs and entropy in one pass over the logits (see the two functions above).

    Args:
        logits: (..., vocab) tensor.
        labels: (...) int64 token ids.
        temperature: the sampling temperature.
        chunk_size: rows per chunk.

    Returns:
        ((...) float32 log-probs, (...) float32 entropies).
    """
    _check_logits(logits, temperature, labels)
    c = _chunk_rows(logits.shape[-1], chunk_size)
    return _ChunkedLogSoftmax.apply(logits, labels, float(temperature), c, True)
