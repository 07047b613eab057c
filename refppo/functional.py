"""Masked statistics and memory-bounded log-probs / entropy from logits or from hidden states.

Shapes: ``values`` and ``mask`` are any matching shape, usually ``(batch, response_len)``;
``logits`` is ``(..., vocab)`` and ``labels`` is ``logits.shape[:-1]``.
"""

from __future__ import annotations

import functools

import torch

from refppo.checks import check_same_shape, check_values, value_checks

# Elements (rows x vocab) of float32 scratch per chunk: 4M elements = 16 MiB.
_CHUNK_ELEMENTS = 1 << 22
# From hidden states each chunk also pays a (rows x H) @ (H x vocab) product: larger chunks keep
# it efficient; 16M elements = 64 MiB of float32 logits per chunk.
_LINEAR_CHUNK_ELEMENTS = 1 << 24


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


def masked_corr(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of ``x`` and ``y`` over the positions where ``mask`` is 1.

    verl's ``training/rollout_actor_probs_pearson_corr`` (``torch.corrcoef`` of the masked
    values), without gathering them, so no host sync.

    Args:
        x, y: (*shape) tensors.
        mask: (*shape) tensor of 0/1.

    Returns:
        Scalar tensor in [-1, 1]; NaN when ``x`` or ``y`` is constant over the mask, as
        ``torch.corrcoef`` gives.

    Raises:
        ValueError: shapes differ, or fewer than 2 valid positions.
    """
    check_same_shape(x=x, y=y, mask=mask)
    check_values(min_valid=("mask", mask, 2))
    dx = x - masked_mean(x, mask)
    dy = y - masked_mean(y, mask)
    covariance = masked_mean(dx * dy, mask)
    return (covariance / (masked_mean(dx * dx, mask) * masked_mean(dy * dy, mask)).sqrt()).clamp(-1.0, 1.0)


def masked_max_min(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest and smallest of ``values`` where ``mask`` is 1 (no host sync).

    Args:
        values: (*shape) floating tensor.
        mask: (*shape) tensor of 0/1 with at least one 1.

    Returns:
        (max, min) scalar tensors.

    Raises:
        ValueError: shapes differ, or no valid position.
    """
    check_same_shape(values=values, mask=mask)
    check_values(min_valid=("mask", mask, 1))
    valid = mask.bool()
    return values.masked_fill(~valid, -torch.inf).max(), values.masked_fill(~valid, torch.inf).min()


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


def _scaled(raw: torch.Tensor, temperature: float) -> torch.Tensor:
    z = raw.float()
    return z if temperature == 1.0 else z / temperature


def _chunk_logp_entropy(raw: torch.Tensor, labels: torch.Tensor, temperature: float, want_entropy: bool):
    """One block: raw logits (n, V), any float dtype, and labels (n,) -> log p(label) (n,) and the
    entropy of softmax(raw / temperature) (n,) (None without ``want_entropy``), in float32."""
    z = _scaled(raw, temperature)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, labels[:, None]).squeeze(-1) - lse
    entropy = lse - (torch.exp(z - lse[:, None]) * z).sum(-1) if want_entropy else None
    return logp, entropy


