"""Decoder layers compiled by ``torch.compile`` (``model.compile_layers``): the same arithmetic,
with the elementwise work between the matrix products (the float32 RMSNorms, the rotary
embeddings, the SiLU gate, the residual adds, forward and backward) fused into a few kernels.

The layers of a model share their code, so one compiled graph serves all of them, and the
actor's, reference's, critic's and reward model's alike when their shapes agree: the first steps
compile one graph for the passes without gradients and one for the updates (and one more for a
sequence length that changes). A pass with a KV cache (generation) keeps the eager forward: the
cache's state differs from layer to layer, so torch.compile would trace every layer apart.
Figures: ``benchmarks/README.md`` (compiled layers).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from refppo.rollout.layers import decoder_layers
from refppo.rollout.models import base_model

# Every kind of pass is one more graph of the layers' shared code (with gradients or not, trained or
# frozen weights, a mask or none, each model's shapes): more than dynamo's default limit of 8, past
# which it would run the layers eagerly. Raised only while a compiled layer runs.
RECOMPILE_LIMIT = 64
# (torch < 2.6 calls it cache_size_limit)
_LIMIT_NAME = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


class CompiledForward:
    """A layer's ``forward``, compiled for passes without a KV cache and eager for those with one."""

    def __init__(self, forward):
        self.eager = forward
        self.compiled = torch.compile(forward)

    def __call__(self, *args, **kwargs):
        if any(isinstance(value, Cache) for value in (*args, *kwargs.values())):
            return self.eager(*args, **kwargs)
        limit = max(getattr(torch._dynamo.config, _LIMIT_NAME), RECOMPILE_LIMIT)
        with torch._dynamo.config.patch({_LIMIT_NAME: limit}):  # the user's own limit elsewhere
            return self.compiled(*args, **kwargs)


def _layers(models) -> list[torch.nn.Module]:
    """The decoder layers of ``models`` (None skipped), each once (a LoRA reference shares the actor's)."""
    layers = {}
    for model in models:
        if model is None:
            continue
        for layer in decoder_layers(base_model(model), needed_by="model.compile_layers"):
            layers[id(layer)] = layer
    return list(layers.values())


def compile_layers(*models) -> None:
    """Compile every decoder layer of ``models`` (causal LMs, LoRA actors, scalar-head models or
    None) in place; the outputs and gradients equal the eager layers' to float rounding. While a
    compiled layer runs, torch.compile's limit of graphs per function is at least
    :data:`RECOMPILE_LIMIT`.

    Raises:
        ValueError: a model with no decoder layers at ``.model.layers``.
    """
    for layer in _layers(models):
        if not isinstance(layer.forward, CompiledForward):
            layer.forward = CompiledForward(layer.forward)


def eager_layers(*models) -> None:
    """Undo :func:`compile_layers` (its compiled graphs are kept for a later call)."""
    for layer in _layers(models):
        if isinstance(layer.__dict__.get("forward"), CompiledForward):
            del layer.forward
