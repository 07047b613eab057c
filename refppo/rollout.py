"""Rollouts (ch 5): sampling responses with their log-probs, and the per-token quantities the
other three models compute for them.

A batch is a dict of tensors on the model's device (B = prompts x ``n``, P = prompt width,
R = response width):

- ``prompts`` (B, P): left-padded prompt ids; ``responses`` (B, R): right-padded with pad;
- ``input_ids``, ``attention_mask``, ``position_ids`` (B, P + R): the full sequences;
- ``response_mask`` (B, R): 1 on every generated token up to and including the first EOS;
- ``rollout_log_probs`` (B, R) float32: log-prob of each sampled token at sampling time;
- ``is_truncated`` (B,) bool: the response never emitted EOS; ``index`` (B,) int64: the
  prompt each row answers (GRPO/RLOO groups).

Position ``P - 1 + t`` of a sequence is the state before response token ``t``: its logits
predict token ``t`` and its value is ``values[:, t]``. The reward model reads its score at
the last valid response token.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from refppo.checks import check_choice, check_ndim, check_same_shape, check_unit_interval
from refppo.functional import last_valid_index, logprobs_from_hidden, logprobs_from_logits

if TYPE_CHECKING:
    from transformers import StaticCache

TRUNCATION_MODES = ("error", "left", "right")


def autocast(device: torch.device):
    """bf16 autocast on CUDA (weights and optimiser stay float32), nothing on the CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def trainable_attention():
    """Every attention kernel but cuDNN's, for a forward pass that may be backpropagated.

    cuDNN's attention backward (torch 2.11 to 2.13, H100 and H200) returns NaN query gradients
    when a mask is passed and the sequence is 64 tokens past a multiple of 128 wide, if a query
    row attends to nothing (pytorch/pytorch#196678): the left padding of a ragged batch is such a
    row. Flash and memory-efficient attention take its place; on a CPU the choice is unchanged.
    Activation checkpointing recomputes a layer's forward in the backward pass, outside
    :func:`trainable_forward`, so ``refppo.models.enable_gradient_checkpointing`` enters this
    context for the recomputation too.
    """
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@contextlib.contextmanager
def trainable_forward(device: torch.device) -> Iterator[None]:
    """The context of a forward pass that may be backpropagated: :func:`autocast` and
    :func:`trainable_attention`."""
    with autocast(device), trainable_attention():
        yield


DECODE_ATTENTION = "refppo_grouped_decode"


def grouped_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA whose one-token queries attend to the key/value heads in place, without copying them.

    transformers' SDPA path copies each key/value head to the query heads of its group
    (``repeat_kv``) whenever a mask is passed and the code is compiled (and on transformers before
    5.23 always): for a decoding step that is the whole KV cache, copied and read again in every
    layer. Here the ``G`` query heads of a group become ``G`` query rows of their key/value head,
    so the cache is read once; attention is the same arithmetic. Any other call (a prompt, a
    training pass, no groups, a position bias, or no mask, where transformers lets SDPA broadcast
    the heads itself) goes to transformers' SDPA function unchanged.

    Args:
        module: the attention layer (``num_key_value_groups`` = G = Hq / Hkv).
        query: (B, Hq, 1, D); key, value: (B, Hkv, S, D).
        attention_mask: (B, 1, 1, S) bool (True = attend) or additive float, or None.
        dropout, scaling, **kwargs: as transformers' attention functions take them.

    Returns:
        (B, 1, Hq, D) attention output and None (no attention weights).
    """
    groups = getattr(module, "num_key_value_groups", 1)
    one_mask = attention_mask is not None and attention_mask.shape[1] == 1
    if query.shape[2] != 1 or groups == 1 or not one_mask or kwargs.get("position_bias") is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    batch, heads, _, dim = query.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, heads // groups, groups, dim), key, value,
        attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
    )  # fmt: skip
    return out.reshape(batch, heads, 1, out.shape[-1]).transpose(1, 2).contiguous(), None


@functools.cache
def _register_decode_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, grouped_decode_attention)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def decode_attention(model) -> Iterator[None]:
    """While decoding: a model that runs SDPA attends with :func:`grouped_decode_attention`.

    The switch is the model's ``config._attn_implementation`` (which compiled steps are keyed
    on), restored on exit; a model that runs another attention (eager, flash) is left alone.
    """
    config = getattr(model, "config", None)  # None: an adapter-disabled reference
    saved = getattr(config, "_attn_implementation", None)
    if saved != "sdpa":
        yield
        return
    _register_decode_attention()
    config._attn_implementation = DECODE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = saved


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token-id lists into a left-padded batch.

    Args:
        sequences: N lists of token ids, each non-empty.
        pad_token_id: the id written into padding.

    Returns:
        (input_ids (N, L) int64, attention_mask (N, L) int64), L the longest length.
    """
    if len(sequences) == 0:
        raise ValueError("no prompts: the prompt list is empty")
    for i, seq in enumerate(sequences):
        if len(seq) == 0:
            raise ValueError(f"sequence {i} has no tokens")
    width = max(len(s) for s in sequences)
    # One tensor from Python lists: a copy per row costs more than the tokens on a tiny model.
    ids = torch.tensor([[pad_token_id] * (width - len(s)) + list(s) for s in sequences], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], dtype=torch.long)
    return ids, mask


