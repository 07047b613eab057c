"""Advantage estimators: GAE (ch 4), GRPO and RLOO (ch 6), verl's others, and a registry by name.

All tensors are response-only, shape ``(batch, response_len)``; see design section 3.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refppo.checks import (
    check_flag,
    check_ndim,
    check_number,
    check_same_shape,
    check_tensors,
    check_values,
    checks_once,
)
from refppo.functional import masked_whiten
from refppo.registry import Registry

ADV_ESTIMATORS = Registry("advantage estimator")
# verl's names. An estimator receives, by parameter name, any key of the batch (``values`` only
# when it declares it: declaring ``values`` is what makes the trainer build a critic; declaring
# ``index`` makes the config ask for rollout.n >= 2) and any field of ``algorithm`` (gamma, lam,
# norm_adv_by_std_in_grpo, ...).
register_adv_est = ADV_ESTIMATORS.register
get_adv_estimator_fn = ADV_ESTIMATORS.get


def needs_critic(adv_estimator: str) -> bool:
    """Whether the estimator registered as ``adv_estimator`` reads a critic's ``values``."""
    return ADV_ESTIMATORS.takes(adv_estimator, "values")


def _work_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


@register_adv_est("gae")
@torch.no_grad()
@checks_once
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float | torch.Tensor,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2015): verl's reverse loop over tokens,
    every row at once.

    delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lam * A_{t+1}, where
    "t+1" is the next position with mask 1. A position with mask 0 inside a response (a tool
    or observation token in multi-turn data) is skipped: it carries the next value and the
    running advantage through unchanged, so it holds the advantage of the next valid token
    (0 after the last one), not 0. Masked positions never reach a loss.

    Example (seed 004): rewards [0, 0, 0, 1], values [.2, .3, .4, .5], mask [0, 0, 1, 1],
    gamma .99, lam .95 give raw advantages [0.56525, 0.56525, 0.56525, 0.5].

    Args:
        token_level_rewards: (batch, T) rewards, e.g. score on the last token minus beta * KL.
        values: (batch, T) critic values V(s_t) of the state before each response token.
        response_mask: (batch, T) 0/1, at least 2 ones in the batch (for whitening).
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        advantages: (batch, T) whitened over the mask.
        returns: (batch, T) raw advantages + values, the critic's targets.
    """
    r, v, m = checked_gae_inputs(token_level_rewards, values, response_mask, gamma, lam)
    next_value, last_gae, reversed_advantages = 0.0, 0.0, []
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        gae = delta + gamma * lam * last_gae
        # a masked token is skipped: it passes the next value and advantage back unchanged
        next_value = v[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        last_gae = gae * m[:, t] + (1 - m[:, t]) * last_gae
        reversed_advantages.append(last_gae)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    returns = advantages + v
    return masked_whiten(advantages, m), returns


def checked_gae_inputs(token_level_rewards, values, response_mask, gamma, lam) -> tuple[torch.Tensor, ...]:
    """GAE's inputs checked (shapes, 0/1 mask, finite values at least 2 valid tokens, gamma and
    lam in [0, 1]) and in one float dtype: float32, or wider if an input is."""
    check_ndim("token_level_rewards", token_level_rewards, 2)
    check_same_shape(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    check_number("gamma", gamma, "[0, 1]")
    check_number("lam", lam, "[0, 1]")
    check_values(
        masks={"response_mask": response_mask},
        finite={"token_level_rewards": token_level_rewards, "values": values},
        min_valid=("response_mask", response_mask, 2),  # the whitening's unbiased variance
    )
    dtype = _work_dtype(token_level_rewards, values)
    return token_level_rewards.to(dtype), values.to(dtype), response_mask.to(dtype)


def _group_ids(index: Sequence | torch.Tensor, batch: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map group labels (prompt uids) to 0..G-1; returns ((batch,) long ids, G)."""
    if isinstance(index, torch.Tensor) and index.dim() != 1 or not hasattr(index, "__len__"):
        raise ValueError(f"index must be a (batch,) sequence of group labels, got {type(index).__name__}")
    if len(index) != batch:
        raise ValueError(f"index has {len(index)} entries but the batch has {batch} rows")
    if isinstance(index, torch.Tensor):
        if index.is_meta:  # another device is fine (the ids are moved), but meta holds no labels
            raise ValueError("index is on the meta device: it holds no group labels")
        uniq, ids = torch.unique(index, return_inverse=True)
        return ids.to(device), len(uniq)
    lookup: dict = {}
    try:
        ids = [lookup.setdefault(key, len(lookup)) for key in index]
    except TypeError as error:
        raise ValueError(f"index entries must be hashable group labels: {error}") from None
    return torch.tensor(ids, dtype=torch.long, device=device), len(lookup)


