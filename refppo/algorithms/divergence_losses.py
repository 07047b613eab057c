"""Policy losses from verl 0.9's registry that bound how far each token's probability moves rather
than its ratio (ch 7): DPPO's total-variation and binary-KL masks, and DRO's squared log-ratio
penalty. Each is registered under verl's name (``actor.policy_loss``) and equals verl's formula;
the ``refppo`` package imports this module, so the registry holds them whatever is imported first.

Per-token tensors are response-only, shape (batch, T), as in :mod:`refppo.losses`.
"""

from __future__ import annotations

import torch

from refppo.functional import masked_mean
from refppo.guards.checks import check_number, checks_once
from refppo.guards.inputs import check_pair_inputs, clip_bounds
from refppo.losses import CLIP_SETTINGS, agg_loss, register_policy_loss
from refppo.registry import ConfigView


def _dppo(old_log_prob, log_prob, advantages, response_mask, kept, clip_ratio_c, rollout_is_weights, agg):
    """DPPO's loss once the kept tokens are known: -A * sg(min(ratio, clip_ratio_c)) * log pi_theta
    on the ``kept`` tokens (bool, (batch, T)), 0 on the others; ``agg`` = (mode, scale factor)."""
    if clip_ratio_c is not None:
        check_number("clip_ratio_c", clip_ratio_c, "(1, inf)")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    truncated = ratio if clip_ratio_c is None else torch.clamp(ratio, max=clip_ratio_c)
    kept = kept.detach().to(log_prob.dtype)
    pg_losses = -advantages * truncated.detach() * log_prob * kept
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    over = torch.zeros_like(kept) if clip_ratio_c is None else (ratio > clip_ratio_c).to(kept.dtype)
    metrics = {
        "actor/pg_clipfrac": masked_mean(1.0 - kept, response_mask).detach(),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
        "actor/pg_clipfrac_lower": masked_mean(over * kept, response_mask).detach(),
    }
    return agg_loss(pg_losses, response_mask, *agg), metrics


@checks_once
def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV (verl 0.9's ``dppo_tv``): the policy gradient -A * sg(ratio) * log pi_theta,
    which is PPO's gradient, on the tokens whose probability has not yet moved past the threshold
    in the advantage's direction: pi_theta - pi_old <= high where A > 0, >= -low where A <= 0.
    The clip bounds are thresholds on that difference here, not on the ratio; the ratio is
    truncated at ``clip_ratio_c`` (null: not truncated).

    Args:
        old_log_prob, log_prob, advantages, response_mask: (batch, T), as :func:`compute_policy_loss`.
        clip_ratio, clip_ratio_low, clip_ratio_high: the thresholds (a side given as None takes clip_ratio).
        clip_ratio_c: the ratio's truncation, > 1, or None.
        loss_agg_mode, loss_scale_factor: see agg_loss.
        rollout_is_weights: optional (batch, T) weights >= 0 multiplied into the per-token loss.

    Returns:
        pg_loss: scalar.
        metrics: ``actor/pg_clipfrac`` (tokens left out), ``actor/ppo_kl`` and
        ``actor/pg_clipfrac_lower`` (kept tokens whose ratio was truncated).
    """
    check_pair_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    moved = torch.exp(log_prob) - torch.exp(old_log_prob)
    kept = torch.where(advantages > 0, moved <= high, moved >= -low)
    agg = (loss_agg_mode, loss_scale_factor)
    return _dppo(old_log_prob, log_prob, advantages, response_mask, kept, clip_ratio_c, rollout_is_weights, agg)


@checks_once
def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL (verl 0.9's ``dppo_kl``): as :func:`compute_policy_loss_dppo_tv`, with the
    KL between the two Bernoulli distributions (the token, or any other) of pi_old and pi_theta,
    p log(p / q) + (1 - p) log((1 - p + 1e-8) / (1 - q + 1e-8)), as the bounded divergence: a token
    is left out when that KL exceeds high (A > 0 and pi_theta > pi_old) or low (A <= 0 and
    pi_theta < pi_old).

    Args:
        as :func:`compute_policy_loss_dppo_tv`; the thresholds bound the binary KL.

    Returns:
        pg_loss and metrics as :func:`compute_policy_loss_dppo_tv`.
    """
    check_pair_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    p = torch.exp(old_log_prob)
    q = torch.exp(log_prob)
    binary_kl = p * (old_log_prob - log_prob) + (1 - p) * torch.log((1.0 - p + 1e-8) / (1.0 - q + 1e-8))
    kept = torch.where(advantages > 0, (binary_kl <= high) | (q <= p), (binary_kl <= low) | (q >= p))
    agg = (loss_agg_mode, loss_scale_factor)
    return _dppo(old_log_prob, log_prob, advantages, response_mask, kept, clip_ratio_c, rollout_is_weights, agg)


@checks_once
def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    dro_beta: float | None = None,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO (verl 0.9's ``dro``): the policy gradient with a quadratic penalty on the log-ratio,
    -(A * log pi_theta - beta / 2 * (log pi_theta - log pi_old)^2), no clip.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (batch, T), as :func:`compute_policy_loss`.
        dro_beta: the penalty's coefficient, > 0 (``actor.dro_beta``; verl's default null is refused).
        loss_agg_mode, loss_scale_factor: see agg_loss.
        rollout_is_weights: optional (batch, T) weights >= 0 multiplied into the per-token loss.

    Returns:
        pg_loss: scalar, and ``actor/ppo_kl`` (the only metric verl logs for it).
    """
    check_number("dro_beta", dro_beta, "(0, inf)")
    check_pair_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * dro_beta * log_ratio.square())
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor)
    return pg_loss, {"actor/ppo_kl": masked_mean(-log_ratio, response_mask).detach()}


# ---- the registry's entries: verl's signature, the settings read from ``config`` ----


@register_policy_loss("dppo_tv", reads=CLIP_SETTINGS + ("clip_ratio_c",))
def dppo_tv_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: ConfigView,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`compute_policy_loss_dppo_tv` with verl's policy-loss signature; tensors (batch, T)."""
    return compute_policy_loss_dppo_tv(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio=config.clip_ratio,
        clip_ratio_low=config.clip_ratio_low,
        clip_ratio_high=config.clip_ratio_high,
        clip_ratio_c=config.clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        loss_scale_factor=config.global_batch_info["loss_scale_factor"],
    )


@register_policy_loss("dppo_kl", reads=CLIP_SETTINGS + ("clip_ratio_c",))
def dppo_kl_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: ConfigView,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`compute_policy_loss_dppo_kl` with verl's policy-loss signature; tensors (batch, T)."""
    return compute_policy_loss_dppo_kl(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio=config.clip_ratio,
        clip_ratio_low=config.clip_ratio_low,
        clip_ratio_high=config.clip_ratio_high,
        clip_ratio_c=config.clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        loss_scale_factor=config.global_batch_info["loss_scale_factor"],
    )


@register_policy_loss("dro", reads=("dro_beta",))
def dro_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: ConfigView,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`compute_policy_loss_dro` with verl's policy-loss signature; tensors (batch, T)."""
    return compute_policy_loss_dro(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        dro_beta=config.policy_loss.dro_beta,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        loss_scale_factor=config.global_batch_info["loss_scale_factor"],
    )
