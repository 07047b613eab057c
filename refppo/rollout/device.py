"""Where the models run and in what precision: the device, bf16 autocast on CUDA, and the
attention kernels a pass that is backpropagated may use."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str) -> torch.device:
    """``trainer.device`` as a torch device: "auto" is CUDA when one is available, else the CPU.

    Raises:
        ValueError: "cuda" without a CUDA device, or a name not in ``DEVICES``.
    """
    if name not in DEVICES:
        raise ValueError(f"trainer.device={name!r} is not one of {', '.join(DEVICES)}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA device is available")
    return torch.device(name)


def autocast(device: torch.device):
    """bf16 autocast on CUDA (weights and optimiser stay float32), nothing on the CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def trainable_attention():
    """Every attention kernel but cuDNN's, for a forward pass that may be backpropagated.

    cuDNN's attention backward returns NaN query gradients when a mask is passed, the sequence
    is 64 tokens past a multiple of 128 wide, and a query row attends to nothing
    (pytorch/pytorch#196678): the left padding of a ragged batch is such a row. Flash and
    memory-efficient attention take its place; on a CPU the choice is unchanged.
    """
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@contextlib.contextmanager
def trainable_forward(device: torch.device) -> Iterator[None]:
    """The context of a forward pass that may be backpropagated: :func:`autocast` and
    :func:`trainable_attention`."""
    with autocast(device), trainable_attention():
        yield
