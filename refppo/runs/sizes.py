"""Sizes a run asks for, checked against its data and this machine's memory before any write:
a batch larger than its data, or a generation whose key/value cache alone would not fit
(:func:`refppo.guards.memory.rollout_bytes`), is refused in one line naming the settings."""

from __future__ import annotations

import os

import torch

from refppo.distributed import World
from refppo.guards.memory import rollout_bytes, state_bytes
from refppo.settings.config import Config


def machine_bytes(device: torch.device) -> int:
    """The memory of ``device``: a GPU's total, or the host's physical memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(need: int, device: torch.device, what: str) -> None:
    """Raise ValueError, before anything is allocated, when ``need`` bytes exceed ``device``'s memory.

    Args:
        need: an estimate (a lower bound) of the bytes ``what`` needs.
        device: where it would be allocated.
        what: the settings responsible, e.g. "data.train_batch_size=64 x rollout.n=1000000".
    """
    have = machine_bytes(device)
    if need > have:
        raise ValueError(
            f"{what} needs at least {need / 2**30:.3g} GiB, more than the {have / 2**30:.3g} GiB of this "
            f"machine's {device.type} memory (estimated by refppo.guards.memory); make it smaller"
        )


def check_generation_fits(config: Config, model_config, rows: int, what: str, world: World, device) -> None:
    """Refuse, before any write, a generation of ``rows`` sequences (over all processes) whose
    key/value cache alone would not fit this device (:func:`refppo.guards.memory.rollout_bytes`); ``what``
    names the settings that make ``rows``."""
    d = config.data
    per_process = -(-rows // world.size)
    need = rollout_bytes(
        model_config, per_process, d.max_prompt_length, d.max_response_length, 2 if device.type == "cuda" else 4
    )
    lengths = f"data.max_prompt_length={d.max_prompt_length} + data.max_response_length={d.max_response_length}"
    check_fits(need, device, f"{what} at {lengths} tokens")


def check_rollouts_fit(config: Config, world: World, device) -> None:
    """Refuse, before any write, a step's rollout (``data.train_batch_size x rollout.n``
    sequences) or the held-out one (``data.val_size``) that would not fit this device
    (:func:`check_generation_fits`; the shape read from ``model.path``'s ``config.json``)."""
    from transformers import AutoConfig

    d = config.data
    n = config.rollout.n
    model_config = AutoConfig.from_pretrained(config.model.path, trust_remote_code=config.model.trust_remote_code)
    for rows, what in (
        (d.train_batch_size * n, f"data.train_batch_size={d.train_batch_size} x rollout.n={n}"),
        (d.val_size, f"data.val_size={d.val_size}"),
    ):
        check_generation_fits(config, model_config, rows, what, world, device)


def check_tiny_model_fits(config: Config, vocab_size: int, device) -> None:
    """Refuse, before it is built, a fresh tiny model (the ``model.*`` sizes) whose training state
    would not fit this device. A lower bound: each layer's query and output projections (h x h
    each) and the embeddings (vocabulary x h), at AdamW's 16 bytes a trained parameter."""
    m = config.model
    params = m.num_hidden_layers * 2 * m.hidden_size**2 + vocab_size * m.hidden_size
    what = f"model.hidden_size={m.hidden_size} x model.num_hidden_layers={m.num_hidden_layers}"
    check_fits(sum(state_bytes(params, precision="fp32").values()), device, what)


def check_batch_fits(batch_size: int, available: int, setting: str, data: str) -> None:
    """Refuse a batch larger than its data: ``setting`` (its value ``batch_size``) against the
    ``available`` records that ``data`` names."""
    if batch_size > available:
        raise ValueError(f"{setting}={batch_size} is more than the {available} {data}: make it at most {available}")