def prompt_problem(prompt, tokenizer=None) -> str | None:
    """Why ``prompt`` cannot be a prompt, or None. A prompt is a text, or a chat: a non-empty list
    of ``{"role": str, "content": str}`` messages (verl's data format), which needs a tokenizer
    with a chat template (checked when ``tokenizer`` is given)."""
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, dict):
        return "is one message, not a chat: a chat is a list of messages"
    if not isinstance(prompt, (list, tuple)) or not prompt or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    ):
        return 'is neither a text nor a chat (a non-empty list of {"role": ..., "content": ...} messages, strings)'
    if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        return "is a chat, but the tokenizer has no chat template to render it"
    return None


def encode_prompts(tokenizer, prompts: Sequence) -> list[list[int]]:
    """The token ids of each prompt, as verl's rollout builds them.

    A text is encoded with the tokenizer's special tokens (a BOS where the tokenizer adds one). A
    chat is rendered by the tokenizer's chat template with the assistant's turn opened
    (``add_generation_prompt=True``), then encoded without adding special tokens: the template
    writes its own, and adding them again would double the BOS of Llama-style tokenizers.

    Args:
        tokenizer: a Hugging Face tokenizer; chats need its ``chat_template``.
        prompts: N texts or chats (see :func:`prompt_problem`), in any mix.

    Returns:
        N lists of token ids.
    """
    for i, prompt in enumerate(prompts):
        if (problem := prompt_problem(prompt, tokenizer)) is not None:
            raise ValueError(f"prompt {i} {problem}")
    chats = [not isinstance(p, str) for p in prompts]
    render = functools.partial(tokenizer.apply_chat_template, add_generation_prompt=True, tokenize=False)
    texts = [render(list(p)) if chat else p for p, chat in zip(prompts, chats)]
    ids: list[list[int]] = [[] for _ in prompts]
    for chat in (False, True):  # one tokenizer call for the texts, one for the chats
        rows = [i for i, c in enumerate(chats) if c == chat]
        if rows:
            for i, seq in zip(rows, tokenizer([texts[i] for i in rows], add_special_tokens=not chat)["input_ids"]):
                ids[i] = seq
    return ids


