"""Log-probs and entropies in blocks of rows (``refppo.rollout.forward.response_log_probs``'s numbers, to
float rounding), for vocabularies too large for a whole float32 log-softmax:

- chunked: the logits reduced a block of rows at a time in float32, with a backward pass that
  recomputes each block's softmax; a few blocks of scratch instead of (rows, vocab) float32
  copies and their gradient (memory for time on a CPU, time too on a GPU with large blocks);
- compiled (``actor.use_torch_compile``): each block reduced by one kernel made by
  ``torch.compile`` (two in the backward pass) where the eager code makes several float32
  passes; the first calls compile them;
- fused (``model.use_fused_kernels``): from the final hidden states and the LM head's weight,
  so the (rows, vocab) logits and their gradient never exist whole.

Figures: ``benchmarks/README.md`` (log-probs from logits, compiled log-probs, from the hidden
states, and Q's step on a GPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from refppo.guards.checks import TEMPERATURES, check_number, check_tensors
from refppo.guards.inputs import check_labels, check_log_probs, check_logits
from refppo.rollout.device import trainable_forward
from refppo.rollout.forward import model_inputs, response_logits
from refppo.rollout.models import LoraDisabledReference, adapters_off, base_model

# Elements (rows x vocab) of float32 scratch per block, by device: a CPU gains nothing from larger
# blocks; on a GPU each block costs launches, so larger ones are faster (benchmarks/README.md).
CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}
# From hidden states each block also pays a (rows x H) @ (H x vocab) product, which larger blocks
# keep efficient.
LINEAR_CHUNK_ELEMENTS = 1 << 24


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
        yield (
            s,
            e,
            grad(
                raw_logits(s, e).detach(),
                labels[s:e],
                None if g_lp is None else g_lp[s:e],
                None if g_en is None else g_en[s:e],
                temperature,
                dtype,
            ),
        )


class _ChunkedLogSoftmax(torch.autograd.Function):
    """log p(label) and (optionally) entropy from logits, one block of rows at a time, in float32.

    Nothing of size rows x vocab is kept between forward and backward: the backward pass
    recomputes the softmax of each block from the saved logits.
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_size, want_entropy, compiled):
        flat = logits.reshape(-1, logits.shape[-1])
        flat_labels = labels.reshape(-1)
        logp, ent = _chunked_forward(
            lambda s, e: flat[s:e], flat_labels, chunk_size, want_entropy, temperature, compiled
        )
        ctx.save_for_backward(logits, labels)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.compiled = compiled
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
            lambda s, e: flat[s:e],
            labels.reshape(-1),
            grad_logp,
            grad_ent,
            ctx.temperature,
            ctx.chunk_size,
            ctx.compiled,
            grad.dtype,
        )
        for s, e, g in blocks:
            grad[s:e] = g
        return grad.view_as(logits), None, None, None, None, None


def _head_logits(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype):
    """The head's weight in ``dtype`` (V, H) and ``raw_logits(start, end)``: hidden @ weight.T in
    ``dtype`` for rows start..end-1 of hidden (..., H) flattened."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    w = weight.to(dtype)
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
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.dtype = dtype
        ctx.compiled = compiled
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
            None,
            None,
            None,
            None,
            None,
            None,
        )


def check_chunk_size(chunk_size) -> None:
    """Raise ValueError unless ``chunk_size`` is None (the default block) or a whole number >= 1."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a whole number >= 1, got {chunk_size!r}")


