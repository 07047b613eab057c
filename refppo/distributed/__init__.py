"""Data-parallel training over processes (``torchrun --nproc_per_node N -m refppo ppo ...``): the
process group, FSDP2's sharding of the models, and the few cross-process operations the trainer
needs. A run not launched by ``torchrun`` is the case ``world.distributed == False``: every
function here then leaves its input as it is, so ``refppo ppo`` and ``torchrun`` run the same
code. (``torchrun --nproc_per_node 1`` is distributed: one process with FSDP2 and a process group.)

Each process generates, scores and evaluates its share of a step's prompts; the evaluated rows are
then gathered, so every process holds the whole batch and computes the advantages, whitening,
group statistics and metrics over all of it; each takes its share of every mini-batch, and the
gradients are summed across processes. The core math never imports this module; it may import the
core, ``guards``, ``settings`` and ``rollout``.
"""

from __future__ import annotations

import datetime
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from refppo.rollout.layers import decoder_layers


@dataclass(frozen=True)
class World:
    """This process's place among the processes of a run; ``distributed`` when launched by torchrun
    (a process group, FSDP2), even with one process."""

    rank: int = 0
    size: int = 1
    distributed: bool = False

    @property
    def main(self) -> bool:
        """The process that writes the run folder, the log and the progress bar."""
        return self.rank == 0

    def share(self, count: int) -> slice:
        """This process's consecutive share of ``count`` items (``count`` a multiple of ``size``)."""
        per = count // self.size
        return slice(self.rank * per, (self.rank + 1) * per)


SINGLE = World()


def launched_world() -> World:
    """The world ``torchrun`` launched this process in (its ``RANK`` and ``WORLD_SIZE``), or one
    process."""
    if "WORLD_SIZE" not in os.environ:
        return SINGLE
    return World(int(os.environ.get("RANK", 0)), int(os.environ["WORLD_SIZE"]), distributed=True)


def start(world: World, device: torch.device, timeout_s: float = 600.0) -> torch.device:
    """Join the process group (NCCL on CUDA, gloo on a CPU) when there are several processes.

    Args:
        world: this process's place.
        device: the device ``trainer.device`` names; CUDA becomes this process's GPU
            (``LOCAL_RANK``).
        timeout_s: how long a collective waits for a process that does not answer.

    Returns:
        The device this process runs on.
    """
    if not world.distributed:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return device


def stop(world: World) -> None:
    """Leave the process group (after a run, or when it failed)."""
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def shard(model, world: World):
    """FSDP2 over the processes: each decoder layer, then the whole model, holds a 1/size share of
    its parameters (and so of their gradients and optimiser state), gathered layer by layer for
    each pass. Gradients are summed across processes, not averaged: each process's loss is already
    weighted by its rows' share of the whole mini-batch. On CUDA the passes compute in bf16 and
    reduce gradients in float32 (FSDP2's mixed precision), the weights staying float32.

    Args:
        model: a model (or None); unchanged with one process.
        world: the processes.

    Returns:
        The same model, sharded in place.
    """
    if model is None or not world.distributed:
        return model
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    cuda = next(model.parameters()).device.type == "cuda"
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else MixedPrecisionPolicy()
    )
    # The passes return views (logits[..., -1], value heads); refppo never writes into them in place,
    # which is what FSDP2 warns about.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for layer in decoder_layers(model, needed_by="sharding over processes"):
        fully_shard(layer, mp_policy=policy)
    # The root too gives back its whole parameters after each pass (as verl's FSDP2 does; FSDP2
    # would keep them for the backward): outside a pass every parameter is its shard, so an
    # in-place edit (the reward model's centring) reaches the weights, and a frozen model holds
    # no whole copy of its embeddings.
    fully_shard(model, mp_policy=policy, reshard_after_forward=True)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no PREMUL_SUM
    return model


