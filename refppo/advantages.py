"""Advantage estimators the book teaches: GAE (ch 4), GRPO and RLOO (ch 6), REINFORCE++ (ch 7), and a
registry by name (verl's other estimators: :mod:`refppo.algorithms.verl_advantages`).

All tensors are response-only, shape ``(batch, response_len)`` (the layout of :mod:`refppo.rollout.prompts`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from refppo.functional import masked_whiten
from refppo.guards.checks import check_choice, check_flag, check_number, check_same_shape, check_values, checks_once
from refppo.guards.inputs import check_outcome_inputs, checked_gae_inputs, checked_return_inputs, group_ids, work_dtype
from refppo.registry import ConfigView, Registry

ADV_ESTIMATORS = Registry("advantage estimator")
# verl's names, called as verl 0.9's compute_advantage calls them (:func:`compute_advantage`).
register_adv_est = ADV_ESTIMATORS.register
get_adv_estimator_fn = ADV_ESTIMATORS.get
# the estimators verl passes each token's sum of squared probabilities and the old log-probs
TOKEN_BASELINES = ("optimal_token_baseline", "tir_optimal_token_baseline")


def needs_critic(adv_estimator: str) -> bool:
    """Whether ``adv_estimator`` reads a critic's values: GAE alone, as in verl."""
    check_choice("adv_estimator", adv_estimator, ADV_ESTIMATORS.names())
    return adv_estimator == "gae"


