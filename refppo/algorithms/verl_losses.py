"""Policy losses from verl 0.9's registry beyond PPO's clip and penalty (ch 7): GSPO, SAPO, CISPO,
GMPO (``geo_mean``), GPG, Clip-Cov and KL-Cov. Each is registered under verl's name (``actor.policy_loss``) and equals
verl's formula; the ``refppo`` package imports this module, so the registry holds them whatever is
imported first.

Per-token tensors are response-only, shape (batch, T), as in :mod:`refppo.losses`.
"""

from __future__ import annotations

import torch

from refppo.functional import masked_mean, masked_sum
from refppo.guards.checks import check_choice, check_number, checks_once
from refppo.guards.inputs import check_loss_inputs, check_pair_inputs, clip_bounds
from refppo.losses import CLIP_SETTINGS, LOSS_AGG_MODES, ROW_MEAN, agg_loss, register_policy_loss
from refppo.registry import ConfigView


def _metrics(clipped, log_ratio, response_mask, clipped_lower=None) -> dict[str, torch.Tensor]:
    """verl's metrics of a policy loss, detached: the shares of valid tokens ``clipped`` and
    ``clipped_lower`` (0 without it), and the k1 estimate of KL(old || new) from ``log_ratio`` =
    log pi_theta - log pi_old; every argument (batch, T)."""

    def share(flags):
        return masked_mean(flags.float(), response_mask).detach()

    lower = torch.zeros((), device=log_ratio.device) if clipped_lower is None else share(clipped_lower)
    kl = masked_mean(-log_ratio, response_mask).detach()
    return {"actor/pg_clipfrac": share(clipped), "actor/ppo_kl": kl, "actor/pg_clipfrac_lower": lower}


@checks_once
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): PPO's clipped loss with one ratio per sequence (verl 0.9's ``gspo``).

    s_i = exp(mean over the valid tokens of log pi_theta - log pi_old), the geometric mean of the
    token ratios; each token carries s_i * pi_theta / sg(pi_theta) (the value s_i, the gradient
    of its own log-prob times s_i), clamped at exp(10), in max(-A * s, -A * clip(s, 1 - low,
    1 + high)). Aggregated with seq-mean-token-mean, as verl does whatever ``loss_agg_mode`` says
    (registered with ``aggregates``, so micro-batches combine as that mode's).

    Args:
        old_log_prob, log_prob, advantages, response_mask: (batch, T), as :func:`compute_policy_loss`.
        clip_ratio, clip_ratio_low, clip_ratio_high: the clip's epsilons (GSPO's paper uses 3e-4
            and 4e-4: the ratio is a per-token geometric mean).
        rollout_is_weights: optional (batch, T) weights >= 0 multiplied into the per-token loss.

    Returns:
        pg_loss: scalar.
        metrics: ``actor/pg_clipfrac`` (tokens whose clipped term was active), ``actor/ppo_kl``
        and ``actor/pg_clipfrac_lower`` (0: no dual clip), as verl logs them.
    """
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    check_pair_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = log_prob - old_log_prob
    lengths = response_mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = masked_sum(log_ratio, response_mask, axis=-1) / lengths
    log_seq_ratio = torch.clamp(log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    seq_ratio = torch.exp(log_seq_ratio)
    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1 - low, 1 + high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    pg_loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean")
    return pg_loss, _metrics(torch.gt(pg_losses2, pg_losses1), log_ratio, response_mask)


@checks_once
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Gao et al. 2025): a smooth gate in place of the clip (verl 0.9's ``sapo``).

    Per token, -f(ratio) * A with f(r) = sigmoid(tau * (r - 1)) * 4 / tau: f'(1) = 1, so near the
    old policy the gradient is PPO's, and it fades smoothly as the ratio moves away instead of
    stopping at a bound. tau is ``tau_pos`` where A > 0 and ``tau_neg`` elsewhere. Aggregated with
    seq-mean-token-mean, as verl does whatever ``loss_agg_mode`` says (registered with
    ``aggregates``, so micro-batches combine as that mode's).

    Args:
        old_log_prob, log_prob, advantages, response_mask: (batch, T), as :func:`compute_policy_loss`.
        tau_pos, tau_neg: the gate's temperatures, > 0.
        rollout_is_weights: optional (batch, T) weights >= 0 multiplied into the per-token loss.

    Returns:
        pg_loss: scalar.
        metrics: ``actor/ppo_kl``, and ``actor/pg_clipfrac`` and ``actor/pg_clipfrac_lower`` (0:
        nothing is clipped), as verl logs them.
    """
    check_number("tau_pos", tau_pos, "(0, inf)")
    check_number("tau_neg", tau_neg, "(0, inf)")
    check_pair_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    tau = torch.full_like(advantages, tau_neg).masked_fill(advantages > 0, tau_pos)
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    pg_losses = -gate * advantages
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    pg_loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean")
    return pg_loss, _metrics(torch.zeros_like(response_mask), log_ratio, response_mask)