def tokenize_prompts(
    tokenizer, prompts: Sequence, max_prompt_length: int | None = None, truncation: str = "error"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize prompts into a left-padded batch (texts with the tokenizer's special tokens, chats
    through its chat template: :func:`encode_prompts`).

    Args:
        tokenizer: a tokenizer prepared by ``refppo.models.prepare_tokenizer``.
        prompts: N texts or chats.
        max_prompt_length: longest allowed prompt in tokens; None for no limit.
        truncation: what a longer prompt gets (verl's ``data.truncation``): "error", or keep
            its "left" part, or its "right" part (the end, next to the response).

    Returns:
        (input_ids (N, L) int64, attention_mask (N, L) int64).
    """
    check_choice("truncation", truncation, TRUNCATION_MODES)
    if isinstance(prompts, str):
        raise ValueError("prompts must be a list of texts, got one string")
    if len(prompts) == 0:
        raise ValueError("no prompts: the prompt list is empty")
    ids = encode_prompts(tokenizer, prompts)
    if max_prompt_length is not None:
        for i, seq in enumerate(ids):
            if len(seq) > max_prompt_length:
                if truncation == "error":
                    raise ValueError(
                        f"prompt {i} has {len(seq)} tokens, more than max_prompt_length={max_prompt_length} "
                        "(raise the limit or set truncation to 'left' or 'right')"
                    )
                ids[i] = seq[:max_prompt_length] if truncation == "left" else seq[-max_prompt_length:]
    return left_pad(ids, tokenizer.pad_token_id)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only attended tokens, so left padding does not shift them.

    Args:
        attention_mask: (B, L) 0/1.

    Returns:
        (B, L) int64: 0 for the first real token of each row (and for the padding before it).
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def _sequence_batch(prompts, prompt_mask, responses, response_mask) -> dict[str, torch.Tensor]:
    """The batch layout's sequence tensors from left-padded prompts and right-padded responses."""
    full_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": full_mask,
        "position_ids": position_ids_from_mask(full_mask),
        "response_mask": response_mask,
    }


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
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    do_sample: bool = True,
    generator: torch.Generator | None = None,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row and its log-prob under softmax(logits / temperature).

    The log-prob is that of the full temperature-scaled distribution, which is what training
    recomputes; top-k / top-p only restrict which tokens can be drawn (as in verl with vLLM).

    Args:
        logits: (B, V) next-token logits.
        temperature: > 0.
        top_k: keep the k most likely tokens; <= 0 keeps all.
        top_p: keep the smallest set of most likely tokens with mass >= top_p; 1 keeps all.
        do_sample: False picks the argmax (greedy, for evaluation).
        generator: random source for sampling.
        compiled: the log-prob from torch.compile's fused kernels
            (:func:`refppo.functional.logprobs_from_logits`).

    Returns:
        (tokens (B,) int64, log_probs (B,) float32).
    """
    scaled = logits.float() / temperature
    if do_sample:
        probs = _filter_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    else:
        tokens = scaled.argmax(dim=-1)
    return tokens, logprobs_from_logits(logits, tokens, temperature, compiled=compiled)


def _check_generate_inputs(prompts, attention_mask, eos, pad_token_id, max_new_tokens, temperature, top_p, n):
    check_ndim("prompts", prompts, 2)
    check_same_shape(prompts=prompts, attention_mask=attention_mask)
    if prompts.shape[0] == 0:
        raise ValueError("no prompts: the prompt batch is empty")
    if pad_token_id in eos:
        raise ValueError(
            f"pad_token_id {pad_token_id} is an EOS id: padding would read as an end of response "
            "(see refppo.models.prepare_tokenizer)"
        )
    if max_new_tokens < 1 or n < 1:
        raise ValueError(f"max_new_tokens and n must be >= 1, got {max_new_tokens} and {n}")
    if not float(temperature) > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    check_unit_interval("top_p", top_p)
    if top_p == 0:
        raise ValueError("top_p must be > 0")
    mask = attention_mask.long()
    bad = ((mask != 0) & (mask != 1)).any() | (mask.diff(dim=1) < 0).any() | (mask[:, -1] != 1).any()
    if bool(bad):
        raise ValueError(
            "attention_mask must be 0/1 with prompts left-padded (every row ends with a real token)"
        )


@functools.cache
def _static_cache_class() -> type:
    from transformers import StaticCache  # here: importing refppo.config must not load transformers

    class SameDtypeStaticCache(StaticCache):
        """Under bf16 autocast the keys leave the rotary embedding in float32 and the values are
        bf16; a static cache holds one dtype, so keys are stored as the values' dtype, which is
        what attention casts them to anyway."""

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(key_states.to(value_states.dtype), value_states, layer_idx, *args, **kwargs)

    return SameDtypeStaticCache


class StaticDecoder:
    """A decoding step over a static KV cache, compiled so that it replays as a CUDA graph.

    Decoding one token is a few hundred small kernels; launched one by one from Python they,
    not the arithmetic, set the pace on a GPU. ``torch.compile(mode="reduce-overhead")``
    records the step once per batch shape and replays it; the cache keeps its buffers (reset,
    not reallocated) so the recorded addresses stay valid. The step reads the weights
    in place, so optimiser updates are seen. Built once per model (the trainer keeps one).

    Args:
        model: the causal LM that generates.
        compile: False runs the same static-cache step eagerly (what the CPU tests check).
    """

    def __init__(self, model, compile: bool = True):
        self.model = model
        self.step = torch.compile(model, mode="reduce-overhead", dynamic=False) if compile else model
        self._caches: dict[tuple[int, int], "StaticCache"] = {}

    def cache(self, rows: int, length: int) -> StaticCache:
        """An empty static cache of ``length`` slots for ``rows`` sequences, reused per shape."""
        cache = self._caches.get((rows, length))
        if cache is None:
            cache = self._caches[rows, length] = _static_cache_class()(config=self.model.config, max_cache_len=length)
        else:
            cache.reset()
        return cache


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
    decoder: StaticDecoder | None = None,
    compiled: bool = False,
) -> dict[str, torch.Tensor]:
    """Sample responses token by token with a KV cache, recording each token's log-prob.

    A row stops at its first EOS (the EOS is part of the response and of ``response_mask``);
    later slots hold pad with mask 0 and log-prob 0. Decoding stops early once every row has
    stopped, so R <= ``max_new_tokens``. Attention runs under :func:`decode_attention`: a
    decoding step reads the KV cache's key/value heads in place.

    Args:
        model: a causal LM (or the reference view of a LoRA actor).
        prompts: (N, P) left-padded prompt ids.
        attention_mask: (N, P) 0/1, 0 on the left padding.
        eos_token_id: one id or several (any of them ends a response).
        pad_token_id: id for response padding; must not be an EOS id.
        max_new_tokens: the longest response.
        temperature, top_k, top_p, do_sample: see :func:`sample_next_token`.
        ignore_eos: fixed-length mode (benchmarks): every response gets ``max_new_tokens``
            valid tokens, EOS or not.
        n: samples per prompt (``rollout.n``); copies of a prompt are adjacent rows.
        generator: random source for sampling.
        decoder: a :class:`StaticDecoder` of ``model`` (a static KV cache, each decoding step
            replayed from a CUDA graph); None decodes eagerly with a growing cache.
        compiled: the sampled tokens' log-probs from torch.compile's fused kernels.

    Returns:
        The batch dict described in the module docstring, B = N * n rows.
    """
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    _check_generate_inputs(prompts, attention_mask, eos, pad_token_id, max_new_tokens, temperature, top_p, n)
    if decoder is not None and decoder.model is not model:
        raise ValueError("the decoder was built for another model: build a StaticDecoder of the model that generates")
    device = model.device
    prompts = prompts.to(device).repeat_interleave(n, dim=0)
    prompt_mask = attention_mask.to(device).long().repeat_interleave(n, dim=0)
    eos_ids = torch.tensor(eos, device=device)
    batch = prompts.shape[0]

    width = prompts.shape[1]
    # Masks and positions of every slot a response can fill, so no step allocates or syncs.
    full_mask = torch.cat([prompt_mask, prompt_mask.new_ones(batch, max_new_tokens)], dim=1)
    positions = position_ids_from_mask(full_mask)
    slots = torch.arange(width + max_new_tokens, device=device)
    if decoder is None:
        cache, step_model = None, model
    else:
        cache, step_model = decoder.cache(batch, width + max_new_tokens), decoder.step

    def inputs(start: int, end: int) -> dict:
        """Mask, positions (and, for a static cache, its slots) for the tokens at start..end-1."""
        if decoder is None:
            return dict(attention_mask=full_mask[:, :end], position_ids=positions[:, start:end])
        # A static cache attends over all its slots; the causal mask hides the unwritten ones.
        return dict(attention_mask=full_mask, position_ids=positions[:, start:end], cache_position=slots[start:end])

    # A host sync per token stalls a GPU: there, check for "all finished" every 8 tokens.
    check_every = 1 if device.type == "cpu" else 8
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    hit_eos = torch.zeros_like(done)
    tokens, valid, log_probs = [], [], []
    cache_key = cache_argument(model)
    with decode_attention(model), autocast(device):
        out = model(input_ids=prompts, use_cache=True, logits_to_keep=1, **{cache_key: cache}, **inputs(0, width))
    for step in range(max_new_tokens):
        token, logp = sample_next_token(out.logits[:, -1], temperature, top_k, top_p, do_sample, generator, compiled)
        is_valid = ~done
        token = token.masked_fill(done, pad_token_id)
        tokens.append(token)
        valid.append(is_valid)
        log_probs.append(logp.masked_fill(done, 0.0))
        hit_eos |= is_valid & torch.isin(token, eos_ids)
        if not ignore_eos:
            done = hit_eos
        if step == max_new_tokens - 1 or (not ignore_eos and (step + 1) % check_every == 0 and bool(done.all())):
            break
        # Finished rows keep decoding pad; their outputs are discarded.
        with decode_attention(model), autocast(device):
            out = step_model(
                input_ids=token[:, None], use_cache=True, **{cache_key: getattr(out, cache_key)},
                **inputs(width + step, width + step + 1),
            )  # fmt: skip

    valid = torch.stack(valid, dim=1)
    # Steps after every row finished (between two checks) hold only padding: drop them.
    keep = int(valid.any(dim=0).sum())
    tokens, log_probs = torch.stack(tokens, dim=1)[:, :keep], torch.stack(log_probs, dim=1)[:, :keep]
    batch = _sequence_batch(prompts, prompt_mask, tokens, valid[:, :keep].long())
    return batch | {
        "rollout_log_probs": log_probs,
        "is_truncated": ~hit_eos,
        "index": torch.arange(prompts.shape[0] // n, device=device).repeat_interleave(n),
    }


def micro_batches(batch: dict[str, torch.Tensor], micro_batch_size: int | None) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive row slices of a batch dict (every tensor sliced on dim 0).

    Args:
        batch: dict of tensors with a common first dimension B.
        micro_batch_size: rows per slice; None for the whole batch in one.

    Yields:
        dicts of the same keys with at most ``micro_batch_size`` rows.
    """
    rows = next(iter(batch.values())).shape[0]
    size = rows if micro_batch_size is None else micro_batch_size
    if size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    for start in range(0, rows, size):
        yield {k: v[start : start + size] for k, v in batch.items()}


def trim_padding(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch without the columns that are padding in every row: the prompts' common left
    padding and the responses' common right padding. A model's outputs on the valid tokens do
    not change (padding is masked out of attention), only the cost of computing them.

    Args:
        batch: a rollout batch (``prompts`` (B, P), ``responses`` (B, R), the full-sequence
            tensors (B, P + R), per-token tensors (B, R), per-row tensors (B,)).

    Returns:
        the same keys with P and R cut to the longest prompt and response in the batch.
    """
    width_p = batch["prompts"].shape[1]
    longest_prompt = int(batch["attention_mask"][:, :width_p].sum(-1).max())
    return _cut(batch, longest_prompt, max(int(batch["response_mask"].sum(-1).max()), 1))


def _cut(batch: dict[str, torch.Tensor], prompt_keep: int, response_keep: int) -> dict[str, torch.Tensor]:
    """The batch with its prompts cut to their last ``prompt_keep`` columns and its responses to
    their first ``response_keep`` (what :func:`trim_padding` keeps)."""
    width_p, width_r = batch["prompts"].shape[1], batch["responses"].shape[1]
    cut, keep = width_p - prompt_keep, response_keep
    out = {}
    for key, value in batch.items():
        if key == "prompts":
            out[key] = value[:, cut:]
        elif value.dim() >= 2 and value.shape[1] == width_p + width_r:
            out[key] = value[:, cut : width_p + keep]
        elif value.dim() >= 2 and value.shape[1] == width_r:
            out[key] = value[:, :keep]
        else:
            out[key] = value
    return out


def token_budget_micro_batches(batch: dict[str, torch.Tensor], max_tokens: int) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Rows grouped into micro-batches of at most ``max_tokens`` tokens each, padding included,
    each trimmed of its all-padding columns (verl's ``use_dynamic_bsz`` with
    ``ppo_max_token_len_per_gpu``, for a model that runs on padded rectangles).

    Rows are taken longest first, and a micro-batch grows while rows x (longest prompt + longest
    response) stays within the budget, so rows of similar length share a micro-batch and little
    compute goes to padding: a budget bounds activation memory whatever the lengths.

    Args:
        batch: a rollout batch (see :func:`trim_padding`).
        max_tokens: the most (rows x width) tokens in one micro-batch.

    Returns:
        [(row indices (b,) int64, micro-batch dict)], every row in exactly one micro-batch.

    Raises:
        ValueError: a single row has more than ``max_tokens`` tokens.
    """
    width_p = batch["prompts"].shape[1]
    prompt_len = batch["attention_mask"][:, :width_p].sum(-1).tolist()
    response_len = batch["response_mask"].sum(-1).clamp(min=1).tolist()
    order = sorted(range(len(prompt_len)), key=lambda i: -(prompt_len[i] + response_len[i]))
    groups, widths = [[]], [(0, 0)]  # each group's rows and its longest (prompt, response)
    for i in order:
        grown = (max(widths[-1][0], prompt_len[i]), max(widths[-1][1], response_len[i]))
        if groups[-1] and (len(groups[-1]) + 1) * sum(grown) > max_tokens:
            groups.append([])
            widths.append((0, 0))
            grown = (prompt_len[i], response_len[i])
        if sum(grown) > max_tokens:
            raise ValueError(f"row {i} has {sum(grown)} tokens, more than the micro-batch budget of {max_tokens}")
        groups[-1].append(i)
        widths[-1] = grown
    device = batch["response_mask"].device
    indices = [torch.tensor(sorted(g), dtype=torch.long, device=device) for g in groups]
    # The widths are known on the host already: cut without reading the masks again (no host sync).
    return [(idx, _cut({k: v[idx] for k, v in batch.items()}, *width)) for idx, width in zip(indices, widths)]


def split_micro_batches(
    batch: dict[str, torch.Tensor], micro_batch_size: int | None = None, max_tokens: int | None = None
) -> list[tuple[torch.Tensor | None, dict[str, torch.Tensor]]]:
    """A batch in micro-batches of ``micro_batch_size`` rows (consecutive, untrimmed; index None)
    or, with ``max_tokens``, of a token budget (:func:`token_budget_micro_batches`).

    Returns:
        [(row indices (b,) or None, micro-batch dict)].
    """
    if max_tokens is None:
        return [(None, mb) for mb in micro_batches(batch, micro_batch_size)]
    if micro_batch_size is not None:
        raise ValueError(f"a micro-batch is {micro_batch_size} rows or {max_tokens} tokens, not both")
    return token_budget_micro_batches(batch, max_tokens)


def _per_row(fn, batch: dict[str, torch.Tensor], micro_batch_size: int | None, max_tokens: int | None) -> list[torch.Tensor]:
    """``fn(micro_batch) -> [(b,) or (b, r) tensors]`` over the micro-batches, put back in the
    batch's row order and response width (zeros in trimmed columns)."""
    parts = split_micro_batches(batch, micro_batch_size, max_tokens)
    if max_tokens is None:
        return [torch.cat(p) for p in zip(*(fn(mb) for _, mb in parts))]
    rows, width = batch["response_mask"].shape
    outs = None
    for idx, mb in parts:
        results = fn(mb)
        if outs is None:
            outs = [r.new_zeros((rows, width) if r.dim() == 2 else (rows,)) for r in results]
        for out, r in zip(outs, results):
            if r.dim() == 2:
                out[idx, : r.shape[1]] = r
            else:
                out[idx] = r
    return outs


def _inputs(model, batch: dict[str, torch.Tensor]) -> dict:
    device = model.device
    return dict(
        input_ids=batch["input_ids"].to(device),
        attention_mask=batch["attention_mask"].to(device),
        position_ids=batch["position_ids"].to(device),
        use_cache=False,
    )


def _forward(model, batch: dict[str, torch.Tensor], **kwargs):
    with trainable_forward(model.device):
        return model(**_inputs(model, batch), **kwargs)


def response_log_probs(
    model,
    batch: dict[str, torch.Tensor],
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    fused: bool = False,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward pass: log-probs (and entropies) of the response tokens, with gradients.

    Args:
        model: a causal LM.
        batch: needs ``input_ids``, ``attention_mask``, ``position_ids``, ``responses``,
            ``response_mask``.
        temperature: the rollout's temperature.
        calculate_entropy: also return the entropy of each next-token distribution.
        fused: compute them from the final hidden states and the LM head's weight a chunk at a
            time, never holding the (B, R, vocab) logits (``model.use_fused_kernels``; the
            model must pass :func:`refppo.models.check_fused_kernels`).
        compiled: reduce the logits with torch.compile's fused kernels (``actor.use_torch_compile``;
            :func:`refppo.functional.logprobs_from_logits`).

    Returns:
        (log_probs (B, R) float32, entropy (B, R) float32 or None), 0 at padding.
    """
    mask = batch["response_mask"].to(model.device).bool()
    width = mask.shape[1]
    labels = batch["responses"].to(model.device)
    # positions P-1 .. P+R-2 predict response tokens 0 .. R-1.
    if fused:
        from refppo.models import final_hidden_states

        with trainable_forward(model.device):
            hidden, weight = final_hidden_states(model, **_inputs(model, batch))
            hidden = hidden[:, -width - 1 : -1]
            out = logprobs_from_hidden(hidden, weight, labels, temperature, calculate_entropy=calculate_entropy, compiled=compiled)
    else:
        # The positions as an index tensor, not a count: the head then reads a contiguous copy of
        # them, not a strided slice, whose matrix-product path torch picks by the weight's
        # requires_grad; some BLAS kernels (MKL's AVX2 ones) round the two paths differently, and
        # a trainable actor and its frozen reference would then differ at step 0.
        length = batch["input_ids"].shape[1]
        keep = torch.arange(length - width - 1, length - 1, device=model.device)
        logits = _forward(model, batch, logits_to_keep=keep).logits
        out = logprobs_from_logits(logits, labels, temperature, calculate_entropy=calculate_entropy, compiled=compiled)
    log_probs, entropy = out if calculate_entropy else (out, None)
    return log_probs.masked_fill(~mask, 0.0), entropy.masked_fill(~mask, 0.0) if calculate_entropy else None


def response_values(critic, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One forward pass of a scalar-head model: the value of the state before each response token.

    Args:
        critic: a model from ``refppo.models.load_value_model``.
        batch: needs ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask``.

    Returns:
        (B, R) float32 values, 0 at padding, with gradients.
    """
    mask = batch["response_mask"].to(critic.device).bool()
    width = mask.shape[1]
    values = _forward(critic, batch).logits[:, -width - 1 : -1, 0].float()
    return values.masked_fill(~mask, 0.0)


@torch.no_grad()
def compute_log_probs(
    model,
    batch: dict[str, torch.Tensor],
    temperature: float = 1.0,
    micro_batch_size: int | None = None,
    calculate_entropy: bool = False,
    max_tokens: int | None = None,
    fused: bool = False,
    compiled: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Old or reference log-probs of the responses, micro-batched, without gradients.

    Args:
        model: the actor (old log-probs) or the reference.
        batch: a rollout batch.
        temperature: the rollout's temperature.
        micro_batch_size: rows per forward pass (bounds activation memory); None for all.
        calculate_entropy: also return entropies.
        max_tokens: instead of ``micro_batch_size``, a token budget per forward pass
            (:func:`token_budget_micro_batches`).
        fused: from the final hidden states, without whole logits (see :func:`response_log_probs`).
        compiled: with torch.compile's fused kernels (see :func:`response_log_probs`).

    Returns:
        (B, R) float32 log-probs, 0 at padding; with ``calculate_entropy`` a (log_probs,
        entropy) pair.
    """
    def fn(mb):
        return [t for t in response_log_probs(model, mb, temperature, calculate_entropy, fused, compiled) if t is not None]

    parts = _per_row(fn, batch, micro_batch_size, max_tokens)
    return tuple(parts) if calculate_entropy else parts[0]


@torch.no_grad()
def compute_values(
    critic, batch: dict[str, torch.Tensor], micro_batch_size: int | None = None, max_tokens: int | None = None
) -> torch.Tensor:
    """The critic's values of a rollout, micro-batched, without gradients.

    Args:
        critic: a scalar-head model.
        batch: a rollout batch.
        micro_batch_size: rows per forward pass; None for all.
        max_tokens: instead of ``micro_batch_size``, a token budget per forward pass.

    Returns:
        (B, R) float32 values, ``values[:, t]`` = V(state before response token t), 0 at padding.
    """
    return _per_row(lambda mb: [response_values(critic, mb)], batch, micro_batch_size, max_tokens)[0]


def response_scores(reward_model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One forward pass of a scalar-head model: the score at each row's last valid response token.

    Args:
        reward_model: a scalar-head model.
        batch: needs ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask``;
            every row needs a valid response token.

    Returns:
        (B,) float32 scores, with gradients.
    """
    mask = batch["response_mask"].to(reward_model.device)
    if bool((mask.sum(dim=-1) == 0).any()):
        raise ValueError("a response has no valid token: the reward model has nothing to score")
    out = _forward(reward_model, batch).logits[:, -mask.shape[1] :, 0].float()
    return out.gather(1, last_valid_index(mask)[:, None]).squeeze(1)


@torch.no_grad()
def compute_scores(reward_model, batch: dict[str, torch.Tensor], micro_batch_size: int | None = None) -> torch.Tensor:
    """Reward-model scores, read at each sequence's last valid response token (its EOS if any).

    Args:
        reward_model: a scalar-head model.
        batch: a rollout batch; every row needs a valid response token.
        micro_batch_size: rows per forward pass; None for all.

    Returns:
        (B,) float32 scores.
    """
    return torch.cat([response_scores(reward_model, mb) for mb in micro_batches(batch, micro_batch_size)])


def build_batch(tokenizer, prompts: Sequence[str], responses: Sequence[str], add_eos: bool = True) -> dict[str, torch.Tensor]:
    """A batch in the rollout layout from given texts (for SFT, reward-model pairs, tests).

    Args:
        tokenizer: a prepared tokenizer.
        prompts: N prompt texts (tokenized with the tokenizer's special tokens, left-padded).
        responses: N response texts (tokenized without special tokens, right-padded).
        add_eos: end each response with EOS, as a finished rollout does.

    Returns:
        dict with ``prompts``, ``responses``, ``input_ids``, ``attention_mask``,
        ``position_ids``, ``response_mask`` (see the module docstring).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts)
    eos = [tokenizer.eos_token_id] if add_eos else []
    response_lists = [seq + eos for seq in tokenizer(list(responses), add_special_tokens=False)["input_ids"]]
    # Right padding is left padding of the reversed lists, reversed back.
    flipped, flipped_mask = left_pad([seq[::-1] for seq in response_lists], tokenizer.pad_token_id)
    return _sequence_batch(prompt_ids, prompt_mask, flipped.flip(1), flipped_mask.flip(1))