def _group_scores(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index, min_valid: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row outcome scores and, per row, its group's count, sum and sum of squared deviations
    (the inputs checked, with at least ``min_valid`` valid tokens)."""
    check_ndim("token_level_rewards", token_level_rewards, 2)
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    check_values(
        masks={"response_mask": response_mask},
        finite={"token_level_rewards": token_level_rewards},
        min_valid=("response_mask", response_mask, min_valid) if min_valid else None,
    )
    scores = token_level_rewards.to(_work_dtype(token_level_rewards)).sum(dim=-1)
    ids, n_groups = _group_ids(index, scores.shape[0], scores.device)
    count = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, torch.ones_like(scores))
    total = torch.zeros_like(count).index_add_(0, ids, scores)
    mean = total / count
    sq_dev = torch.zeros_like(count).index_add_(0, ids, (scores - mean[ids]) ** 2)
    return scores, count[ids], total[ids], sq_dev[ids]


def _group_mean(n: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Each row's group mean from its group's count and sum; a group of one has mean 0 (verl's rule)."""
    return torch.where(n == 1, torch.zeros_like(total), total / n)


@register_adv_est("grpo", "grpo_vectorized")  # verl's two names for one formula
@torch.no_grad()
@checks_once
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: each response's score minus its group's mean, divided by the group's std.

    The score is the row sum of ``token_level_rewards``; a group is the rows that share an
    ``index`` label (the ``rollout.n`` samples of one prompt). The std is unbiased, as
    torch.std. A group of one gets mean 0 and std 1 (verl's rule).

    Args:
        token_level_rewards: (batch, T).
        response_mask: (batch, T) 0/1.
        index: (batch,) group labels: a list of hashables or a tensor.
        epsilon: added to the std, >= 0.
        norm_adv_by_std_in_grpo: divide by the std (False gives Dr. GRPO's mean-only baseline).

    Returns:
        advantages, returns: both (batch, T), the per-row advantage on every valid token.
    """
    check_number("epsilon", epsilon, "[0, inf)")
    check_flag("norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo)
    scores, n, total, sq_dev = _group_scores(token_level_rewards, response_mask, index)
    std = torch.where(n == 1, torch.ones_like(total), torch.sqrt(sq_dev / (n - 1).clamp(min=1)))
    adv = scores - _group_mean(n, total)
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + epsilon)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_est("rloo")
@torch.no_grad()
@checks_once
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: each response's score minus the mean score of the other responses of its group.

    s_i - (sum_j s_j - s_i) / (n - 1), which equals n / (n - 1) * (s_i - mean). A group of
    one keeps its raw score (verl's rule).

    Args:
        token_level_rewards: (batch, T).
        response_mask: (batch, T) 0/1.
        index: (batch,) group labels: a list of hashables or a tensor.

    Returns:
        advantages, returns: both (batch, T).
    """
    scores, n, total, _ = _group_scores(token_level_rewards, response_mask, index)
    loo_mean = (total - scores) / (n - 1).clamp(min=1)
    adv = torch.where(n == 1, scores, scores - loo_mean)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_est("reinforce_plus_plus")
@torch.no_grad()
@checks_once
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): each token's discounted return, whitened over the batch; no critic,
    no groups (verl 0.9's ``reinforce_plus_plus``).

    G_t = r_t + gamma * G_{t+1}, where "t+1" is the next position with mask 1; a masked position
    carries the running return through, as in GAE. The per-token KL of ``use_kl_in_reward`` is
    part of r_t, which is how REINFORCE++ keeps near the reference.

    Args:
        token_level_rewards: (batch, T) rewards.
        response_mask: (batch, T) 0/1, at least 2 ones in the batch (for whitening).
        gamma: discount in [0, 1].

    Returns:
        advantages: (batch, T) the returns whitened over the mask, 0 at masked positions.
        returns: (batch, T) G_t at valid positions, 0 elsewhere.
    """
    check_ndim("token_level_rewards", token_level_rewards, 2)
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    check_number("gamma", gamma, "[0, 1]")
    check_values(
        masks={"response_mask": response_mask},
        finite={"token_level_rewards": token_level_rewards},
        min_valid=("response_mask", response_mask, 2),
    )
    r = token_level_rewards.to(_work_dtype(token_level_rewards))
    m = response_mask.to(r.dtype)
    running, returns = 0.0, torch.zeros_like(r)
    for t in reversed(range(r.shape[1])):
        g = r[:, t] + gamma * running
        returns[:, t] = g * m[:, t]
        running = g * m[:, t] + (1 - m[:, t]) * running
    return masked_whiten(returns, m) * m, returns


@register_adv_est("reinforce_plus_plus_baseline")
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
    scores, n, total, _ = _group_scores(token_level_rewards, response_mask, index, min_valid=2)
    centred = scores - _group_mean(n, total)
    m = response_mask.to(centred.dtype)
    adv = masked_whiten(centred.unsqueeze(-1) * m, m) * m
    return adv, adv


@register_adv_est("gpg")
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
    scores, n, total, _ = _group_scores(token_level_rewards, response_mask, index)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
    adv = alpha * (scores - _group_mean(n, total))
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_est("remax")
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
    dtype = _work_dtype(token_level_rewards, reward_baselines)
    m = response_mask.to(dtype)
    returns = (token_level_rewards.to(dtype) * m).flip(-1).cumsum(-1).flip(-1)
    return returns - reward_baselines.to(dtype).unsqueeze(-1) * m, returns


def _group_reduce(values: torch.Tensor, index, how: str) -> torch.Tensor:
    """Each row's group ``how`` ("sum" or "amax") of ``values`` (batch,)."""
    ids, n_groups = _group_ids(index, values.shape[0], values.device)
    start = 0.0 if how == "sum" else -torch.inf
    out = torch.full((n_groups,), start, dtype=values.dtype, device=values.device)
    return out.scatter_reduce_(0, ids, values, how)[ids]


@register_adv_est("opo")
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
    scores, n, _, _ = _group_scores(token_level_rewards, response_mask, index)
    lengths = response_mask.to(scores.dtype).sum(-1)
    weighted = _group_reduce(lengths * scores, index, "sum") / _group_reduce(lengths, index, "sum").clamp(min=1)
    adv = scores - torch.where(n == 1, torch.zeros_like(weighted), weighted)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_est("grpo_passk")
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
    scores, n, _, sq_dev = _group_scores(token_level_rewards, response_mask, index)
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