def _chunk_grad(raw, labels, g_lp, g_en, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """One block's d loss / d raw logits (n, V) in ``dtype``, from the gradients (n,) float32 of
    its log-probs and of its entropies, either None when the loss does not use it."""
    z = _scaled(raw, temperature)
    p = torch.softmax(z, dim=-1)
    if g_lp is not None:
        # d log p_y / dz = onehot(y) - p
        g = p * -g_lp[:, None]
        g.scatter_add_(-1, labels[:, None], g_lp[:, None])
    else:
        g = torch.zeros_like(p)
    if g_en is not None:
        # dH / dz = -p * (z - E_p[z])
        mean_z = (p * z).sum(-1, keepdim=True)
        g.addcmul_(p * (z - mean_z), g_en[:, None], value=-1.0)
    return (g if temperature == 1.0 else g / temperature).to(dtype)


@functools.cache
def _compiled_kernels():
    """The two block functions compiled by torch.compile (``compiled=True``): the forward one
    becomes one fused kernel, the gradient two (with the label's scatter between them), where the
    eager ones make several float32 passes over the block. Compiled on first use, once per
    process (shapes are dynamic)."""
    return torch.compile(_chunk_logp_entropy, dynamic=True), torch.compile(_chunk_grad, dynamic=True)


def _kernels(compiled: bool):
    return _compiled_kernels() if compiled else (_chunk_logp_entropy, _chunk_grad)


def _chunked_forward(
    raw_logits, labels: torch.Tensor, chunk_size: int, want_entropy: bool, temperature: float, compiled: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(label) and the entropy of softmax(z / temperature), block by block.
    ``raw_logits(start, end)`` gives the logits of rows start..end-1, (end - start, V).
    labels (N,) -> log-probs (N,), entropies (N,) (or (0,) without ``want_entropy``)."""
    n = labels.shape[0]
    logp = torch.empty(n, dtype=torch.float32, device=labels.device)
    ent = torch.empty(n if want_entropy else 0, dtype=torch.float32, device=labels.device)
    block = _kernels(compiled)[0]
    for s in range(0, n, chunk_size):
        # detached (no gradient flows here anyway): a compiled kernel then serves every block, a
        # view or not, of a trainable model or not, instead of being compiled again for each kind
        lp, h = block(raw_logits(s, s + chunk_size).detach(), labels[s : s + chunk_size], temperature, want_entropy)
        logp[s : s + chunk_size] = lp
        if want_entropy:
            ent[s : s + chunk_size] = h
    return logp, ent


def _chunked_grads(raw_logits, labels, grad_logp, grad_ent, temperature: float, chunk_size: int, compiled: bool, dtype):
    """Yield (start, end, d loss / d logits of rows start..end-1 as (end - start, V) ``dtype``),
    from the gradients of the log-probs and of the entropies, (N,) each, or None (or empty) for
    an output the loss does not use; the softmax of each block is recomputed from
    ``raw_logits`` (as in :func:`_chunked_forward`)."""
    g_lp = grad_logp.reshape(-1).float() if grad_logp is not None else None
    # An entropy logged but not trained on (entropy_coeff 0) costs no backward work.
    g_en = grad_ent.reshape(-1).float() if grad_ent is not None and grad_ent.numel() else None
    grad = _kernels(compiled)[1]
    for s in range(0, labels.shape[0], chunk_size):
        e = s + chunk_size
        yield s, e, grad(
            raw_logits(s, e).detach(), labels[s:e], None if g_lp is None else g_lp[s:e], None if g_en is None else g_en[s:e],
            temperature, dtype,
        )  # fmt: skip


class _ChunkedLogSoftmax(torch.autograd.Function):
    """log p(label) and (optionally) entropy from logits, one block of rows at a time, in float32.

    Nothing of size rows x vocab is kept between forward and backward: the backward pass
    recomputes the softmax of each block from the saved logits.
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_size, want_entropy, compiled):
        flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        logp, ent = _chunked_forward(lambda s, e: flat[s:e], flat_labels, chunk_size, want_entropy, temperature, compiled)
        ctx.save_for_backward(logits, labels)
        ctx.temperature, ctx.chunk_size, ctx.compiled = temperature, chunk_size, compiled
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros
        if not want_entropy:
            ctx.mark_non_differentiable(ent)
        return logp.view(labels.shape), ent.view(labels.shape) if want_entropy else ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        logits, labels = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        grad = torch.empty_like(flat)
        blocks = _chunked_grads(
            lambda s, e: flat[s:e], labels.reshape(-1), grad_logp, grad_ent, ctx.temperature, ctx.chunk_size,
            ctx.compiled, grad.dtype,
        )  # fmt: skip
        for s, e, g in blocks:
            grad[s:e] = g
        return grad.view_as(logits), None, None, None, None, None


def _head_logits(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype):
    """The head's weight in ``dtype`` (V, H) and ``raw_logits(start, end)``: hidden @ weight.T in
    ``dtype`` for rows start..end-1 of hidden (..., H) flattened."""
    flat, w = hidden.reshape(-1, hidden.shape[-1]), weight.to(dtype)
    return w, lambda s, e: flat[s:e].to(dtype) @ w.T


class _ChunkedLinearLogSoftmax(torch.autograd.Function):
    """log p(label) and (optionally) entropy of softmax(hidden @ weight.T / temperature), one
    block of rows at a time: neither the logits nor their gradient ever exist whole.

    Each block's logits are computed in ``dtype`` (the autocast dtype, as the LM head's would
    be), reduced in float32 and dropped; the backward pass recomputes them from the saved hidden
    states and accumulates the weight's gradient block by block in float32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_size, want_entropy, dtype, compiled):
        # ``dtype`` alone decides the products' precision, here as in the backward pass (which
        # runs outside autocast)
        with torch.autocast(hidden.device.type, enabled=False):
            _, logits = _head_logits(hidden, weight, dtype)
            logp, ent = _chunked_forward(logits, labels.reshape(-1), chunk_size, want_entropy, temperature, compiled)
        ctx.save_for_backward(hidden, weight, labels)
        ctx.temperature, ctx.chunk_size, ctx.dtype, ctx.compiled = temperature, chunk_size, dtype, compiled
        ctx.set_materialize_grads(False)
        if not want_entropy:
            ctx.mark_non_differentiable(ent)
        return logp.view(labels.shape), ent.view(labels.shape) if want_entropy else ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, labels = ctx.saved_tensors
        dtype = ctx.dtype
        w, logits = _head_logits(hidden, weight, dtype)
        flat = hidden.reshape(-1, hidden.shape[-1])
        want_h, want_w = ctx.needs_input_grad[:2]
        acc = torch.promote_types(dtype, torch.float32)  # bf16 products are summed in float32
        grad_h = torch.empty_like(flat) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        blocks = _chunked_grads(
            logits, labels.reshape(-1), grad_logp, grad_ent, ctx.temperature, ctx.chunk_size, ctx.compiled, dtype
        )
        for s, e, g in blocks:
            h = flat[s:e].to(dtype)
            if want_h:
                grad_h[s:e] = g @ w
            if want_w and acc == dtype:
                grad_w.addmm_(g.T, h)  # in place: no (vocab, H) temporary
            elif want_w:
                grad_w += g.T @ h  # a (vocab, H) temporary in the compute dtype
        return (
            grad_h.view_as(hidden) if want_h else None,
            grad_w.to(weight.dtype) if want_w else None,
            None, None, None, None, None, None,
        )  # fmt: skip


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    calculate_entropy: bool = False,
    compiled: bool = False,
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
        compiled: reduce each block (and form its gradient) in kernels made by ``torch.compile``
            (verl's ``use_torch_compile``), which read it once where the eager code makes several
            float32 passes over it; the first calls compile them (13 s on a 2-core CPU),
            and the results differ from the eager ones in the last bits.

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
    logp, ent = _ChunkedLogSoftmax.apply(logits, labels, float(temperature), rows, calculate_entropy, compiled)
    return (logp, ent) if calculate_entropy else logp


def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    calculate_entropy: bool = False,
    compiled: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`logprobs_from_logits` of ``hidden @ weight.T``, without ever holding those logits.

    The LM head and the log-softmax fused, a chunk of rows at a time (verl's
    ``use_fused_kernels``): a (..., vocab) logits tensor and its gradient, the largest
    activations of a model with a big vocabulary, are never made whole. Gradients flow to
    ``hidden`` and ``weight``. Under autocast the products run in the autocast dtype, as the
    LM head's would; the softmax is float32 either way.

    Args:
        hidden: (..., H) final hidden states (after the model's last norm).
        weight: (vocab, H) the LM head's weight (bias-free).
        labels: (...) int64 token ids.
        temperature: the sampling temperature; logits are divided by it.
        chunk_size: rows per chunk; default keeps a chunk's logits near 16M elements.
        calculate_entropy: also return the entropy (nats) of each softmax.
        compiled: each block's reduction and gradient compiled, as in :func:`logprobs_from_logits`.

    Returns:
        (...) float32 log-probabilities; with ``calculate_entropy`` a (log_probs, entropy) pair.
    """
    if weight.dim() != 2 or hidden.dim() < 2 or hidden.shape[-1] != weight.shape[1] or labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"hidden must be (..., H), weight (vocab, H) and labels (...): got hidden {tuple(hidden.shape)}, "
            f"weight {tuple(weight.shape)}, labels {tuple(labels.shape)}"
        )
    if not float(temperature) > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    device = hidden.device.type
    autocast = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else torch.promote_types(hidden.dtype, weight.dtype)
    rows = chunk_size if chunk_size is not None else max(1, _LINEAR_CHUNK_ELEMENTS // weight.shape[0])
    logp, ent = _ChunkedLinearLogSoftmax.apply(
        hidden, weight, labels, float(temperature), rows, calculate_entropy, dtype, compiled
    )
    return (logp, ent) if calculate_entropy else logp