class Unsharded:
    """``with Unsharded(model, world):`` every FSDP2 module of ``model`` gathers its whole parameters
    once and keeps them for the block, for generation, whose every token is a pass through every
    layer. The passes inside then need no collective, so each process may run as many as its own
    rows need (its decoding stops when they have all ended). Nothing when not distributed."""

    def __init__(self, model, world: World):
        from torch.distributed.fsdp import FSDPModule

        self.modules = [m for m in model.modules() if isinstance(m, FSDPModule)] if world.distributed else []

    def __enter__(self):
        for module in self.modules:
            module.set_reshard_after_forward(False, recurse=False)
            module.unshard()

    def __exit__(self, *exc):
        for module in self.modules:
            module.reshard()
            module.set_reshard_after_forward(True, recurse=False)


def all_sum(tensor: torch.Tensor, world: World) -> torch.Tensor:
    """The elementwise sum of ``tensor`` over the processes (a new tensor; itself with one)."""
    if not world.distributed:
        return tensor
    out = tensor.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def pad_width(tensor: torch.Tensor, width: int, pad_value=0, pad_left: bool = False) -> torch.Tensor:
    """``tensor`` (rows, w, ...) padded on its second dimension to (rows, width, ...) with
    ``pad_value``, on the right (or the left); a 1-D tensor, or one already that wide, as it is."""
    missing = width - tensor.shape[1] if tensor.dim() >= 2 else 0
    if not missing:
        return tensor
    pad = [0, 0] * (tensor.dim() - 2) + ([missing, 0] if pad_left else [0, missing])
    return torch.nn.functional.pad(tensor, pad, value=pad_value)


