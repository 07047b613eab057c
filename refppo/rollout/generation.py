"""Sampling responses (ch 5): the prompts through the model once, then one token at a time
with a KV cache, recording each sampled token's log-prob.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from refppo.functional import logprobs_from_logits
from refppo.guards.checks import TEMPERATURES, check_choice, check_ndim, check_number, check_same_shape, checks_once
from refppo.rollout.device import autocast
from refppo.rollout.prompts import position_ids_from_mask, sequence_batch
from refppo.settings.config import LOGPROBS_MODES


def _filter_top_k_top_p(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf. (B, V) -> (B, V)."""
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token while the mass before it is below top_p: the smallest set reaching top_p.
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop_sorted[:, 0] = False  # the most likely token always stays (a top_p below float32's range is 0)
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


@checks_once  # the tokens it samples are in the vocabulary: no host sync per token
def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    do_sample: bool = True,
    uniform: torch.Tensor | None = None,
    logprobs_mode: str = "processed_logprobs",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row and record its log-prob.

    A sampled row's token is the first whose cumulative probability exceeds the row's uniform
    number (inverse-CDF sampling: token v is drawn with its probability). The log-prob recorded is,
    as vLLM's ``logprobs_mode`` says (verl's ``rollout.logprobs_mode``): ``processed_logprobs``
    (verl's default), that of the distribution the token was drawn from, softmax(logits /
    temperature) renormalised over the tokens top-k and top-p kept; ``raw_logprobs``, that of the
    full softmax(logits / temperature), which is what training recomputes. Without top-k and
    top-p, and for a greedy pick, the two are the same.

    Args:
        logits: (B, V) next-token logits.
        temperature: > 0.
        top_k: keep the k most likely tokens; <= 0 keeps all.
        top_p: keep the smallest set of most likely tokens with mass >= top_p; 1 keeps all.
        do_sample: False picks the argmax (greedy, for evaluation).
        uniform: (B,) numbers in [0, 1), one per row; None draws them from torch's generator.
        logprobs_mode: "processed_logprobs" or "raw_logprobs".

    Returns:
        (tokens (B,) int64, log_probs (B,) float32).
    """
    check_choice("logprobs_mode", logprobs_mode, LOGPROBS_MODES)
    scaled = logits.float() / temperature
    if not do_sample:
        tokens = scaled.argmax(dim=-1)
        return tokens, logprobs_from_logits(logits, tokens, temperature)
    kept = _filter_top_k_top_p(scaled, top_k, top_p)
    cdf = kept.softmax(dim=-1).cumsum(dim=-1)
    if uniform is None:
        uniform = torch.rand(cdf.shape[0], device=cdf.device)
    # a token of probability 0 adds nothing to the CDF, so no uniform number lands on it
    target = uniform.to(cdf)[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=cdf.shape[1] - 1)
    filtered = 0 < top_k < logits.shape[-1] or top_p < 1.0
    if logprobs_mode == "processed_logprobs" and filtered:  # the distribution the token was drawn from
        return tokens, kept.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs_from_logits(logits, tokens, temperature)


def row_uniforms(seed: int, step: int, rows: Sequence[int], length: int, stream: int = 0) -> torch.Tensor:
    """The uniform numbers that sample each row's tokens: every row its own stream, seeded by the
    run's seed, the step and the row's index in the whole step's batch, so a row's samples do not
    depend on which other rows share its batch (or its process).

    Args:
        seed: the run's seed.
        step: the training step (or any count that changes between draws).
        rows: the rows' indices in the whole batch.
        length: numbers per row (the longest response).
        stream: separates draws of the same step (training and evaluation, say).

    Returns:
        (len(rows), length) float32 in [0, 1), on the CPU.
    """
    out = torch.empty(len(rows), length)
    for i, row in enumerate(rows):
        # a tuple of ints hashes the same in every process (only str hashing is randomised)
        generator = torch.Generator().manual_seed(hash((seed, step, row, stream)) & (2**63 - 1))
        out[i] = torch.rand(length, generator=generator)
    return out


def _check_generate_inputs(prompts, attention_mask, eos, pad_token_id, max_new_tokens, temperature, top_p, n, uniforms):
    check_ndim("prompts", prompts, 2)
    check_same_shape(prompts=prompts, attention_mask=attention_mask)
    if prompts.shape[0] == 0:
        raise ValueError("no prompts: the prompt batch is empty")
    if pad_token_id in eos:
        raise ValueError(
            f"pad_token_id {pad_token_id} is an EOS id: padding would read as an end of response "
            "(see refppo.rollout.models.prepare_tokenizer)"
        )
    if max_new_tokens < 1 or n < 1:
        raise ValueError(f"max_new_tokens and n must be >= 1, got {max_new_tokens} and {n}")
    check_number("temperature", temperature, TEMPERATURES)
    check_number("top_p", top_p, "(0, 1]")
    mask = attention_mask.long()
    bad = ((mask != 0) & (mask != 1)).any() | (mask.diff(dim=1) < 0).any() | (mask[:, -1] != 1).any()
    if bool(bad):
        raise ValueError("attention_mask must be 0/1 with prompts left-padded (every row ends with a real token)")
    rows = prompts.shape[0] * n
    if uniforms is not None and uniforms.shape != (rows, max_new_tokens):
        raise ValueError(
            f"uniforms must be ({rows}, {max_new_tokens}): one number per row and token, got {tuple(uniforms.shape)}"
        )


def cache_argument(model) -> str:
    """The name under which ``model`` takes its KV cache and returns the updated one: ``cache``
    from transformers 5.24 on (where ``past_key_values`` warns, to be removed in 5.40), else
    ``past_key_values``.

    Args:
        model: a causal LM, or a peft model around one.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


