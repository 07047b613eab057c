"""Activation checkpointing (``model.enable_gradient_checkpointing``,
``critic.model.enable_gradient_checkpointing``): memory for one more forward pass of the
decoder in every update; the gradients do not change. Figures: ``benchmarks/README.md``
(activation checkpointing).
"""

from __future__ import annotations

import contextlib

from refppo.guards.memory import bytes_of_values, layer_values
from refppo.rollout.device import trainable_attention
from refppo.rollout.models import base_model


def enable_gradient_checkpointing(model, setting: str = "model.enable_gradient_checkpointing") -> None:
    """Activation checkpointing (verl's ``enable_gradient_checkpointing``): in training mode each
    decoder layer keeps only its input, and the backward pass recomputes the layer's forward from
    it, one layer at a time. The gradients are unchanged (bit for bit on a CPU); the activations
    shrink to the layers' inputs plus one layer's (:func:`checkpointed_activation_bytes`), for one
    more forward pass of the decoder in every update. Passes in eval mode (sampling, old
    log-probs, reference, values, scores) are unaffected.

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


def checkpointed_values_per_token(config) -> tuple[int, int]:
    """Values per token the checkpoints of a training forward keep, and how many of them are
    float32: each layer's input (h values) and the final RMSNorm's 3h + 1 (h + 1 of them float32).
    The checkpoints also hold, once per micro-batch, the positions and, with a mask, the mask as
    booleans (``seq_len`` bytes per token).

    Args:
        config: a Llama- or Qwen2-style ``PretrainedConfig``.

    Returns:
        (values, float32 values), per token.
    """
    h = config.hidden_size
    return config.num_hidden_layers * h + 3 * h + 1, h + 1


def checkpointed_activation_bytes(
    config, tokens: int, logit_tokens: int, bytes_per_value: int = 2, seq_len: int | None = None
) -> int:
    """:func:`refppo.guards.memory.activation_bytes` with checkpointed layers: the checkpoints
    (:func:`checkpointed_values_per_token`) plus the one layer whose forward the backward pass is
    recomputing. The backward pass frees the vocabulary rows before it recomputes the first layer,
    so this is what to budget for, above the true peak of the activations by at most the smaller
    of the two.

    Args:
        config, tokens, logit_tokens, bytes_per_value, seq_len: as
            :func:`refppo.guards.memory.activation_bytes`.

    Returns:
        Bytes.
    """
    values, wide = checkpointed_values_per_token(config)
    layer, layer_wide = layer_values(config, seq_len)
    return bytes_of_values(config, tokens, logit_tokens, values + layer, wide + layer_wide, bytes_per_value)
