"""Paths that change speed or memory, never results: each computes what a plain function of the
teaching core computes (to float rounding), and the trainer picks them once from the config
(:func:`select`).

- :mod:`refppo.accel.logprobs`: log-probs and entropies in blocks of rows, compiled or from the
  hidden states (``actor.use_torch_compile``, ``model.use_fused_kernels``; on CUDA in blocks);
- :mod:`refppo.accel.decoding`: static-cache decoding replayed as CUDA graphs, with grouped-query
  attention read in place (``rollout.cuda_graphs``);
- :mod:`refppo.accel.token_budget`: micro-batches of a token budget (``*.use_dynamic_bsz``);
- :mod:`refppo.accel.checkpointing`: activation checkpointing (``*.enable_gradient_checkpointing``);
- :mod:`refppo.accel.gae`: GAE without a loop over tokens (on CUDA);
- :mod:`refppo.accel.compiled_layers`: decoder layers compiled by torch.compile
  (``model.compile_layers``).

On a CPU the defaults are the plain paths; on CUDA the ones that measured faster
(``benchmarks/README.md``): compiled log-probs in large blocks, CUDA-graph decoding, packed GAE,
compiled decoder layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from refppo.accel.checkpointing import enable_gradient_checkpointing
from refppo.accel.compiled_layers import compile_layers
from refppo.accel.decoding import StaticDecoder
from refppo.accel.gae import packed_gae_advantage_return
from refppo.accel.logprobs import CHUNK_ELEMENTS, BlockLogProbs, check_fused_kernels
from refppo.accel.token_budget import TokenBudgetPasses
from refppo.rollout.forward import ForwardPasses, response_log_probs
from refppo.settings.config import Config


def _plain_decoder(model, max_length: int):
    return model


@dataclass(frozen=True)
class Accel:
    """The paths a trainer calls where a faster one may stand in for the plain one.

    Attributes:
        actor: the actor's and the reference's log-prob passes and the actor's micro-batches.
        critic: the critic's value pass and micro-batches.
        decoder: ``decoder(model, max_length)`` -> what :func:`refppo.rollout.generation.generate` calls
            (the model itself, or a :class:`~refppo.accel.decoding.StaticDecoder`).
        adv_estimators: advantage estimators by name that replace the registered ones.
    """

    actor: ForwardPasses = field(default_factory=ForwardPasses)
    critic: ForwardPasses = field(default_factory=ForwardPasses)
    decoder: Callable = _plain_decoder
    adv_estimators: dict[str, Callable] = field(default_factory=dict)


def on_cuda(setting: bool | None, device: torch.device) -> bool:
    """A speed setting as given, or, when it is null, whether the device is CUDA."""
    return device.type == "cuda" if setting is None else setting


def select(config: Config, device: torch.device, distributed: bool = False) -> Accel:
    """The paths ``config`` asks for on ``device``.

    - log-probs: in blocks when the device is CUDA, ``actor.use_torch_compile`` is on (null: on
      CUDA) or ``model.use_fused_kernels`` is set; else :func:`refppo.rollout.forward.response_log_probs`;
    - micro-batches: of a token budget with ``actor.use_dynamic_bsz`` / ``critic.use_dynamic_bsz``;
    - decoding: :class:`~refppo.accel.decoding.StaticDecoder` with ``rollout.cuda_graphs`` (null:
      on CUDA, but not under torchrun nor with ``actor.router_replay=R3`` or ``model.lora.rank > 0``);
    - GAE: :func:`~refppo.accel.gae.packed_gae_advantage_return` on CUDA.

    Args:
        config: validated settings.
        device: where the models run.
        distributed: whether the models are sharded over processes (FSDP2), whose parameters a
            captured CUDA graph could not keep.
    """
    compiled = on_cuda(config.actor.use_torch_compile, device)
    fused = config.model.use_fused_kernels
    log_probs = response_log_probs
    if compiled or fused or device.type == "cuda":
        log_probs = BlockLogProbs(compiled=compiled, fused=fused, chunk_elements=CHUNK_ELEMENTS[device.type])

    def passes(role) -> ForwardPasses:
        if role.use_dynamic_bsz:
            return TokenBudgetPasses(log_probs, max_tokens=role.ppo_max_token_len_per_gpu)
        return ForwardPasses(log_probs)

    cuda = device.type == "cuda"
    return Accel(
        actor=passes(config.actor),
        critic=passes(config.critic),
        decoder=StaticDecoder if _cuda_graphs(config, device, distributed) else _plain_decoder,
        adv_estimators={"gae": packed_gae_advantage_return} if cuda else {},
    )


def _cuda_graphs(config: Config, device: torch.device, distributed: bool) -> bool:
    """Whether the rollout decodes with CUDA graphs: ``rollout.cuda_graphs`` (null: on CUDA), never
    under torchrun (a captured graph could not keep sharded parameters), while recording R3's
    routing (a replayed graph runs no Python) or with Megatron's LoRA (its experts' adapters run
    transformers' eager experts loop, whose shapes follow the routing)."""
    if distributed or config.actor.router_replay == "R3" or config.model.lora.rank > 0:
        return False
    return on_cuda(config.rollout.cuda_graphs, device)


def prepare_models(config: Config, actor, critic=None, reference=None, reward_model=None, distributed=False) -> None:
    """What the speed options need from the models, before training starts: activation
    checkpointing turned on in the trained ones (``model.enable_gradient_checkpointing``,
    ``critic.model.enable_gradient_checkpointing``), a refusal, by name, of a model whose
    log-probs ``model.use_fused_kernels`` cannot compute from its hidden states, and every model's
    decoder layers compiled with ``model.compile_layers`` (null: on CUDA, but not under torchrun).
    ``reference`` must already be copied from ``actor`` (it is never trained)."""
    if config.rollout.cuda_graphs and actor.device.type != "cuda":
        raise ValueError(f"rollout.cuda_graphs=true needs the actor on a CUDA device, not {actor.device}")
    if config.model.enable_gradient_checkpointing:
        enable_gradient_checkpointing(actor)
    if critic is not None and config.critic.model.enable_gradient_checkpointing:
        enable_gradient_checkpointing(critic, "critic.model.enable_gradient_checkpointing")
    if config.model.use_fused_kernels:
        check_fused_kernels(actor)
        if reference is not None:
            check_fused_kernels(reference, "reference")
    compile_layers(*compiled_models(config, actor, reference, critic, reward_model, distributed))


def compiled_models(config: Config, actor, reference=None, critic=None, reward_model=None, distributed=False) -> list:
    """The models whose decoder layers ``model.compile_layers`` compiles (null: on CUDA, but not
    under torchrun): every one given but those with activation checkpointing, whose layers
    torch.compile does not take (an explicit true with checkpointing is refused), and the actor and
    reference when the actor replays its routing or trains Megatron's LoRA."""
    if distributed or not on_cuda(config.model.compile_layers, actor.device):
        return []
    models = [reward_model]
    # the actor's routers record and replay in Python under actor.router_replay; Megatron's LoRA
    # runs transformers' eager experts loop, whose shapes follow the routing
    python_layers = config.actor.router_replay != "disabled" or config.model.lora.rank > 0
    if not config.model.enable_gradient_checkpointing and not python_layers:
        models += [actor, reference]
    if not config.critic.model.enable_gradient_checkpointing:
        models.append(critic)
    return models
