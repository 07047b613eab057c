"""Bypass mode's policy loss (ch 6b): verl 0.9 takes the sampler's log-probs as pi_old
(``algorithm.rollout_correction.bypass_mode``), runs no old-log-prob pass, and replaces the actor's
policy loss with ``bypass_mode`` (``apply_bypass_mode`` in ``verl/trainer/ppo/rollout_corr_helper.py``).
That loss computes the importance weights and the rejection mask itself, in every micro-batch,
against the policy being updated, then applies PPO's clip (``loss_type=ppo_clip``: the ratio
pi_theta / pi_rollout is already the importance weight, so the weights are only logged) or
REINFORCE with the weights in the loss (``loss_type=reinforce``)."""

from __future__ import annotations

import torch

from refppo.algorithms.rollout_corr_metrics import offpolicy_metrics, rollout_is_metrics
from refppo.algorithms.rollout_correction import compute_rollout_is_weights, compute_rollout_rs_mask
from refppo.functional import masked_mean
from refppo.guards.checks import check_choice, checks_once
from refppo.guards.inputs import check_loss_inputs, check_pair_inputs
from refppo.losses import agg_loss, compute_policy_loss, register_policy_loss
from refppo.registry import ConfigView

BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


def apply_bypass_mode(config: ConfigView, rollout_correction) -> ConfigView:
    """A policy loss's ``config`` (:func:`refppo.losses.policy_loss_config`) for bypass mode, as
    verl 0.9's ``apply_bypass_mode`` sets it: ``policy_loss.loss_mode`` is ``bypass_mode`` and
    ``policy_loss.rollout_correction`` holds ``algorithm.rollout_correction``'s settings.

    Args:
        config: the actor's loss config.
        rollout_correction: ``algorithm.rollout_correction``, a dataclass or a mapping.

    Returns:
        A new :class:`refppo.registry.ConfigView`; ``config`` is left as it is.
    """
    settings = rollout_correction if isinstance(rollout_correction, dict) else vars(rollout_correction)
    policy_loss = ConfigView(config["policy_loss"], loss_mode="bypass_mode", rollout_correction=ConfigView(settings))
    return ConfigView(config, policy_loss=policy_loss)


