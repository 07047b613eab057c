"""Activation checkpointing (``model.enable_gradient_checkpointing``,
``critic.model.enable_gradient_checkpointing``): memory for one more forward pass of the
decoder in every update; the gradients do not change. Figures: ``benchmarks/README.md``
(activation checkpointing).
"""

from __future__ import annotations

import contextlib

from refppo.device import trainable_attention
from refppo.models import base_model


def enable_gradient_checkpointing(model, setting: str = "model.enable_gradient_checkpointing") -> None:
    """Activation checkpointing (verl's ``enable_gradient_checkpointing``): in training mode each
    decoder layer keeps only its input, and the backward pass recomputes the layer's forward from
    it, one layer at a time. The gradients are unchanged (bit for bit on a CPU); the activations
    shrink to the layers' inputs plus one layer's (:func:`refppo.memory.activation_bytes` with
    ``checkpointing=True``), for one more forward pass of the decoder in every update. Passes in
    eval mode (sampling, old log-probs, reference, values, scores) are unaffected.

    Args:
        model: a causal LM, a LoRA actor or a scalar-head model (critic, reward model); changed
            in place.
        setting: the config key that asks for it, named in the error.
    """
    base = base_model(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{setting}=true, but {type(base).__name__} does not support activation checkpointing: set {setting}=false"
        )
    # Non-reentrant, as verl's; the recomputation runs in the backward pass, outside
    # trainable_forward, so it leaves cuDNN's attention out itself (autocast torch restores).
    kwargs = {"use_reentrant": False, "context_fn": lambda: (contextlib.nullcontext(), trainable_attention())}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.24's name
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