def chunked_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    chunk_size: int | None = None,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`refppo.functional.logprobs_from_logits` (and ``entropy_from_logits``) a block of
    rows at a time: a few blocks of float32 scratch instead of a whole (..., vocab) log-softmax;
    gradients flow to ``logits`` (each block's softmax recomputed in the backward pass).

    Args:
        logits: (..., vocab) tensor, any float dtype.
        labels: (...) int64 token ids.
        temperature: the sampling temperature; logits are divided by it.
        calculate_entropy: also return the entropy (nats) of each softmax, from the same pass.
        chunk_size: rows per block; default keeps a block near ``CHUNK_ELEMENTS["cpu"]`` elements.
        compiled: reduce each block (and form its gradient) in kernels made by ``torch.compile``;
            the results differ from the eager ones in the last bits.

    Returns:
        ((...) float32 log-probabilities, (...) float32 entropies or None).
    """
    check_logits(logits, labels, temperature)
    check_chunk_size(chunk_size)
    vocab = logits.shape[-1]
    in_vocab = labels.where((labels >= 0) & (labels < vocab), 0)  # as in logprobs_from_logits
    rows = chunk_size if chunk_size is not None else max(1, CHUNK_ELEMENTS["cpu"] // vocab)
    logp, ent = _ChunkedLogSoftmax.apply(logits, in_vocab, float(temperature), rows, calculate_entropy, compiled)
    check_log_probs(logp, labels, vocab)
    return logp, ent if calculate_entropy else None


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    chunk_size: int | None = None,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`chunked_logprobs` of ``hidden @ weight.T``, without ever holding those logits.

    Gradients flow to ``hidden`` and ``weight``. Under autocast the products run in the autocast
    dtype, as the LM head's would; the softmax is float32 either way.

    Args:
        hidden: (..., H) final hidden states (after the model's last norm).
        weight: (vocab, H) the LM head's weight (bias-free).
        labels: (...) int64 token ids.
        temperature, calculate_entropy, compiled: as in :func:`chunked_logprobs`.
        chunk_size: rows per block; default keeps a block's logits near ``LINEAR_CHUNK_ELEMENTS``.

    Returns:
        ((...) float32 log-probabilities, (...) float32 entropies or None).
    """
    if (
        weight.dim() != 2
        or hidden.dim() < 2
        or hidden.shape[-1] != weight.shape[1]
        or labels.shape != hidden.shape[:-1]
    ):
        raise ValueError(
            f"hidden must be (..., H), weight (vocab, H) and labels (...): got hidden {tuple(hidden.shape)}, "
            f"weight {tuple(weight.shape)}, labels {tuple(labels.shape)}"
        )
    check_tensors(hidden=hidden, weight=weight, labels=labels)
    check_number("temperature", temperature, TEMPERATURES)
    check_chunk_size(chunk_size)
    for name, t in (("hidden", hidden), ("weight", weight)):
        if t.is_meta:
            raise ValueError(f"{name} is on the meta device: it holds no values to compute with")
    vocab = weight.shape[0]
    check_labels(labels, hidden.shape[:-1], vocab)
    in_vocab = labels.where((labels >= 0) & (labels < vocab), 0)  # as in logprobs_from_logits
    device = hidden.device.type
    autocast = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else torch.promote_types(hidden.dtype, weight.dtype)
    rows = chunk_size if chunk_size is not None else max(1, LINEAR_CHUNK_ELEMENTS // vocab)
    logp, ent = _ChunkedLinearLogSoftmax.apply(
        hidden, weight, in_vocab, float(temperature), rows, calculate_entropy, dtype, compiled
    )
    check_log_probs(logp, labels, vocab)
    return logp, ent if calculate_entropy else None


@dataclass(frozen=True)
class BlockLogProbs:
    """:func:`refppo.rollout.forward.response_log_probs` with its log-softmax in blocks: from the logits
    (:func:`chunked_logprobs`) or, with ``fused``, from the final hidden states
    (:func:`fused_logprobs`; the model must pass :func:`check_fused_kernels`).

    Args:
        compiled: each block through torch.compile's kernels.
        fused: from the hidden states and the LM head's weight.
        chunk_elements: rows x vocab elements per block of logits (not with ``fused``).
    """

    compiled: bool = False
    fused: bool = False
    chunk_elements: int = CHUNK_ELEMENTS["cpu"]

    def __call__(
        self, model, batch: dict[str, torch.Tensor], temperature: float = 1.0, calculate_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log_probs (B, R) float32, entropy (B, R) float32 or None), 0 at padding, with gradients."""
        mask = batch["response_mask"].to(model.device).bool()
        labels = batch["responses"].to(model.device)
        if self.fused:
            with trainable_forward(model.device):
                hidden, weight = final_hidden_states(model, **model_inputs(model, batch))
                hidden = hidden[:, -mask.shape[1] - 1 : -1]
                log_probs, entropy = fused_logprobs(
                    hidden, weight, labels, temperature, calculate_entropy, compiled=self.compiled
                )
        else:
            logits = response_logits(model, batch)
            rows = max(1, self.chunk_elements // logits.shape[-1])
            log_probs, entropy = chunked_logprobs(logits, labels, temperature, calculate_entropy, rows, self.compiled)
        log_probs = log_probs.masked_fill(~mask, 0.0)
        return log_probs, entropy.masked_fill(~mask, 0.0) if calculate_entropy else None


FUSED_KERNEL_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


def check_fused_kernels(model, role: str = "actor") -> None:
    """Refuse ``model.use_fused_kernels`` for a model whose logits are not its bias-free LM
    head applied to the final hidden states (e.g. Gemma 2 soft-caps them, Cohere scales them):
    log-probs computed from the hidden states would silently differ.

    Args:
        model: a causal LM, LoRA actor or reference (``make_reference``).
        role: its name in the error.
    """
    lm = base_model(model)
    model_type = getattr(lm.config, "model_type", None)
    head = lm.get_output_embeddings()
    if model_type not in FUSED_KERNEL_MODEL_TYPES or not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(
            f"model.use_fused_kernels=true computes log-probs from the final hidden states and the LM head's weight, "
            f"which is exact for model types {', '.join(FUSED_KERNEL_MODEL_TYPES)}; the {role} is {model_type!r} "
            f"({type(lm).__name__}): set model.use_fused_kernels=false"
        )


def final_hidden_states(model, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's output without the LM head: what ``model(**inputs).logits`` is computed from.

    Args:
        model: a causal LM, LoRA actor or adapter-disabled reference.
        **inputs: ``input_ids`` (B, T) and the other keyword inputs of a forward pass.

    Returns:
        (hidden (B, T, H) after the final norm, the LM head's weight (vocab, H)); the logits
        are ``hidden @ weight.T`` for the model types in ``FUSED_KERNEL_MODEL_TYPES``.
    """
    if isinstance(model, LoraDisabledReference):
        with adapters_off(model.actor):
            return final_hidden_states(model.actor, **inputs)
    hidden = model.get_decoder()(**inputs).last_hidden_state
    return hidden, model.get_output_embeddings().weight