def gather_rows(tensor: torch.Tensor, world: World, pad_value=0, pad_left: bool = False) -> torch.Tensor:
    """Every process's rows of ``tensor``, in rank order: (sum of rows, ...). A second dimension
    that differs between processes (a response or prompt width) is padded first to the widest,
    on the right (or the left), with ``pad_value``.

    Args:
        tensor: (rows, ...) on this process; every process the same number of rows.
        world: the processes.
    """
    if not world.distributed:
        return tensor
    if tensor.dim() >= 2:
        width = torch.tensor([tensor.shape[1]], device=tensor.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
        tensor = pad_width(tensor, int(width), pad_value, pad_left)
    flag = tensor.dtype == torch.bool  # gloo gathers no booleans
    tensor = tensor.to(torch.uint8) if flag else tensor
    parts = [torch.empty_like(tensor) for _ in range(world.size)]
    dist.all_gather(parts, tensor.contiguous())
    out = torch.cat(parts)
    return out.bool() if flag else out


def gather_items(items: list, world: World) -> list:
    """Every process's ``items`` (picklable objects, such as strings), in rank order: a list of
    every process's items, one after another."""
    if not world.distributed:
        return items
    parts = [None] * world.size
    dist.all_gather_object(parts, items)
    return [item for part in parts for item in part]


def broadcast(value, world: World):
    """Rank 0's ``value`` (any picklable object) on every process."""
    if not world.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(world: World) -> None:
    """Wait until every process gets here."""
    if world.distributed:
        dist.barrier()


def check_world(config, world: World) -> None:
    """Refuse, before any work, a run that cannot be split over ``world``'s processes: each takes
    whole prompts (so a GRPO or RLOO group stays on one process) and an equal share of every
    mini-batch's rows; LoRA, log-probs from the hidden states, CUDA-graph decoding, token-budget
    micro-batches and dynamic sampling are not available under FSDP2 here.

    Args:
        config: the run's settings.
        world: the processes.
    """
    if not world.distributed:
        return
    from refppo.settings.config import critic_setting

    c = config
    size = world.size
    problems = []
    if c.data.train_batch_size % size:
        problems.append(
            f"data.train_batch_size={c.data.train_batch_size} prompts do not split evenly over {size} processes"
        )
    roles = [("actor", c.actor.ppo_mini_batch_size)] + [("critic", critic_setting(c, "ppo_mini_batch_size"))]
    for role, mini in roles:
        if mini * c.rollout.n % size:
            problems.append(
                f"the {role} mini-batch of {mini * c.rollout.n} rows ({role}.ppo_mini_batch_size x rollout.n) does not "
                f"split evenly over {size} processes"
            )
    # token-budget micro-batches: each process would make its own number, and FSDP2 gathers every
    # layer once per pass on every process
    for key, on in [
        ("model.lora_rank", c.model.lora_rank > 0),
        ("model.lora_adapter_path", c.model.lora_adapter_path is not None),
        ("model.lora.rank", c.model.lora.rank > 0),
        ("model.use_fused_kernels", c.model.use_fused_kernels),
        ("rollout.cuda_graphs", c.rollout.cuda_graphs),
        ("model.compile_layers", c.model.compile_layers),
        ("actor.use_dynamic_bsz", c.actor.use_dynamic_bsz),
        ("critic.use_dynamic_bsz", c.critic.use_dynamic_bsz),
        ("algorithm.filter_groups.enable", c.algorithm.filter_groups.enable),  # each process would keep its own count
    ]:
        if on:
            problems.append(
                f"{key} is not available with FSDP2 (several processes) here: set it off or run one process"
            )
    if problems:
        raise ValueError("; ".join(problems))


def take_share(batch, world: World):
    """This process's consecutive share of a batch's rows: of a dict of tensors (each sliced on
    dim 0) or of a list."""
    if not world.distributed:
        return batch
    if isinstance(batch, dict):
        share = world.share(len(next(iter(batch.values()))))
        return {k: v[share] for k, v in batch.items()}
    return batch[world.share(len(batch))]


def padded_share(items: list, world: World) -> tuple[list, int, int]:
    """This process's share of ``items`` when they need not split evenly: each process takes
    ceil(len / size) consecutive items, the last ones padded with copies of the final item (whose
    results :func:`gather_rows` then drops with ``[:count]``).

    Returns:
        (this process's items, the index of its first item, len(items)).
    """
    per = -(-len(items) // world.size)
    first = world.rank * per
    mine = items[first : first + per]
    return mine + [items[-1]] * (per - len(mine)), first, len(items)


def sum_stats(stats: dict[str, torch.Tensor], world: World) -> dict[str, torch.Tensor]:
    """Each statistic summed over the processes, in one collective."""
    if not world.distributed or not stats:
        return stats
    names = list(stats)
    total = all_sum(torch.stack([torch.as_tensor(stats[k], dtype=torch.float32) for k in names]), world)
    return dict(zip(names, total.unbind()))


def gather_evaluated(batch: dict[str, torch.Tensor], scores, extras: dict, entropy, pad_token_id: int, world: World):
    """Replace this process's evaluated rows in ``batch`` by every process's, in rank order (the
    order of one process's batch), and gather the scores, the extra scores and the entropies.

    Args:
        batch: this process's rollout with its old and reference log-probs and values; changed in
            place to the whole batch (the sequence tensors rebuilt at the widest prompt and
            response).
        scores: (b,) this process's scores; extras: name -> (b,) scores; entropy: (b, r) or None.
        pad_token_id: written into the padding of narrower prompts and responses.
        world: the processes.

    Returns:
        (scores (B,), extras, entropy (B, R) or None) over every process's rows.
    """
    if not world.distributed:
        return scores, extras, entropy
    from refppo.rollout.prompts import sequence_batch

    width = batch["prompts"].shape[1]
    prompts = gather_rows(batch["prompts"], world, pad_token_id, pad_left=True)
    prompt_mask = gather_rows(batch["attention_mask"][:, :width], world, 0, pad_left=True)
    responses = gather_rows(batch["responses"], world, pad_token_id)
    whole = sequence_batch(prompts, prompt_mask, responses, gather_rows(batch["response_mask"], world))
    for key, value in batch.items():
        if key not in whole:
            whole[key] = gather_rows(value, world)
    batch.clear()
    batch.update(whole)
    extras = {name: gather_rows(v.to(scores.device), world) for name, v in extras.items()}
    return gather_rows(scores, world), extras, None if entropy is None else gather_rows(entropy, world)


def full_state_dict(model, world: World) -> dict | None:
    """The model's whole state dict, gathered from every process's shard onto the CPU (every process
    calls this); None with one process (the model's own is whole)."""
    if not world.distributed:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