def compute_advantage(
    data: dict[str, torch.Tensor],
    adv_estimator: str,
    adv_estimator_fn: Callable,
    config,
    non_tensor_batch: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's advantages and returns, with the estimator called as verl 0.9's
    ``compute_advantage`` calls it.

    GAE receives the critic's ``values``, ``gamma`` and ``lam``; GRPO the group labels ``index`` and
    ``norm_adv_by_std_in_grpo``; every other estimator ``token_level_rewards``, ``response_mask``,
    ``config`` (the algorithm's settings, a :class:`refppo.registry.ConfigView`) and ``index``, and
    ``reward_baselines`` when the batch holds them (ReMax); the optimal token baselines also
    ``sum_pi_squared``, ``old_log_probs`` and ``rollout_is_weights`` (None without), and GDPO
    ``non_tensor_batch`` and ``batch``. An estimator written for verl's registry therefore runs
    unchanged.

    Args:
        data: the batch: ``token_level_rewards`` and ``response_mask`` (batch, T), ``index``
            (batch,), and ``values`` (batch, T) for GAE, ``reward_baselines`` (batch,) for ReMax,
            ``sum_pi_squared`` and ``old_log_probs`` (batch, T) for the optimal token baselines.
        adv_estimator: the estimator's name (``algorithm.adv_estimator``).
        adv_estimator_fn: the function to call, ``get_adv_estimator_fn(adv_estimator)`` or a
            faster one that equals it.
        config: the algorithm's settings (:class:`refppo.settings.config.AlgorithmConfig`).
        non_tensor_batch: verl's per-response values beside the tensors: the reward function's
            components by name, (batch,) each, which GDPO reads.

    Returns:
        advantages, returns: both (batch, T).
    """
    check_choice("adv_estimator", adv_estimator, ADV_ESTIMATORS.names())
    if adv_estimator == "gae":
        return adv_estimator_fn(
            token_level_rewards=data["token_level_rewards"],
            values=data["values"],
            response_mask=data["response_mask"],
            gamma=config.gamma,
            lam=config.lam,
        )
    if adv_estimator == "grpo":
        return adv_estimator_fn(
            token_level_rewards=data["token_level_rewards"],
            response_mask=data["response_mask"],
            index=data["index"],
            norm_adv_by_std_in_grpo=config.norm_adv_by_std_in_grpo,
        )
    adv_kwargs = {
        "token_level_rewards": data["token_level_rewards"],
        "response_mask": data["response_mask"],
        "config": ConfigView(vars(config)),
        "index": data["index"],
    }
    if "reward_baselines" in data:
        adv_kwargs["reward_baselines"] = data["reward_baselines"]
    if adv_estimator in TOKEN_BASELINES:
        if "sum_pi_squared" not in data:  # verl asserts it too
            raise ValueError(
                f"adv_estimator={adv_estimator} reads the batch's sum_pi_squared: set "
                "actor.calculate_sum_pi_squared=true"
            )
        adv_kwargs["sum_pi_squared"] = data["sum_pi_squared"]
        adv_kwargs["old_log_probs"] = data["old_log_probs"]
        adv_kwargs["rollout_is_weights"] = data.get("rollout_is_weights")
    if adv_estimator == "gdpo":
        adv_kwargs["non_tensor_batch"] = {} if non_tensor_batch is None else non_tensor_batch
        adv_kwargs["batch"] = data
    return adv_estimator_fn(**adv_kwargs)


@register_adv_est("gae", reads=("gamma", "lam"))
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
    next_value = 0.0
    last_gae = 0.0
    reversed_advantages = []
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


def group_scores(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index, min_valid: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each response's outcome score and, per row, the statistics of its group (the rows that
    share an ``index`` label), for the group estimators.

    Args:
        token_level_rewards: (batch, T); a response's score is its row sum.
        response_mask: (batch, T) 0/1, with at least ``min_valid`` ones.
        index: (batch,) group labels: a list of hashables or a tensor.
        min_valid: the fewest valid tokens the batch may hold (2 for an estimator that whitens).

    Returns:
        scores, count, total, sq_dev: each (batch,), the row's score, and its group's size, score
        sum and sum of squared deviations from the group's mean.
    """
    check_outcome_inputs(token_level_rewards, response_mask, min_valid)
    scores = token_level_rewards.to(work_dtype(token_level_rewards)).sum(dim=-1)
    ids, n_groups = group_ids(index, scores.shape[0], scores.device)
    count = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, torch.ones_like(scores))
    total = torch.zeros_like(count).index_add_(0, ids, scores)
    mean = total / count
    sq_dev = torch.zeros_like(count).index_add_(0, ids, (scores - mean[ids]) ** 2)
    return scores, count[ids], total[ids], sq_dev[ids]


@checks_once
def group_mean(count: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Each row's group mean from its group's size and score sum (:func:`group_scores`); a group
    of one has mean 0 (verl's rule: its response keeps its raw score).

    Args:
        count, total: (batch,) each row's group size (>= 1) and score sum.

    Returns:
        (batch,) means.
    """
    check_same_shape(count=count, total=total)
    check_values(finite={"count": count, "total": total}, violations={"count must be >= 1 (a group's size)": count < 1})
    return torch.where(count == 1, torch.zeros_like(total), total / count)


@register_adv_est("grpo", reads=("norm_adv_by_std_in_grpo",))
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
    torch.std. A group of one gets mean 0 and std 1 (verl's rule). The group statistics are taken
    in float64, so a group of equal scores gets advantage 0 even where float32 cannot hold the
    score (verl's float32 mean is off by a rounding step there, which the std near 0 blows up).

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
    scores, n, total, sq_dev = group_scores(token_level_rewards.double(), response_mask, index)
    std = torch.where(n == 1, torch.ones_like(total), torch.sqrt(sq_dev / (n - 1).clamp(min=1)))
    adv = scores - group_mean(n, total)
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + epsilon)
    adv = adv.to(work_dtype(token_level_rewards)).unsqueeze(-1) * response_mask
    return adv, adv


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
    scores, n, total, _ = group_scores(token_level_rewards, response_mask, index)
    loo_mean = (total - scores) / (n - 1).clamp(min=1)
    adv = torch.where(n == 1, scores, scores - loo_mean)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


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
    r, m = checked_return_inputs(token_level_rewards, response_mask, gamma)
    running = 0.0
    returns = torch.zeros_like(r)
    for t in reversed(range(r.shape[1])):
        g = r[:, t] + gamma * running
        returns[:, t] = g * m[:, t]
        running = g * m[:, t] + (1 - m[:, t]) * running
    return masked_whiten(returns, m) * m, returns


# ---- the registry's other entries: verl's call (token_level_rewards, response_mask, config, index) ----
@register_adv_est("grpo_vectorized", reads=())
def grpo_vectorized_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: ConfigView, index: Sequence | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compute_grpo_outcome_advantage` under verl's second name, always divided by the
    std: verl's generic call never passes ``norm_adv_by_std_in_grpo`` to it. Tensors (batch, T)."""
    return compute_grpo_outcome_advantage(token_level_rewards, response_mask, index)


@register_adv_est("rloo", reads=())
def rloo_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: ConfigView, index: Sequence | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compute_rloo_outcome_advantage` as verl calls it; tensors (batch, T)."""
    return compute_rloo_outcome_advantage(token_level_rewards, response_mask, index)


@register_adv_est("reinforce_plus_plus", reads=("gamma",))
def reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: ConfigView, index: Sequence | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compute_reinforce_plus_plus_outcome_advantage` as verl calls it, ``gamma`` read from
    ``config`` (``index`` unread); tensors (batch, T)."""
    return compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma=config.gamma)
