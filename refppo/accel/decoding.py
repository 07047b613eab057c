"""Faster decoding for :func:`refppo.rollout.generation.generate` (``rollout.cuda_graphs``): the same
samples from the same random draws, up to bf16 rounding in the attention.

- :class:`StaticDecoder`, a model-like callable that ``generate`` calls in place of the model: a
  static KV cache and each decoding step compiled by ``torch.compile(mode="reduce-overhead")``,
  which records it once as a CUDA graph and replays it (decoding one token is a few hundred small
  kernels, which launched one by one from Python, not the arithmetic, set a GPU's pace);
- :func:`grouped_decode_attention`: a decoding step's queries attend to a grouped-query model's
  key/value heads in place, where transformers' SDPA path copies them to every query head over
  the whole cache when compiled.

Figures: ``benchmarks/README.md`` (CUDA graphs, decoding without copies of the key/value heads).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from refppo.rollout.generation import cache_argument

if TYPE_CHECKING:
    from transformers import StaticCache


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

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, _, dim = query.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, heads // groups, groups, dim),
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
    )
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


@functools.cache
def _static_cache_class() -> type:
    from transformers import StaticCache  # here: importing refppo.settings.config must not load transformers

    class SameDtypeStaticCache(StaticCache):
        """Under bf16 autocast the keys leave the rotary embedding in float32 and the values are
        bf16; a static cache holds one dtype, so keys are stored as the values' dtype, which is
        what attention casts them to anyway."""

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(key_states.to(value_states.dtype), value_states, layer_idx, *args, **kwargs)

    return SameDtypeStaticCache


class StaticDecoder:
    """A causal LM as :func:`refppo.rollout.generation.generate` calls it, decoding over a static KV cache
    of ``max_length`` slots with each one-token step compiled (replayed as a CUDA graph on a GPU).

    The prefill runs eagerly and fills the cache; each later call is one token per row through the
    compiled step. The cache keeps its buffers between calls (reset, not reallocated), so the
    recorded addresses stay valid, and the step reads the weights in place, so optimiser updates
    are seen. A step attends over all ``max_length`` slots: the mask given is padded with ones,
    and the causal mask hides the slots not written yet. Build one per model (the trainer keeps
    one): the compiled step is recorded once per row count.

    Args:
        model: the causal LM that generates.
        max_length: the longest prompt plus the longest response.
        compile: False runs the same static-cache steps eagerly (what the CPU tests check).
    """

    def __init__(self, model, max_length: int, compile: bool = True):
        self.model = model
        self.max_length = max_length
        self.step = torch.compile(model, mode="reduce-overhead", dynamic=False) if compile else model
        self.cache_key = cache_argument(model)
        self._caches: dict[int, StaticCache] = {}

    @property
    def device(self) -> torch.device:
        return self.model.device

    def get_base_model(self):
        """The Hugging Face model under the decoder (as peft's wrappers name it)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def cache(self, rows: int) -> StaticCache:
        """An empty static cache of ``max_length`` slots for ``rows`` sequences, reused per row count."""
        cache = self._caches.get(rows)
        if cache is None:
            cache = self._caches[rows] = _static_cache_class()(config=self.model.config, max_cache_len=self.max_length)
        else:
            cache.reset()
        return cache

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        use_cache=True,
        **kwargs,
    ):
        """A forward pass as ``generate`` makes it: the prompts (``input_ids`` (N, P), no cache
        given) or one token per row (N, 1) with the cache the last call returned.

        Args:
            input_ids: (N, L) the new tokens.
            attention_mask: (N, S) 0/1 over every token so far, the new ones included.
            position_ids: (N, L) the new tokens' positions.
            **kwargs: ``logits_to_keep``, and the cache under its argument's name.

        Returns:
            The model's output (``logits``, and the cache under the same name).
        """
        seen = attention_mask.shape[1]
        if seen > self.max_length:
            raise ValueError(f"{seen} tokens do not fit the decoder's {self.max_length} cache slots")
        slots = torch.arange(seen - input_ids.shape[1], seen, device=input_ids.device)
        mask = F.pad(attention_mask, (0, self.max_length - seen), value=1)
        prefill = kwargs.get(self.cache_key) is None
        if prefill:
            kwargs[self.cache_key] = self.cache(input_ids.shape[0])
        model = self.model if prefill else self.step
        with decode_attention(self.model):
            return model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                cache_position=slots,
                use_cache=True,
                **kwargs,
            )
