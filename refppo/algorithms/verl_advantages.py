"""Advantage estimators from verl 0.9's registry beyond the ones the book teaches (ch 7):
REINFORCE++-baseline, GPG, ReMax, OPO and pass@k GRPO. Each is registered under verl's name
(``algorithm.adv_estimator``) and equals verl's formula; the ``refppo`` package imports this module,
so the registry holds them whatever is imported first.

Per-token tensors are response-only, shape (batch, T), as in :mod:`refppo.advantages`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refppo.advantages import group_mean, group_scores, register_adv_est
from refppo.functional import masked_whiten
from refppo.guards.checks import (
    check_flag,
    check_ndim,
    check_number,
    check_same_shape,
    check_tensors,
    check_values,
    checks_once,
)
from refppo.guards.inputs import group_ids, work_dtype
from refppo.registry import ConfigView


@torch.no_grad()
@checks_once
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025): each response's score minus its group's mean, on every
    valid token, then whitened over the batch (verl 0.9's ``reinforce_plus_plus_baseline``). A
    group of one keeps its raw score (mean 0, verl's rule).

    Args:
        token_level_rewards: (batch, T); the score is the row sum.
        response_mask: (batch, T) 0/1, at least 2 ones in the batch (for whitening).
        index: (batch,) group labels: a list of hashables or a tensor.

    Returns:
        advantages, returns: both (batch, T), 0 at masked positions.
    """
    scores, n, total, _ = group_scores(token_level_rewards, response_mask, index, min_valid=2)
    centred = scores - group_mean(n, total)
    m = response_mask.to(centred.dtype)
    adv = masked_whiten(centred.unsqueeze(-1) * m, m) * m
    return adv, adv


