"""GAE without a loop over tokens (:func:`refppo.advantages.compute_gae_advantage_return`'s
numbers, to float rounding): each row's valid tokens are packed to the front, where the
recursion has the constant coefficient gamma * lam, so the advantages are a discounted reverse
cumulative sum, computed as two small block matrix products; one gather reads them back. A few
dozen tensor operations instead of a handful per token, which matters on a GPU, where each costs a
launch. Figures: ``benchmarks/README.md`` (GAE).
"""

from __future__ import annotations

import math

import torch

from refppo.functional import masked_whiten
from refppo.guards.inputs import checked_gae_inputs


def discounted_reverse_cumsum(x: torch.Tensor, discount: float | torch.Tensor) -> torch.Tensor:
    """y_t = x_t + discount * y_{t+1} (y_T = 0) for every t: returns-to-go, GAE's sum.

    Computed as block matrix products instead of a loop over t: inside blocks of k positions
    y = x @ M^T with M[i, j] = discount^(j - i) (j >= i), then each block adds the carry from
    the blocks after it. Only powers <= 1 appear (no division), so discount = 0 is exact.

    Args:
        x: (batch, T) tensor.
        discount: scalar in [0, 1].

    Returns:
        (batch, T) tensor of the same dtype.
    """
    rows, length = x.shape
    discount = torch.as_tensor(discount, dtype=x.dtype, device=x.device)  # a float or a 0-dim tensor
    k = max(1, math.isqrt(length))
    n_blocks = -(-length // k)
    xb = torch.nn.functional.pad(x, (0, n_blocks * k - length)).view(rows, n_blocks, k)
    steps = torch.arange(k, device=x.device)
    gap = (steps[None, :] - steps[:, None]).to(x.dtype)  # gap[i, j] = j - i
    inner = torch.where(
        gap >= 0, torch.pow(discount, gap.clamp(min=0)), torch.zeros((), dtype=x.dtype, device=x.device)
    )
    local = xb @ inner.T  # (rows, n_blocks, k): sums inside each block
    blocks = torch.arange(n_blocks, device=x.device)
    bgap = (blocks[None, :] - blocks[:, None]).to(x.dtype)
    outer = torch.where(
        bgap >= 0, torch.pow(discount, k * bgap.clamp(min=0)), torch.zeros((), dtype=x.dtype, device=x.device)
    )
    heads = local[..., 0] @ outer.T  # (rows, n_blocks): y at the first position of each block
    carry = torch.nn.functional.pad(heads[:, 1:], (0, 1))  # y at the start of the next block
    y = local + carry[..., None] * torch.pow(discount, (k - steps).to(x.dtype))
    return y.reshape(rows, n_blocks * k)[:, :length]


@torch.no_grad()
def packed_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float | torch.Tensor,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`refppo.advantages.compute_gae_advantage_return` (same arguments and results) by a
    packed discounted cumulative sum instead of a loop over tokens."""
    r, v, m = checked_gae_inputs(token_level_rewards, values, response_mask, gamma, lam)
    rows, length = r.shape
    # 1. Pack each row's valid tokens to the front; column `length` collects the masked ones.
    before = (torch.cumsum(m, dim=-1) - m).long()  # valid tokens before t = packed index of the next one
    slot = torch.where(m.bool(), before, length)
    packed_r = r.new_zeros(rows, length + 1).scatter_(1, slot, r)[:, :length]
    packed_v = v.new_zeros(rows, length + 1).scatter_(1, slot, v)[:, :length]
    # 2. In packed order "next valid token" is just t + 1, and zeros follow the last one.
    next_v = torch.nn.functional.pad(packed_v[:, 1:], (0, 1))
    delta = packed_r + gamma * next_v - packed_v
    packed_adv = torch.nn.functional.pad(discounted_reverse_cumsum(delta, gamma * lam), (0, 1))
    # 3. Every position reads the advantage of the next valid token at or after it.
    advantages = packed_adv.gather(1, before)
    returns = advantages + v
    return masked_whiten(advantages, m), returns
