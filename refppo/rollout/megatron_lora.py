"""Megatron-Bridge's LoRA on a Hugging Face model (verl's ``model.lora.*``, its Megatron engine's).

Megatron-Core fuses some of a decoder layer's linear maps: the query, key and value projections
into ``linear_qkv``, an MLP's gate and up projections into ``linear_fc1``, and a mixture-of-experts
layer keeps all its experts' weights in one grouped linear per projection. Megatron-Bridge's LoRA
(``megatron.bridge.peft.lora.LoRA``, verl's ``model.lora.type=lora``) puts one adapter on each
such linear: one A (rank x in) and one B (out x rank) for q, k and v together, so the three
projections share A and each takes its rows of B; one for the gate and up projections together;
and one for the experts of a layer's ``linear_fc1`` and one for their ``linear_fc2``, every
expert adding the same low-rank map. Hugging Face keeps these maps apart, and PEFT's LoRA
(``model.lora_rank``, verl's FSDP engine's) gives each its own A and B: at the same rank that
trains other parameters, and more of them.

Two details follow Megatron's parallel sizes in Megatron-Bridge 0.5, the release verl 0.9 installs
(``megatron/bridge/peft/utils.py``, ``ParallelLinearAdapter``). Each expert-parallel rank holds its
own copy of an experts adapter, over its own experts (its gradient is reduced over the ranks that
hold the same experts only), so a layer's experts fall into ``expert_model_parallel_size`` groups of
consecutive experts, each with its own adapter. And each tensor-parallel shard of A and B is
initialised on its own, its Xavier and Kaiming scales taken from the shard's shape: A split by
rank over the tensor-parallel ranks for ``linear_qkv`` and ``linear_fc1`` (column-parallel maps),
by input for ``linear_proj`` and ``linear_fc2`` (row-parallel), B by output for all four.

:func:`add_megatron_lora` gives a Hugging Face model Megatron's adapters in place: a forward hook
adds each projection's rows of its adapter's output, and each experts module runs a forward with
the adapters' output added inside every expert. Only the adapters train; :func:`adapters_disabled`
turns them off (the reference policy), :func:`merge_megatron_lora` folds them into the weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from refppo.rollout.layers import decoder_layers
from refppo.settings.config import MEGATRON_LORA_INITS, MEGATRON_LORA_TARGETS, MegatronLoraConfig

# Hugging Face's separate projections under each of Megatron's fused maps, in row order
ATTENTION_PARTS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",)}
MLP_PARTS = {"linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
SHARED_EXPERTS = ("shared_expert", "shared_experts")
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")  # the others are row-parallel
ADAPTER_FILE = "megatron_lora.safetensors"
CONFIG_FILE = "megatron_lora.json"


def _check_init_method(method: str) -> None:
    if method not in MEGATRON_LORA_INITS:
        raise ValueError(f"model.lora init method {method!r}: Megatron-Bridge's are {', '.join(MEGATRON_LORA_INITS)}")


def init_adapter_weight(weight: torch.Tensor, method: str, shards: int = 1, dim: int = 0) -> None:
    """Initialise one of an adapter's matrices in place as Megatron-Bridge does, each of its
    ``shards`` equal parts along ``dim`` (a tensor-parallel rank's) on its own: ``xavier`` a Xavier
    normal, ``kaiming`` a Kaiming uniform with a = sqrt(5) (bound 1 / sqrt(fan in)), ``normal``
    N(0, 0.2^2), ``zero`` zeros; the fans are the part's.

    Args:
        weight: (out, in) the matrix; its size along ``dim`` a multiple of ``shards``.
        method: one of :data:`MEGATRON_LORA_INITS`.
        shards, dim: the parts, and the dimension they split.
    """
    _check_init_method(method)
    if weight.shape[dim] % shards:
        raise ValueError(f"an adapter matrix of shape {tuple(weight.shape)} does not split in {shards} along {dim}")
    for part in weight.chunk(shards, dim=dim):  # views: each is initialised in place
        if method == "xavier":
            torch.nn.init.xavier_normal_(part)
        elif method == "kaiming":
            torch.nn.init.kaiming_uniform_(part, a=math.sqrt(5))
        elif method == "normal":
            torch.nn.init.normal_(part, mean=0.0, std=0.2)
        else:
            torch.nn.init.zeros_(part)


class FusedAdapter(torch.nn.Module):
    """One Megatron LoRA adapter over a fused linear map: A (``linear_in``, rank x in) and B
    (``linear_out``, out x rank); its output on x is alpha / rank x B A x, of which each Hugging
    Face projection under the fused map takes its rows.

    Args:
        in_features, out_features: the fused map's sizes (out: its projections' together).
        rank, alpha: the adapter's rank and scale numerator.
        init_a, init_b: :data:`MEGATRON_LORA_INITS` for A and B.
        like: a weight of the adapted model, whose dtype and device the adapter takes.
        shards: the tensor-parallel size each matrix is initialised under (:func:`init_adapter_weight`).
        column_parallel: the map is column-parallel (A split by rank), else row-parallel (by input).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        alpha: float,
        init_a: str,
        init_b: str,
        like: torch.Tensor,
        shards: int = 1,
        column_parallel: bool = True,
    ):
        super().__init__()
        split = {"rank": rank} if column_parallel else {"input size": in_features}
        split["output size"] = out_features
        for what, size in split.items():
            if size % shards:
                raise ValueError(
                    f"model.lora: an adapter's {what} {size} does not split over Megatron's tensor-parallel size "
                    f"{shards}, as Megatron-Bridge splits it"
                )
        self.linear_in = torch.nn.Parameter(torch.empty(rank, in_features, dtype=like.dtype, device=like.device))
        self.linear_out = torch.nn.Parameter(torch.empty(out_features, rank, dtype=like.dtype, device=like.device))
        init_adapter_weight(self.linear_in.data, init_a, shards=shards, dim=0 if column_parallel else 1)
        init_adapter_weight(self.linear_out.data, init_b, shards=shards, dim=0)
        self.scale = alpha / rank
        self.active = True
        self.hooks = []

    def forward(self, x: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """alpha / rank x B[rows] A x.

        Args:
            x: (..., in) inputs.
            rows: the rows of B (the projection's part of the fused output).

        Returns:
            (..., rows) the adapter's output.
        """
        return self.scale * F.linear(F.linear(x, self.linear_in), self.linear_out[rows])

    def delta(self, rows: slice = slice(None)) -> torch.Tensor:
        """The adapter as a weight update: alpha / rank x B[rows] A, (rows, in)."""
        return self.scale * (self.linear_out[rows] @ self.linear_in)


def _add_rows(adapter: FusedAdapter, rows: slice, module, inputs, output):
    """Forward hook of an adapted projection: its output plus its rows of the adapter's."""
    if not adapter.active:
        return None
    return output + adapter(inputs[0], rows)


def _linears_adapter(parent, name: str, parts: tuple[str, ...], lora: MegatronLoraConfig) -> FusedAdapter:
    """The adapter of Megatron's map ``name`` over the Linear projections ``parts`` of ``parent``
    (their outputs stacked in that order, as Megatron fuses them)."""
    linears = [getattr(parent, part) for part in parts]
    out_features = sum(linear.out_features for linear in linears)
    column_parallel = name in COLUMN_PARALLEL
    return FusedAdapter(
        linears[0].in_features,
        out_features,
        like=linears[0].weight,
        shards=lora.tensor_model_parallel_size,
        column_parallel=column_parallel,
        **_adapter_settings(lora),
    )


def _attach_linears(parent, name: str, parts: tuple[str, ...], adapter: FusedAdapter) -> None:
    """Register ``adapter`` on ``parent`` as ``<name>_lora`` and hook each projection's rows to it."""
    parent.register_module(f"{name}_lora", adapter)
    start = 0
    for part in parts:
        linear = getattr(parent, part)
        rows = slice(start, start + linear.out_features)
        adapter.hooks.append(linear.register_forward_hook(functools.partial(_add_rows, adapter, rows)))
        start = rows.stop


def _experts_forward(experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """transformers' eager experts forward (``Qwen3MoeExperts.forward``) with Megatron's adapters
    of the layer's experts: the output of its group's ``linear_fc1_lora`` added to an expert's gate
    and up projections, of its ``linear_fc2_lora`` to its down projection, before the routing
    weight. With the adapters off, the experts' own forward.

    Args:
        experts: a Hugging Face experts module (3-D ``gate_up_proj`` and ``down_proj``).
        hidden_states: (N, H) tokens.
        top_k_index, top_k_weights: (N, k) each token's experts and their weights.

    Returns:
        (N, H) the experts' weighted sum.
    """
    fc1 = _active(getattr(experts, "linear_fc1_lora", None))
    fc2 = _active(getattr(experts, "linear_fc2_lora", None))
    if fc1 is None and fc2 is None:
        return type(experts).forward(experts, hidden_states, top_k_index, top_k_weights)
    per_group = experts.num_experts // len(fc1 or fc2)
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        mask = F.one_hot(top_k_index, num_classes=experts.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert in hit[:, 0].tolist():
        if expert == experts.num_experts:
            continue
        slot, token = torch.where(mask[expert])
        group = expert // per_group
        state = hidden_states[token]
        gate_up = F.linear(state, experts.gate_up_proj[expert])
        if fc1 is not None:
            gate_up = gate_up + fc1[group](state)
        inner = experts._apply_gate(gate_up)  # act(gate) x up, or the class's own gating
        out = F.linear(inner, experts.down_proj[expert])
        if fc2 is not None:
            out = out + fc2[group](inner)
        out = out * top_k_weights[token, slot, None]
        final.index_add_(0, token, out.to(final.dtype))
    return final


def _is_experts(module) -> bool:
    """A Hugging Face experts module of the form :func:`_experts_forward` runs: 3-D ``gate_up_proj``
    (E, 2I, H), the gate's rows above the up projection's, and ``down_proj`` (E, H, I); no biases,
    no norm after each expert (transformers' ``use_experts_implementation`` flags)."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)):
        return False
    flags = {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False}
    flags["has_post_expert_norm"] = False
    if any(getattr(module, name, None) is not value for name, value in flags.items()):
        return False
    return gate_up.dim() == 3 and down.dim() == 3 and gate_up.shape[1] == 2 * down.shape[2]


def _active(group: torch.nn.ModuleList | None) -> torch.nn.ModuleList | None:
    """An experts module's adapters of one grouped linear, or None when it has none or they are off."""
    return group if group is not None and group[0].active else None


def _experts_adapters(experts, name: str, lora: MegatronLoraConfig) -> torch.nn.ModuleList:
    """Megatron's adapters of the grouped linear ``name`` (linear_fc1 or linear_fc2) of a layer's
    experts: one per expert-parallel rank, each shared by that rank's consecutive experts."""
    groups = lora.expert_model_parallel_size
    if experts.num_experts % groups:
        raise ValueError(
            f"model.lora.expert_model_parallel_size={groups} does not divide a layer's {experts.num_experts} experts"
        )
    two_inner = experts.gate_up_proj.shape[1]
    hidden = experts.gate_up_proj.shape[2]
    fc1 = name == "linear_fc1"
    sizes = (hidden, two_inner) if fc1 else (two_inner // 2, hidden)
    shards = lora.expert_tensor_parallel_size or lora.tensor_model_parallel_size  # Megatron's null: the dense one
    like = experts.gate_up_proj
    settings = _adapter_settings(lora)
    return torch.nn.ModuleList(
        FusedAdapter(*sizes, like=like, shards=shards, column_parallel=fc1, **settings) for _ in range(groups)
    )


def _adapter_settings(lora: MegatronLoraConfig) -> dict:
    """The settings every adapter takes: rank, alpha and the two initialisations."""
    return {
        "rank": lora.rank,
        "alpha": lora.alpha,
        "init_a": lora.lora_A_init_method,
        "init_b": lora.lora_B_init_method,
    }


def _has(module, parts: tuple[str, ...]) -> bool:
    return all(isinstance(getattr(module, part, None), torch.nn.Linear) for part in parts)


def _attention_plan(attention, targets: tuple[str, ...], where: str) -> list[tuple]:
    """(module, Megatron's name, its Hugging Face projections) of an attention's adapters."""
    wanted = [(name, parts) for name, parts in ATTENTION_PARTS.items() if name in targets]
    if wanted and not _has(attention, ATTENTION_PARTS["linear_qkv"] + ATTENTION_PARTS["linear_proj"]):
        raise ValueError(
            f"model.lora.target_modules: {where} has no q_proj, k_proj, v_proj and o_proj Linear layers (Megatron's "
            "linear_qkv and linear_proj): leave those two out of model.lora.target_modules"
        )
    return [(attention, name, parts) for name, parts in wanted]


def _mlp_plan(mlp, targets: tuple[str, ...], where: str) -> list[tuple]:
    """(module, Megatron's name, its Hugging Face projections, or None for an experts module) of a
    dense MLP's adapters (gate, up, down), or of a mixture-of-experts block's experts and shared expert."""
    wanted = [(name, parts) for name, parts in MLP_PARTS.items() if name in targets]
    if not wanted or _has(mlp, MLP_PARTS["linear_fc1"] + MLP_PARTS["linear_fc2"]):
        return [(mlp, name, parts) for name, parts in wanted]
    experts = getattr(mlp, "experts", None)
    if experts is None or not _is_experts(experts):
        raise ValueError(
            f"model.lora.target_modules: {where} is {type(mlp).__name__}, neither a gated MLP (gate_proj, up_proj, "
            "down_proj) nor a mixture-of-experts block whose experts refppo adapts as Megatron's linear_fc1 and "
            "linear_fc2: leave those two out of model.lora.target_modules"
        )
    plan = [(experts, name, None) for name, _ in wanted]
    for shared in SHARED_EXPERTS:
        if getattr(mlp, shared, None) is not None:
            plan += _mlp_plan(getattr(mlp, shared), targets, f"{where}.{shared}")
    return plan


def add_megatron_lora(model, lora: MegatronLoraConfig):
    """Give a causal LM Megatron-Bridge's LoRA adapters, in place; only the adapters train.

    Args:
        model: a Hugging Face causal LM whose decoder layers have ``self_attn`` (q_proj, k_proj,
            v_proj, o_proj) and ``mlp`` (gate_proj, up_proj, down_proj, or experts with a 3-D
            gate_up_proj and down_proj, and an optional shared expert).
        lora: ``model.lora``: the rank and alpha of every adapter (its output is alpha / rank x
            B A x), Megatron's names of the maps to adapt (:data:`MEGATRON_LORA_TARGETS`), the
            initialisations of A and B (:data:`MEGATRON_LORA_INITS`; with B zero the adapted model
            starts as the model), and Megatron's parallel sizes the adapters are built under.

    Returns:
        ``model``, adapted.

    Raises:
        ValueError: a target outside :data:`MEGATRON_LORA_TARGETS`, a rank below 1, an unknown
            initialisation, a layer without the projections a target names, or a size the
            parallel sizes do not divide (before any change to the model).
    """
    targets = tuple(lora.target_modules)
    unknown = [t for t in targets if t not in MEGATRON_LORA_TARGETS]
    if unknown or not targets:
        raise ValueError(f"model.lora.target_modules={list(targets)}: refppo adapts {', '.join(MEGATRON_LORA_TARGETS)}")
    if lora.rank < 1:
        raise ValueError(f"model.lora.rank={lora.rank}: an adapter has rank >= 1")
    for method in (lora.lora_A_init_method, lora.lora_B_init_method):
        _check_init_method(method)
    plan = []
    for i, layer in enumerate(decoder_layers(model, needed_by="model.lora.rank > 0")):
        plan += _attention_plan(getattr(layer, "self_attn", None), targets, f"layer {i}'s attention")
        plan += _mlp_plan(getattr(layer, "mlp", None), targets, f"layer {i}'s mlp")
    built = []  # every adapter first: a size the parallel sizes do not divide is refused here
    for module, name, parts in plan:
        if parts is None:
            built.append((module, name, parts, _experts_adapters(module, name, lora)))
        else:
            built.append((module, name, parts, _linears_adapter(module, name, parts, lora)))
    model.requires_grad_(False)
    for module, name, parts, adapter in built:
        if parts is None:
            module.register_module(f"{name}_lora", adapter)
            module.forward = types.MethodType(_experts_forward, module)
        else:
            _attach_linears(module, name, parts, adapter)
    model.megatron_lora = dataclasses.asdict(lora)
    return model


def adapters(model) -> list[FusedAdapter]:
    """Every Megatron LoRA adapter of ``model`` (none for any other model)."""
    return [module for module in model.modules() if isinstance(module, FusedAdapter)]


def has_megatron_lora(model) -> bool:
    """True for a model :func:`add_megatron_lora` adapted."""
    return isinstance(model, torch.nn.Module) and hasattr(model, "megatron_lora")


@contextlib.contextmanager
def adapters_disabled(model) -> Iterator[None]:
    """``with adapters_disabled(model):`` the model runs without its adapters (the reference policy)."""
    changed = adapters(model)
    for adapter in changed:
        adapter.active = False
    try:
        yield
    finally:
        for adapter in changed:
            adapter.active = True


@torch.no_grad()
def merge_megatron_lora(model):
    """Fold every adapter into the weights it adapts and remove it, in place: a projection's weight
    gains its rows of alpha / rank x B A, each expert's weights the whole of its group's adapter.

    Args:
        model: a model :func:`add_megatron_lora` adapted.

    Returns:
        ``model``, a plain Hugging Face model of the same outputs.
    """
    for parent in list(model.modules()):
        names = [target for target in MEGATRON_LORA_TARGETS if hasattr(parent, f"{target}_lora")]
        for name in names:
            adapter = getattr(parent, f"{name}_lora")
            if _is_experts(parent):
                _merge_experts(parent, name, adapter)
            else:
                _merge_linears(parent, name, adapter)
            delattr(parent, f"{name}_lora")
        if names and _is_experts(parent):
            del parent.forward  # add_megatron_lora's _experts_forward: the class's own again
    del model.megatron_lora
    return model


def _merge_experts(experts, name: str, groups: torch.nn.ModuleList) -> None:
    """Add each group's adapter to the weights of its experts."""
    weight = experts.gate_up_proj if name == "linear_fc1" else experts.down_proj
    per_group = experts.num_experts // len(groups)
    for group, adapter in enumerate(groups):
        weight[group * per_group : (group + 1) * per_group] += adapter.delta().to(weight.dtype)


def _merge_linears(parent, name: str, adapter: FusedAdapter) -> None:
    """Add each projection's rows of ``adapter`` to its weight and remove its hook."""
    parts = ATTENTION_PARTS.get(name) or MLP_PARTS[name]
    start = 0
    for part in parts:
        linear = getattr(parent, part)
        rows = slice(start, start + linear.out_features)
        linear.weight += adapter.delta(rows).to(linear.weight.dtype)
        start = rows.stop
    for hook in adapter.hooks:
        hook.remove()


def save_megatron_lora(model, folder: str | os.PathLike) -> None:
    """Write the adapters (``megatron_lora.safetensors``, named as in the model) and their settings
    (``megatron_lora.json``) to ``folder``.

    Args:
        model: a model :func:`add_megatron_lora` adapted.
        folder: created if missing.
    """
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    tensors = {}
    for prefix, adapter in model.named_modules():
        if isinstance(adapter, FusedAdapter):
            tensors |= {name: p.detach().contiguous().cpu() for name, p in adapter.named_parameters(prefix=prefix)}
    save_file(tensors, os.path.join(folder, ADAPTER_FILE))
    with open(os.path.join(folder, CONFIG_FILE), "w") as f:
        json.dump(model.megatron_lora, f, indent=2)