@checks_once
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (Zhao et al. 2025): the geometric mean of each sequence's clipped token ratios times
    its mean advantage (verl 0.9's ``geo_mean``).

    Per token, the log-ratio is clipped to [-low, high] on the side that would let the objective
    grow (the pessimistic side for the sign of A, PPO's rule in log space); the sequence's ratio is
    exp(mean of those over its valid tokens), its loss -mean(A) * ratio, and the loss the mean over
    the rows, empty ones included (verl's ``torch.mean``, whatever ``loss_agg_mode`` says; registered
    with ``aggregates`` :data:`refppo.losses.ROW_MEAN`, whose micro-batch weights that mean needs).
    Rollout-correction weights enter as their per-sequence geometric mean.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (batch, T), as :func:`compute_policy_loss`
            (a row with no valid token counts as a loss of 0, as in verl).
        clip_ratio, clip_ratio_low, clip_ratio_high: the log-ratio's bounds.
        rollout_is_weights: optional (batch, T) weights >= 0.

    Returns:
        pg_loss: scalar.
        metrics: ``actor/ppo_kl``; ``actor/pg_clipfrac`` and ``actor/pg_clipfrac_lower``, the
        tokens whose log-ratio left its bounds where A > 0 and A < 0.
    """
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    check_pair_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -low, high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = response_mask.sum(dim=-1) + 1e-8
    seq_ratio = torch.exp(masked_sum(pessimistic, response_mask, axis=-1) / lengths)
    pg_losses = -masked_sum(advantages, response_mask, axis=-1) / lengths * seq_ratio
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights.detach() + 1e-10)
        pg_losses = pg_losses * torch.exp(masked_sum(log_w, response_mask, axis=-1) / lengths)
    clipped = log_ratio != clamped
    return pg_losses.mean(), _metrics(clipped & (advantages > 0), log_ratio, response_mask, clipped & (advantages < 0))


@checks_once
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax 2025): REINFORCE weighted by the clipped importance ratio, with no gradient
    through the ratio (verl 0.9's ``cispo``): -sg(clip(ratio, 1 - low, 1 + high)) * A * log pi_theta.
    Unlike PPO's clip, a clipped token still gets a gradient, at the bounded weight.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (batch, T), as :func:`compute_policy_loss`.
        clip_ratio, clip_ratio_low, clip_ratio_high: the weight's bounds.
        loss_agg_mode, loss_scale_factor: see agg_loss.
        rollout_is_weights: optional (batch, T) weights >= 0 multiplied into the per-token loss.

    Returns:
        pg_loss: scalar.
        metrics: ``actor/pg_clipfrac`` (tokens whose ratio was clipped), ``actor/ppo_kl`` and
        ``actor/pg_clipfrac_lower`` (0).
    """
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    check_pair_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - low, 1 + high)
    pg_losses = -clipped.detach() * advantages * log_prob
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor)
    return pg_loss, _metrics(ratio != clipped, log_ratio, response_mask)


