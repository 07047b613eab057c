"""Where a Hugging Face model keeps its decoder layers: the one lookup that sharding, compiled
layers and Megatron's LoRA share."""

from __future__ import annotations

import torch


def decoder_layers(model, needed_by: str) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM or a scalar-head model: ``.layers`` of its backbone
    (``model.base_model.model`` or ``model.base_model``, as transformers names it).

    Args:
        model: a Hugging Face model (a causal LM, a scalar-head model) or any module.
        needed_by: what asks for the layers, named in the error (``"model.lora.rank > 0"``).

    Returns:
        The layers, in order.

    Raises:
        ValueError: ``model`` has no decoder layers there (GPT-2 keeps its blocks at ``.h``).
    """
    base = model.base_model if hasattr(model, "base_model") else model
    layers = getattr(getattr(base, "model", base), "layers", None)
    if layers is None:
        raise ValueError(f"{needed_by}: {type(model).__name__} has no decoder layers at .model.layers")
    return list(layers)