@checks_once
def compute_policy_loss_reinforce(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-sum",
    rollout_is_weights: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
    batch_num_tokens: torch.Tensor | int | None = None,
    global_batch_size: torch.Tensor | int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy gradient without a ratio or a clip (verl 0.9's ``compute_policy_loss_reinforce``):
    per token L = -A * w * log pi_theta, w the importance weight pi_theta / pi_rollout as a constant
    (1 without weights), so the gradient is -A * w * grad log pi_theta.

    Args:
        rollout_log_prob: (batch, T) log pi_rollout of the sampled tokens.
        log_prob: (batch, T) log pi_theta of the same tokens (gradient flows).
        advantages: (batch, T).
        response_mask: (batch, T) 0/1, the tokens that count (rejection sampling applied).
        loss_agg_mode, loss_scale_factor, batch_num_tokens, global_batch_size: see
            :func:`refppo.losses.agg_loss`.
        rollout_is_weights: optional (batch, T) weights >= 0; no gradient.

    Returns:
        pg_loss: scalar.
        metrics: ``actor/ppo_kl``, the masked mean of log pi_rollout - log pi_theta.
    """
    tensors = {"rollout_log_prob": rollout_log_prob, "log_prob": log_prob, "advantages": advantages}
    check_loss_inputs(response_mask, **tensors, rollout_is_weights=rollout_is_weights)
    pg_losses = -advantages * log_prob
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    counts = {"batch_num_tokens": batch_num_tokens, "global_batch_size": global_batch_size}
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor, **counts)
    ppo_kl = masked_mean(rollout_log_prob - log_prob, response_mask)
    return pg_loss, {"actor/ppo_kl": ppo_kl.detach()}


@register_policy_loss("bypass_mode", reads=("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c"))
@checks_once
def compute_policy_loss_bypass_mode(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: ConfigView | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl 0.9's ``compute_policy_loss_bypass_mode``: ``old_log_prob`` is the sampler's.

    From log pi_theta (as a constant) against log pi_rollout: the truncated importance weights
    (``rollout_is``) and the rejection mask (``rollout_rs``), with their ``rollout_corr/`` metrics
    and the off-policy ones; then the loss on the kept tokens, ``ppo_clip`` (PPO's clipped loss with
    ratio pi_theta / pi_rollout, no weights) or ``reinforce`` (:func:`compute_policy_loss_reinforce`
    with the weights). Token-mean and the sequence means still divide by the tokens and rows of
    ``response_mask``, as verl's engine does (its global batch counts are taken before the loss
    rejects anything).

    Args:
        old_log_prob: (batch, T) log pi_rollout.
        log_prob: (batch, T) log pi_theta (gradient flows).
        advantages, response_mask: (batch, T).
        loss_agg_mode: see :func:`refppo.losses.agg_loss`.
        config: the actor's settings as verl's (:func:`refppo.losses.policy_loss_config`), with
            ``config.policy_loss.rollout_correction`` holding ``loss_type``, ``rollout_is``,
            ``rollout_is_threshold``, ``rollout_is_batch_normalize``, ``rollout_rs`` and
            ``rollout_rs_threshold`` (``algorithm.rollout_correction``).
        rollout_is_weights: ignored, as verl ignores it: the loss computes its own.

    Returns:
        pg_loss: scalar; metrics: the loss's own and the ``rollout_corr/`` ones, detached scalars.
    """
    check_pair_inputs(old_log_prob, log_prob, advantages, response_mask)
    if config is None or config.get("policy_loss", {}).get("rollout_correction") is None:
        raise ValueError("bypass_mode's loss needs config.policy_loss.rollout_correction (verl's apply_bypass_mode)")
    rc = config["policy_loss"]["rollout_correction"]
    loss_type = rc.get("loss_type", "ppo_clip")
    check_choice("rollout_correction.loss_type", loss_type, BYPASS_LOSS_TYPES)
    rollout_log_prob = old_log_prob
    current = log_prob.detach()
    metrics = {}
    weights = None
    if rc.get("rollout_is") is not None and rc.get("rollout_is_threshold") is not None:
        is_settings = {
            "threshold": rc["rollout_is_threshold"],
            "level": rc["rollout_is"],
            "batch_normalize": rc.get("rollout_is_batch_normalize", False),
        }
        weights = compute_rollout_is_weights(current, rollout_log_prob, response_mask, **is_settings)
        metrics |= rollout_is_metrics(current, rollout_log_prob, response_mask, **is_settings)
    kept = response_mask
    if rc.get("rollout_rs") is not None:
        kept, rs_metrics = compute_rollout_rs_mask(
            current, rollout_log_prob, response_mask, rc["rollout_rs"], rc.get("rollout_rs_threshold")
        )
        metrics |= rs_metrics
    metrics |= offpolicy_metrics(current, rollout_log_prob, response_mask)
    aggregation = {
        "loss_agg_mode": loss_agg_mode,
        "loss_scale_factor": config["global_batch_info"]["loss_scale_factor"],
        "batch_num_tokens": response_mask.sum(),
        "global_batch_size": (response_mask.sum(-1) > 0).sum(),
    }
    if loss_type == "reinforce":
        pg_loss, pg_metrics = compute_policy_loss_reinforce(
            rollout_log_prob, log_prob, advantages, kept, rollout_is_weights=weights, **aggregation
        )
    else:
        clip = {name: config[name] for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c")}
        pg_loss, pg_metrics = compute_policy_loss(rollout_log_prob, log_prob, advantages, kept, **clip, **aggregation)
    return pg_loss, pg_metrics | metrics