@checks_once
def compute_policy_loss_gpg(
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG (Chu et al. 2025): plain policy gradient, -A * log pi_theta, with no ratio and no clip
    (verl 0.9's ``gpg``); it pairs with the ``gpg`` advantage estimator.

    Args:
        log_prob, advantages, response_mask: (batch, T), as :func:`compute_policy_loss`.
        loss_agg_mode, loss_scale_factor: see agg_loss.
        rollout_is_weights: optional (batch, T) weights >= 0 multiplied into the per-token loss.

    Returns:
        pg_loss: scalar, and no metrics (verl logs none for it).
    """
    check_loss_inputs(response_mask, log_prob=log_prob, advantages=advantages, rollout_is_weights=rollout_is_weights)
    pg_losses = -log_prob * advantages
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    return agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor), {}


def _covariance(advantages: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(A_t - mean A) * (log pi_t - mean sg(log pi)), means over the valid tokens; (batch, T),
    differentiable through the first log pi as verl's Clip-Cov."""
    a = advantages - masked_mean(advantages, response_mask)
    return a * (log_prob - masked_mean(log_prob.detach(), response_mask))


@checks_once
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al. 2025): PPO's clipped loss, with a few more tokens cut, those whose
    advantage and log-prob covary most (verl 0.9's ``clip_cov``).

    cov_t = (A_t - mean A) * (log pi_theta_t - mean log pi_theta), means over the valid tokens.
    Among the valid tokens PPO's clip has not cut that have clip_cov_lb < cov_t < clip_cov_ub,
    max(1, int(clip_cov_ratio * valid tokens)) are drawn at random (torch's global generator, as
    verl) and lose their loss and its gradient: the tokens that drive the entropy down fastest stop
    pulling. The statistics are those of the (micro-)batch given, as in verl.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (batch, T), as :func:`compute_policy_loss`.
        clip_ratio, clip_ratio_low, clip_ratio_high: PPO's clip.
        clip_cov_ratio: the share of valid tokens to cut, in (0, 1].
        clip_cov_lb, clip_cov_ub: the covariance window the cut tokens come from (lb < ub).
        loss_agg_mode, loss_scale_factor: see agg_loss.
        rollout_is_weights: optional (batch, T) weights >= 0 multiplied into the per-token loss.

    Returns:
        pg_loss: scalar.
        metrics: ``actor/pg_clipfrac`` (the share of valid tokens cut by the covariance, as verl
        counts it) and ``actor/ppo_kl``.
    """
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    check_number("clip_cov_ratio", clip_cov_ratio, "(0, 1]")
    check_number("clip_cov_lb", clip_cov_lb, "(-inf, inf)")
    check_number("clip_cov_ub", clip_cov_ub, f"({clip_cov_lb}, inf)")
    check_pair_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    valid = response_mask > 0
    cov = _covariance(advantages, log_prob, response_mask).detach()
    candidates = ((cov > clip_cov_lb) & (cov < clip_cov_ub) & valid & ~(pg_losses2 > pg_losses1)).nonzero()
    count = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    cut = candidates[torch.randperm(len(candidates))[:count].to(candidates.device)]
    keep = torch.ones_like(advantages)
    keep[cut[:, 0], cut[:, 1]] = 0
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * keep
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor)
    metrics = _metrics(keep == 0, log_ratio, response_mask)
    del metrics["actor/pg_clipfrac_lower"]  # verl logs none for it
    return pg_loss, metrics


@checks_once
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al. 2025): the unclipped ratio loss -A * ratio, with ppo_kl_coef * |log ratio|
    added on the tokens whose advantage and log-prob covary most (verl 0.9's ``kl_cov``).

    The max(1, int(kl_cov_ratio * valid tokens)) valid tokens of largest cov_t (as in
    :func:`compute_policy_loss_clip_cov`, with no gradient) carry the penalty, chosen as verl
    chooses them (top-k over the valid tokens alone, on the CPU, so that ties fall as in verl); the
    statistics are those of the (micro-)batch given, as in verl.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (batch, T), as :func:`compute_policy_loss`.
        kl_cov_ratio: the share of valid tokens penalised, in (0, 1].
        ppo_kl_coef: the penalty's coefficient, >= 0 (verl's ``actor.policy_loss.ppo_kl_coef``).
        loss_agg_mode, loss_scale_factor: see agg_loss.
        rollout_is_weights: optional (batch, T) weights >= 0 multiplied into the per-token loss.

    Returns:
        pg_loss: scalar.
        metrics: ``actor/ppo_kl``, the mean |log ratio| over the valid tokens (as verl logs it).
    """
    check_number("kl_cov_ratio", kl_cov_ratio, "(0, 1]")
    check_number("ppo_kl_coef", ppo_kl_coef, "[0, inf)")
    check_pair_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = log_prob - old_log_prob
    valid = response_mask > 0
    # verl's selection, ties included: top-k over the valid tokens alone, their statistics on the CPU
    valid_index = valid.flatten().nonzero().squeeze(-1)
    adv = advantages[valid].detach().cpu()
    logp = log_prob[valid].detach().cpu()
    cov = (adv - adv.mean()) * (logp - logp.mean())
    count = max(1, int(len(cov) * kl_cov_ratio))
    penalised = torch.zeros_like(valid).flatten()
    penalised[valid_index[torch.topk(cov, count).indices.to(valid_index.device)]] = True
    pg_losses = -advantages * torch.exp(log_ratio) + ppo_kl_coef * log_ratio.abs() * penalised.view_as(valid)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor)
    return pg_loss, {"actor/ppo_kl": masked_mean(log_ratio.abs(), response_mask).detach()}


# ---- the registry's entries: verl's signature, the settings read from ``config`` ----


@register_policy_loss("gspo", reads=CLIP_SETTINGS, aggregates="seq-mean-token-mean")
def gspo_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: ConfigView,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`compute_policy_loss_gspo` with verl's policy-loss signature (the mode is always
    seq-mean-token-mean, as verl's, whatever ``loss_agg_mode`` says); tensors (batch, T)."""
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)  # a name it does not use is still refused
    return compute_policy_loss_gspo(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio=config.clip_ratio,
        clip_ratio_low=config.clip_ratio_low,
        clip_ratio_high=config.clip_ratio_high,
        rollout_is_weights=rollout_is_weights,
    )