@torch.no_grad()
@checks_once
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025): each response's score minus its group's mean, scaled by
    alpha = batch / (responses with a nonzero score), which undoes the dilution of the gradient by
    responses that carry no signal (verl 0.9's ``gpg``, whose ``f_norm`` is 1). A group of one keeps
    its raw score.

    Args:
        token_level_rewards: (batch, T); the score is the row sum.
        response_mask: (batch, T) 0/1.
        index: (batch,) group labels: a list of hashables or a tensor.

    Returns:
        advantages, returns: both (batch, T), the per-row advantage on every valid token.
    """
    scores, n, total, _ = group_scores(token_level_rewards, response_mask, index)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
    adv = alpha * (scores - group_mean(n, total))
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@torch.no_grad()
@checks_once
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2024): each token's reward-to-go minus the score of the greedy response to
    the same prompt; no critic, no groups, no whitening (verl 0.9's ``remax``). Declaring
    ``reward_baselines`` is what makes the trainer generate and score a greedy response per prompt.

    G_t = sum of r_s * mask_s over s >= t (undiscounted), and A_t = G_t - b * mask_t. As in verl,
    a masked position inside a response keeps its G_t (no loss reads it).

    Args:
        token_level_rewards: (batch, T) rewards: the score on the last token, minus beta * KL
            with ``algorithm.use_kl_in_reward``.
        reward_baselines: (batch,) the greedy response's score for each row's prompt.
        response_mask: (batch, T) 0/1.

    Returns:
        advantages: (batch, T) G_t - b at valid positions.
        returns: (batch, T) G_t.
    """
    check_ndim("token_level_rewards", token_level_rewards, 2)
    check_ndim("reward_baselines", reward_baselines, 1)
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    check_tensors(token_level_rewards=token_level_rewards, reward_baselines=reward_baselines)
    if reward_baselines.shape[0] != token_level_rewards.shape[0]:
        rows = token_level_rewards.shape[0]
        raise ValueError(f"reward_baselines has {reward_baselines.shape[0]} rows but token_level_rewards has {rows}")
    check_values(
        masks={"response_mask": response_mask},
        finite={"token_level_rewards": token_level_rewards, "reward_baselines": reward_baselines},
    )
    dtype = work_dtype(token_level_rewards, reward_baselines)
    m = response_mask.to(dtype)
    returns = (token_level_rewards.to(dtype) * m).flip(-1).cumsum(-1).flip(-1)
    return returns - reward_baselines.to(dtype).unsqueeze(-1) * m, returns


def _group_reduce(values: torch.Tensor, index, how: str) -> torch.Tensor:
    """Each row's group ``how`` ("sum" or "amax") of ``values`` (batch,)."""
    ids, n_groups = group_ids(index, values.shape[0], values.device)
    start = 0.0 if how == "sum" else -torch.inf
    out = torch.full((n_groups,), start, dtype=values.dtype, device=values.device)
    return out.scatter_reduce_(0, ids, values, how)[ids]


@torch.no_grad()
@checks_once
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025): each response's score minus its group's mean score weighted by
    response length, the baseline that is optimal for on-policy sequence-level rewards; on every
    valid token, and a group of one keeps its raw score (verl 0.9's ``opo``). A group whose
    responses are all empty gets baseline 0 (verl divides 0 by 0).

    Args:
        token_level_rewards: (batch, T); the score is the row sum.
        response_mask: (batch, T) 0/1; a row's length is its sum.
        index: (batch,) group labels: a list of hashables or a tensor.

    Returns:
        advantages, returns: both (batch, T), the per-row advantage on every valid token.
    """
    scores, n, _, _ = group_scores(token_level_rewards, response_mask, index)
    lengths = response_mask.to(scores.dtype).sum(-1)
    weighted = _group_reduce(lengths * scores, index, "sum") / _group_reduce(lengths, index, "sum").clamp(min=1)
    adv = scores - torch.where(n == 1, torch.zeros_like(weighted), weighted)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@torch.no_grad()
@checks_once
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training (Chen et al. 2025) as verl 0.9's ``grpo_passk``: only each group's best
    response learns, with advantage r_max - r_second (the best score minus the next one), divided
    by the group's unbiased std + ``epsilon`` when ``norm_adv_by_std_in_grpo``. Where the best
    score is tied, the advantage is 0 whichever response verl's top-k picks.

    Args:
        token_level_rewards: (batch, T); the score is the row sum.
        response_mask: (batch, T) 0/1.
        index: (batch,) group labels; every group needs at least 2 responses.
        epsilon: added to the std, >= 0.
        norm_adv_by_std_in_grpo: divide by the std.

    Returns:
        advantages, returns: both (batch, T), nonzero only on the valid tokens of each group's best.
    """
    check_number("epsilon", epsilon, "[0, inf)")
    check_flag("norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo)
    scores, n, _, sq_dev = group_scores(token_level_rewards, response_mask, index)
    if bool((n < 2).any()):
        raise ValueError("grpo_passk compares each group's best response with its second: every group needs >= 2")
    best = _group_reduce(scores, index, "amax")
    is_best = scores == best
    ties = _group_reduce(is_best.to(scores.dtype), index, "sum") > 1
    below = _group_reduce(torch.where(is_best, -torch.inf, scores), index, "amax")
    gap = torch.where(ties, torch.zeros_like(best), best - below)
    if norm_adv_by_std_in_grpo:
        gap = gap / (torch.sqrt(sq_dev / (n - 1)) + epsilon)
    adv = torch.where(is_best, gap, torch.zeros_like(gap)).unsqueeze(-1) * response_mask
    return adv, adv


# ---- the registry's entries: verl's call (token_level_rewards, response_mask, config, index) ----
@register_adv_est("reinforce_plus_plus_baseline", reads=())
def reinforce_plus_plus_baseline_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: ConfigView, index: Sequence | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compute_reinforce_plus_plus_baseline_outcome_advantage` as verl calls it; tensors (batch, T)."""
    return compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index)


@register_adv_est("gpg", reads=())
def gpg_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: ConfigView, index: Sequence | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compute_gpg_outcome_advantage` as verl calls it; tensors (batch, T)."""
    return compute_gpg_outcome_advantage(token_level_rewards, response_mask, index)


@register_adv_est("remax", reads=())
def remax_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: ConfigView,
    index: Sequence | torch.Tensor,
    reward_baselines: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compute_remax_outcome_advantage` as verl calls it (``index`` unread); tensors (batch, T),
    ``reward_baselines`` (batch,)."""
    return compute_remax_outcome_advantage(token_level_rewards, reward_baselines, response_mask)


@register_adv_est("opo", reads=())
def opo_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: ConfigView, index: Sequence | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compute_opo_outcome_advantage` as verl calls it; tensors (batch, T)."""
    return compute_opo_outcome_advantage(token_level_rewards, response_mask, index)


@register_adv_est("grpo_passk", reads=("norm_adv_by_std_in_grpo",))
def grpo_passk_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: ConfigView, index: Sequence | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compute_grpo_passk_outcome_advantage` as verl calls it, ``norm_adv_by_std_in_grpo``
    read from ``config`` as verl reads it; tensors (batch, T)."""
    norm_adv_by_std_in_grpo = config.get("norm_adv_by_std_in_grpo", True)
    return compute_grpo_passk_outcome_advantage(
        token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo
    )