@torch.no_grad()
def generate(
    model,
    prompts: torch.Tensor,
    attention_mask: torch.Tensor,
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    do_sample: bool = True,
    ignore_eos: bool = False,
    n: int = 1,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    logprobs_mode: str = "processed_logprobs",
) -> dict[str, torch.Tensor]:
    """Sample responses token by token with a KV cache, recording each token's log-prob.

    A row stops at its first EOS (the EOS is part of the response and of ``response_mask``);
    later slots hold pad with mask 0 and log-prob 0. Decoding stops once every row has stopped,
    so R <= ``max_new_tokens``.

    Args:
        model: a causal LM (or a model-like decoder from :mod:`refppo.accel.decoding`).
        prompts: (N, P) left-padded prompt ids.
        attention_mask: (N, P) 0/1, 0 on the left padding.
        eos_token_id: one id or several (any of them ends a response).
        pad_token_id: id for response padding; must not be an EOS id.
        max_new_tokens: the longest response.
        temperature, top_k, top_p, do_sample: see :func:`sample_next_token`.
        ignore_eos: fixed-length mode (benchmarks): every response gets ``max_new_tokens``
            valid tokens, EOS or not.
        n: samples per prompt (``rollout.n``); copies of a prompt are adjacent rows.
        generator: random source for sampling, when ``uniforms`` is not given.
        uniforms: (N * n, max_new_tokens) numbers in [0, 1): row i's token t is drawn with
            ``uniforms[i, t]`` (:func:`sample_next_token`; :func:`row_uniforms` makes them).
        logprobs_mode: the log-prob recorded (:func:`sample_next_token`).

    Returns:
        The batch of :mod:`refppo.rollout.prompts` with ``rollout_log_probs`` (B, R) float32,
        ``is_truncated`` (B,) bool (no EOS) and ``index`` (B,) int64 (the prompt each row
        answers), B = N * n rows.
    """
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    _check_generate_inputs(prompts, attention_mask, eos, pad_token_id, max_new_tokens, temperature, top_p, n, uniforms)
    check_choice("logprobs_mode", logprobs_mode, LOGPROBS_MODES)
    device = model.device
    cache_key = cache_argument(model)
    prompts = prompts.to(device).repeat_interleave(n, dim=0)
    prompt_mask = attention_mask.to(device).long().repeat_interleave(n, dim=0)
    rows, width = prompts.shape
    if uniforms is None:
        where = generator.device if generator is not None else None
        uniforms = torch.rand(rows, max_new_tokens, generator=generator, device=where)
    uniforms = uniforms.to(device)
    # the mask and positions of every slot a response can fill
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(rows, max_new_tokens)], dim=1)
    positions = position_ids_from_mask(mask)
    eos_ids = torch.tensor(eos, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    hit_eos = torch.zeros_like(done)
    tokens = []
    valid = []
    log_probs = []
    # 1. prefill: the prompts in one pass, filling the cache; only the last position's logits
    with autocast(device):
        out = model(
            input_ids=prompts,
            attention_mask=prompt_mask,
            position_ids=positions[:, :width],
            use_cache=True,
            logits_to_keep=1,
        )
    for t in range(max_new_tokens):
        # 2. sample a token per row and record its log-prob; a finished row gets pad
        token, logp = sample_next_token(
            out.logits[:, -1], temperature, top_k, top_p, do_sample, uniforms[:, t], logprobs_mode
        )
        tokens.append(token.masked_fill(done, pad_token_id))
        valid.append(~done)
        log_probs.append(logp.masked_fill(done, 0.0))
        hit_eos |= ~done & torch.isin(token, eos_ids)
        # 3. stop at EOS: every row finished (a host sync per token)
        done = done if ignore_eos else hit_eos
        if t == max_new_tokens - 1 or (not ignore_eos and bool(done.all())):
            break
        # 4. append: the sampled tokens through the model, attending to the cache
        end = width + t + 1
        with autocast(device):
            out = model(
                input_ids=tokens[-1][:, None],
                attention_mask=mask[:, :end],
                position_ids=positions[:, end - 1 : end],
                use_cache=True,
                **{cache_key: getattr(out, cache_key)},
            )
    valid = torch.stack(valid, dim=1).long()
    batch = sequence_batch(prompts, prompt_mask, torch.stack(tokens, dim=1), valid)
    return batch | {
        "rollout_log_probs": torch.stack(log_probs, dim=1),
        "is_truncated": ~hit_eos,
        "index": torch.arange(rows // n, device=device).repeat_interleave(n),
    }
