"""Advantage estimators from verl 0.9's registry beyond the ones the book teaches (ch 7):
REINFORCE++-baseline, GPG, ReMax, OPO, pass@k GRPO, GDPO and the optimal token baseline (single-
and multi-turn). Each is registered under verl's name
(``algorithm.adv_estimator``) and equals verl's formula; the ``refppo`` package imports this module,
so the registry holds them whatever is imported first.

Per-token tensors are response-only, shape (batch, T), as in :mod:`refppo.advantages`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from refppo.advantages import compute_grpo_outcome_advantage, group_mean, group_scores, register_adv_est
from refppo.functional import last_valid_index, masked_whiten
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


# ---- GDPO: each reward component normalised in its group, then summed --------------------------
def _gdpo_components(
    config, non_tensor_batch, batch_size: int, dtype: torch.dtype, device: torch.device
) -> tuple[dict[str, torch.Tensor], list[float]] | None:
    """GDPO's reward components, ``{key: (batch,) scores}``, and their weights, from ``config``'s
    ``gdpo_reward_keys`` / ``gdpo_reward_weights`` and ``non_tensor_batch``; None where neither the
    config names components nor a ``non_tensor_batch`` is given (verl's fallback: the one component
    ``token_level_rewards``)."""
    get = config.get if config is not None else (lambda key, default=None: default)
    keys, weights = get("gdpo_reward_keys", None), get("gdpo_reward_weights", None)
    if non_tensor_batch is None:
        if keys or weights is not None:
            raise ValueError(
                "gdpo: the config names reward components (gdpo_reward_keys / gdpo_reward_weights) but no "
                "non_tensor_batch holds their scores"
            )
        return None
    if not keys:
        raise ValueError(
            "gdpo needs gdpo_reward_keys, the reward components to normalise one by one (keys of "
            "non_tensor_batch, which a reward function's dict results fill), e.g. ['format_reward', 'accuracy_reward']"
        )
    if isinstance(keys, str) or not isinstance(keys, Sequence) or not all(isinstance(k, str) for k in keys):
        raise ValueError(f"gdpo_reward_keys must be a list of names, got {keys!r}")
    if weights is None:
        weights = [1.0] * len(keys)
    if isinstance(weights, str) or not isinstance(weights, Sequence):
        raise ValueError(f"gdpo_reward_weights must be a list of numbers, got {weights!r}")
    if len(weights) != len(keys):
        raise ValueError(
            f"gdpo_reward_weights has {len(weights)} weights but gdpo_reward_keys names {len(keys)} components"
        )
    for key, w in zip(keys, weights):
        check_number(f"gdpo_reward_weights[{key!r}]", w, "(-inf, inf)")
    components = {}
    for key in keys:
        if key not in non_tensor_batch:
            raise ValueError(
                f"gdpo reward component {key!r} is not in non_tensor_batch (it holds {sorted(non_tensor_batch)}): "
                f"the reward function must return a dict with a {key!r} entry"
            )
        value = non_tensor_batch[key]
        try:
            scores = torch.as_tensor(value if isinstance(value, torch.Tensor) else np.asarray(value, dtype=np.float64))
        except (TypeError, ValueError) as error:
            raise ValueError(f"non_tensor_batch[{key!r}] must hold one number per response: {error}") from None
        if tuple(scores.shape) != (batch_size,) or scores.is_complex():
            raise ValueError(
                f"non_tensor_batch[{key!r}] must hold one real number per response, shape ({batch_size},), "
                f"got shape {tuple(scores.shape)}"
            )
        if scores.is_meta:
            raise ValueError(f"non_tensor_batch[{key!r}] is on the meta device: it holds no scores")
        components[key] = scores.to(device=device, dtype=dtype)
    return components, [float(w) for w in weights]


@register_adv_est("gdpo", reads=("gdpo_reward_keys", "gdpo_reward_weights"))
@torch.no_grad()
@checks_once
def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: ConfigView | None = None,
    non_tensor_batch: Mapping | None = None,
    batch: Mapping | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (Liu et al. 2026, verl 0.9's ``gdpo``): each reward component is normalised within its
    group on its own, as GRPO normalises a score (so a component with a large spread cannot drown
    the others), then the components are summed with their weights, and the sum is whitened over the
    batch's valid tokens.

    A_k = GRPO(r_k) for each component k (a group of one: r_k / (1 + epsilon), verl's rule),
    A = sum_k w_k A_k, and the advantage is masked_whiten(A, mask) * mask.

    The components are ``non_tensor_batch[key]`` for each key of ``config.gdpo_reward_keys`` (the
    extra entries of a reward function's dict results), weighted by ``config.gdpo_reward_weights``
    (default 1 each). Each is placed on its response's last valid token, as verl places it, in the
    dtype of ``token_level_rewards`` (float32 in the trainer, as verl's). Without a
    ``non_tensor_batch`` (and no components named in ``config``) the one component is
    ``token_level_rewards``, verl's fallback. verl reads ``batch``'s prompts and attention mask only
    to find each response's last token; refppo finds it from ``response_mask`` and leaves ``batch``
    unread. verl's trainer passes neither ``epsilon`` nor ``norm_adv_by_std_in_grpo``.

    Args:
        token_level_rewards: (batch, T); the fallback component's score is the row sum.
        response_mask: (batch, T) 0/1, at least 2 ones in the batch (for whitening).
        index: (batch,) group labels: a list of hashables or a tensor.
        epsilon: added to each group's std, >= 0.
        norm_adv_by_std_in_grpo: divide each component by its group's std.
        config: the algorithm's settings (``gdpo_reward_keys``, ``gdpo_reward_weights``), or None.
        non_tensor_batch: key -> (batch,) scores (a list, NumPy array or tensor) for each component.
        batch: unread (verl's signature).

    Returns:
        advantages, returns: both (batch, T), 0 at masked positions.

    Raises:
        ValueError: components expected (a ``non_tensor_batch``, or keys or weights in ``config``)
            without ``gdpo_reward_keys`` or without a ``non_tensor_batch``; a key missing from
            ``non_tensor_batch``; as many weights as keys not given; a component that is not
            (batch,) finite numbers; and :func:`refppo.advantages.compute_grpo_outcome_advantage`'s.
    """
    check_number("epsilon", epsilon, "[0, inf)")
    check_flag("norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo)
    check_ndim("token_level_rewards", token_level_rewards, 2)
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    dtype = work_dtype(token_level_rewards)
    found = _gdpo_components(config, non_tensor_batch, token_level_rewards.shape[0], dtype, token_level_rewards.device)
    components, weights = found if found is not None else ({}, [1.0])
    check_values(
        masks={"response_mask": response_mask},
        finite={
            "token_level_rewards": token_level_rewards,
            **{f"non_tensor_batch[{k!r}]": v for k, v in components.items()},
        },
        min_valid=("response_mask", response_mask, 2),  # the whitening's unbiased variance
    )
    group_ids(index, token_level_rewards.shape[0], token_level_rewards.device)  # refuse bad labels before any work
    if components:
        last = last_valid_index(response_mask)
        score_list = [
            torch.zeros_like(token_level_rewards, dtype=dtype).scatter_(1, last[:, None], s[:, None])
            for s in components.values()
        ]
    else:
        score_list = [token_level_rewards.to(dtype)]
    total = None
    for weight, scores in zip(weights, score_list):
        normalised, _ = compute_grpo_outcome_advantage(scores, response_mask, index, epsilon, norm_adv_by_std_in_grpo)
        total = weight * normalised if total is None else total + weight * normalised
    m = response_mask.to(total.dtype)
    adv = masked_whiten(total, m) * m
    return adv, adv


# ---- the optimal token baseline: a baseline per token, weighted by the path's variance ----------
def _otb_inputs(
    token_level_rewards,
    response_mask,
    index,
    old_log_probs,
    sum_pi_squared,
    rollout_is_weights,
    handle_zero_tail,
    epsilon,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The optimal token baseline's inputs checked, and what both of its forms start from.

    Returns:
        returns: (batch, T) each token's undiscounted reward-to-go over the valid tokens.
        w_cumulative: (batch, T) W_t, the sum over valid tokens j <= t of w_j = (1 - 2 pi_j +
            sum pi^2) * rho_j^2.
        mask: (batch, T) the mask in the dtype computed in.
        ids, n_groups: (batch,) each row's group in 0..n_groups - 1.
    """
    check_number("epsilon", epsilon, "(0, inf)")
    check_flag("handle_zero_tail", handle_zero_tail)
    check_ndim("token_level_rewards", token_level_rewards, 2)
    per_token = {"old_log_probs": old_log_probs, "sum_pi_squared": sum_pi_squared}
    if rollout_is_weights is not None:
        per_token["rollout_is_weights"] = rollout_is_weights
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask, **per_token)
    nonnegative = {"sum_pi_squared": sum_pi_squared}
    if rollout_is_weights is not None:
        nonnegative["rollout_is_weights"] = rollout_is_weights
    check_values(
        masks={"response_mask": response_mask},
        finite={"token_level_rewards": token_level_rewards, **per_token},
        nonnegative=nonnegative,
        where=response_mask,  # padding is never read
    )
    ids, n_groups = group_ids(index, token_level_rewards.shape[0], token_level_rewards.device)
    dtype = work_dtype(token_level_rewards, *per_token.values())
    m = response_mask.to(dtype)
    valid = response_mask.bool()
    zero = torch.zeros((), dtype=dtype, device=m.device)
    returns = torch.where(valid, token_level_rewards.to(dtype), zero).flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * torch.exp(old_log_probs.to(dtype)) + sum_pi_squared.to(dtype)
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.to(dtype) ** 2
    w_cumulative = torch.where(valid, w, zero).cumsum(-1)
    return returns, w_cumulative, m, ids, n_groups


def _group_sum(values: torch.Tensor, ids: torch.Tensor, n_groups: int) -> torch.Tensor:
    """(n_groups, *rest): the sum of ``values`` (batch, *rest) over each group's rows."""
    return torch.zeros((n_groups, *values.shape[1:]), dtype=values.dtype, device=values.device).index_add_(
        0, ids, values
    )


def _group_max(values: torch.Tensor, ids: torch.Tensor, n_groups: int) -> torch.Tensor:
    """(batch,): the largest of ``values`` (batch,) over each row's group."""
    out = torch.full((n_groups,), -torch.inf, dtype=values.dtype, device=values.device)
    return out.scatter_reduce_(0, ids, values, "amax")[ids]


def _unique_longest(lengths: torch.Tensor, members: torch.Tensor, ids: torch.Tensor, n_groups: int):
    """Each row's group's handle_zero_tail case, from the lengths of its ``members`` (bool (batch,)):
    whether the row is its group's unique longest member, and the length of the group's next
    longest member (where the cut starts)."""
    length = torch.where(members, lengths, torch.full_like(lengths, -1.0))
    longest = _group_max(length, ids, n_groups)
    at_longest = _group_sum((members & (length == longest)).to(lengths.dtype), ids, n_groups)[ids]
    is_longest = members & (length == longest)
    second = _group_max(torch.where(is_longest, torch.full_like(length, -1.0), length), ids, n_groups)
    return is_longest & (at_longest == 1), second.clamp(min=0)


def _token_baselines(
    returns: torch.Tensor,
    weights: torch.Tensor,
    lengths: torch.Tensor,
    counted: torch.Tensor,
    ids: torch.Tensor,
    n_groups: int,
    handle_zero_tail: bool,
    epsilon: float,
) -> torch.Tensor:
    """The optimal token baselines' B_t = sum_i G_it W_it / (sum_i W_it + epsilon) over each
    group's rows, each position apart; 0 for a group of one counted row; with ``handle_zero_tail``,
    0 on a group's unique longest row from the next longest's length on.

    Args:
        returns, weights: (batch, T) G and W, W 0 where a row has no token.
        lengths: (batch,) each row's count of valid tokens.
        counted: (batch,) bool, the rows a group's size counts.
        ids, n_groups: each row's group, and the number of groups.
        handle_zero_tail, epsilon: as the estimators take them.

    Returns:
        (batch, T) baselines.
    """
    size = _group_sum(counted.to(weights.dtype), ids, n_groups)[ids]
    b_star = _group_sum(returns * weights, ids, n_groups) / (_group_sum(weights, ids, n_groups) + epsilon)
    baselines = torch.where((size > 1)[:, None], b_star[ids], torch.zeros_like(weights))
    if handle_zero_tail:
        cut, second = _unique_longest(lengths, counted & (size > 1), ids, n_groups)
        positions = torch.arange(weights.shape[1], device=weights.device)
        baselines = torch.where(cut[:, None] & (positions[None, :] >= second[:, None]), 0.0, baselines)
    return baselines


@register_adv_est("optimal_token_baseline", reads=())
@torch.no_grad()
@checks_once
def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline (verl 0.9's ``optimal_token_baseline``): a baseline for each token
    position of each group, the group's returns at that position weighted by how much variance each
    path has gathered so far.

    G_t is the undiscounted reward-to-go; w_j = 1 - 2 pi_j + sum_v pi_v^2 (= |e_j - pi|^2, the
    squared norm of the score function's logit part; pi_j = exp(old_log_probs), sum pi^2 from
    :func:`refppo.functional.calculate_sum_pi_squared_from_logits`), times rho_j^2 with
    ``rollout_is_weights``; W_t = sum of w_j over valid j <= t. For each group and position t,
    B_t = sum_i G_it W_it m_it / (sum_i W_it m_it + epsilon) over the group's rows, and
    A_t = (G_t - B_t) * m_t. A group of one gets B = 0. With ``handle_zero_tail``, a group's unique
    longest response (by its count of valid tokens) gets B = 0 from the position equal to the next
    longest's count on, where it alone would set the baseline to its own return. Positions are the
    batch's columns: a masked position inside a response keeps its G_t and takes part in no
    baseline (see :func:`compute_multi_turn_optimal_token_baseline_advantage` for multi-turn data).

    Args:
        token_level_rewards: (batch, T) rewards.
        response_mask: (batch, T) 0/1.
        index: (batch,) group labels: a list of hashables or a tensor.
        old_log_probs: (batch, T) the log-probs of the sampled tokens under the policy that sampled.
        sum_pi_squared: (batch, T) sum over the vocabulary of the squared probabilities, >= 0.
        rollout_is_weights: (batch, T) >= 0 rollout-correction weights rho, or None.
        handle_zero_tail: cut the baseline of each group's unique longest response past the next longest.
        epsilon: added to the baseline's denominator, > 0.

    Returns:
        advantages: (batch, T) G_t - B_t on valid tokens, 0 elsewhere.
        returns: (batch, T) G_t.
    """
    returns, w_cumulative, m, ids, n_groups = _otb_inputs(
        token_level_rewards,
        response_mask,
        index,
        old_log_probs,
        sum_pi_squared,
        rollout_is_weights,
        handle_zero_tail,
        epsilon,
    )
    every_row = torch.ones_like(m[:, 0], dtype=torch.bool)
    baselines = _token_baselines(
        returns, w_cumulative * m, m.sum(-1), every_row, ids, n_groups, handle_zero_tail, epsilon
    )
    return (returns - baselines) * m, returns


@register_adv_est("tir_optimal_token_baseline", reads=())
@torch.no_grad()
@checks_once
def compute_multi_turn_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline for multi-turn (tool-integrated) responses, verl 0.9's
    ``tir_optimal_token_baseline``: :func:`compute_optimal_token_baseline_advantage`'s formula, with
    each response's valid tokens taken in order with the masked ones (a tool's output) left out, so
    that the baseline at a response's k-th generated token is made of the group's k-th generated
    tokens, wherever they sit in the batch's columns.

    For each group and k: B_k = sum_i G_ik W_ik / (sum_i W_ik + epsilon) over the group's rows with
    at least one valid token (a row shorter than k + 1 adds 0), G and W read at each row's k-th valid
    token; a group of one (such rows) gets B = 0, and ``handle_zero_tail`` cuts, as there, the
    unique longest row's baseline from k = the next longest's count on. The advantage at a row's
    k-th valid token is G - B_k; masked positions and rows with no valid token get 0.

    Args:
        token_level_rewards: (batch, T) rewards.
        response_mask: (batch, T) 0/1, 0 on the tokens the policy did not generate.
        index: (batch,) group labels: a list of hashables or a tensor.
        old_log_probs: (batch, T) the log-probs of the sampled tokens under the policy that sampled.
        sum_pi_squared: (batch, T) sum over the vocabulary of the squared probabilities, >= 0.
        rollout_is_weights: (batch, T) >= 0 rollout-correction weights rho, or None.
        handle_zero_tail: cut the baseline of each group's unique longest response past the next longest.
        epsilon: added to the baseline's denominator, > 0.

    Returns:
        advantages: (batch, T) G - B on valid tokens, 0 elsewhere.
        returns: (batch, T) G_t, the reward-to-go over the valid tokens, at every position.
    """
    returns, w_cumulative, m, ids, n_groups = _otb_inputs(
        token_level_rewards,
        response_mask,
        index,
        old_log_probs,
        sum_pi_squared,
        rollout_is_weights,
        handle_zero_tail,
        epsilon,
    )
    batch, width = m.shape
    valid = response_mask.bool()
    # the k-th valid token of each row goes to column k; masked positions to a spare column
    k = (m.cumsum(-1) - 1).long().clamp(min=0)
    column = torch.where(valid, k, width)
    zero = torch.zeros((), dtype=m.dtype, device=m.device)

    def packed(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(batch, width + 1, dtype=m.dtype, device=m.device)
        return out.scatter_add_(1, column, torch.where(valid, values, zero))[:, :width]

    packed_returns = packed(returns)
    packed_w = packed(w_cumulative)
    lengths = m.sum(-1)
    baselines = _token_baselines(
        packed_returns, packed_w, lengths, lengths > 0, ids, n_groups, handle_zero_tail, epsilon
    )
    advantages = (packed_returns - baselines).gather(1, k)
    return torch.where(valid, advantages, zero), returns