@register_policy_loss("sapo", reads=("tau_pos", "tau_neg"), aggregates="seq-mean-token-mean")
def sapo_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: ConfigView,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`compute_policy_loss_sapo` with verl's policy-loss signature (the mode is always
    seq-mean-token-mean, as verl's); tensors (batch, T)."""
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)  # a name it does not use is still refused
    return compute_policy_loss_sapo(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        tau_pos=config.tau_pos,
        tau_neg=config.tau_neg,
        rollout_is_weights=rollout_is_weights,
    )


@register_policy_loss("geo_mean", reads=CLIP_SETTINGS, aggregates=ROW_MEAN)
def geo_mean_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: ConfigView,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`compute_policy_loss_geo_mean` with verl's policy-loss signature (a mean over the rows, as
    verl's); tensors (batch, T)."""
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)  # a name it does not use is still refused
    return compute_policy_loss_geo_mean(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio=config.clip_ratio,
        clip_ratio_low=config.clip_ratio_low,
        clip_ratio_high=config.clip_ratio_high,
        rollout_is_weights=rollout_is_weights,
    )


@register_policy_loss("cispo", reads=CLIP_SETTINGS)
def cispo_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: ConfigView,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`compute_policy_loss_cispo` with verl's policy-loss signature; tensors (batch, T)."""
    return compute_policy_loss_cispo(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio=config.clip_ratio,
        clip_ratio_low=config.clip_ratio_low,
        clip_ratio_high=config.clip_ratio_high,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        loss_scale_factor=config.global_batch_info["loss_scale_factor"],
    )


@register_policy_loss("gpg", reads=())
def gpg_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: ConfigView,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`compute_policy_loss_gpg` with verl's policy-loss signature (``old_log_prob`` is not read);
    tensors (batch, T)."""
    return compute_policy_loss_gpg(
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        loss_scale_factor=config.global_batch_info["loss_scale_factor"],
    )


@register_policy_loss("clip_cov", reads=CLIP_SETTINGS + ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"))
def clip_cov_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: ConfigView,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`compute_policy_loss_clip_cov` with verl's policy-loss signature; tensors (batch, T)."""
    return compute_policy_loss_clip_cov(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio=config.clip_ratio,
        clip_ratio_low=config.clip_ratio_low,
        clip_ratio_high=config.clip_ratio_high,
        clip_cov_ratio=config.policy_loss.clip_cov_ratio,
        clip_cov_lb=config.policy_loss.clip_cov_lb,
        clip_cov_ub=config.policy_loss.clip_cov_ub,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        loss_scale_factor=config.global_batch_info["loss_scale_factor"],
    )


@register_policy_loss("kl_cov", reads=("kl_cov_ratio", "ppo_kl_coef"))
def kl_cov_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: ConfigView,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`compute_policy_loss_kl_cov` with verl's policy-loss signature; tensors (batch, T)."""
    return compute_policy_loss_kl_cov(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        kl_cov_ratio=config.policy_loss.kl_cov_ratio,
        ppo_kl_coef=config.policy_loss.ppo_kl_coef,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        loss_scale_factor=config.global_batch_info["loss_scale_factor"],
    )
