"""Actor and critic losses (ch 2, 3, 5) and loss aggregation.

Per-token tensors are response-only, shape (batch, T); losses return scalar tensors and
metrics as detached scalar tensors (no host sync: the trainer gathers metrics once per step).
"""

from __future__ import annotations

import torch

from refppo.functional import masked_mean, masked_sum
from refppo.guards.checks import check_choice, check_ndim, check_number, check_values, checks_once
from refppo.guards.inputs import check_loss_inputs, check_pair_inputs, clip_bounds
from refppo.kl import kl_penalty
from refppo.registry import ConfigView, Registry

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
# How a loss that is the mean over every row of its batch, empty rows included (GMPO's torch.mean in
# verl 0.9), weighs into its mini-batch: a registered loss's ``aggregates``, never a loss_agg_mode.
ROW_MEAN = "row-mean"


@checks_once
def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    batch_num_tokens: torch.Tensor | int | None = None,
    global_batch_size: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss into a scalar (verl 0.9's ``agg_loss``).

    token-mean: sum over valid tokens / number of valid tokens.
    token-sum: sum over valid tokens.
    seq-mean-token-sum: mean over sequences of each sequence's token sum.
    seq-mean-token-mean: mean over sequences of each sequence's token mean.
    seq-mean-token-sum-norm: mean over sequences of each sequence's token sum / loss_scale_factor
    (Dr. GRPO's constant normaliser). Sequence means skip rows with no valid token.

    Args:
        loss_mat: (batch, T) per-token losses.
        loss_mask: (batch, T) 0/1 with at least one 1.
        loss_agg_mode: one of LOSS_AGG_MODES.
        loss_scale_factor: seq-mean-token-sum-norm's divisor, > 0; None uses T. Keep it constant
            over a run (the trainer passes ``data.max_response_length``): T changes from batch to
            batch when generation stops early.
        batch_num_tokens: what token-mean divides by; None: ``loss_mask``'s valid tokens. verl's
            engine passes the batch's count, so that a token a loss masks out itself (bypass
            mode's rejection sampling) still counts.
        global_batch_size: what the sequence means divide by; None: ``loss_mask``'s rows with a
            valid token.

    Returns:
        Scalar tensor.
    """
    check_loss_inputs(loss_mask, loss_mat=loss_mat)
    for name, count in (("batch_num_tokens", batch_num_tokens), ("global_batch_size", global_batch_size)):
        if count is not None and not isinstance(count, torch.Tensor):
            check_number(name, count, "(0, inf)")
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    if loss_scale_factor is not None:
        check_number("loss_scale_factor", loss_scale_factor, "(0, inf)")
    # The counts are at least 1 when the mask has a valid token (checked above); the clamps
    # make a micro-batch that rejection sampling emptied add 0, as in verl's engine.
    if loss_agg_mode == "token-mean":
        tokens = loss_mask.sum().clamp(min=1) if batch_num_tokens is None else batch_num_tokens
        return masked_sum(loss_mat, loss_mask) / tokens
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask)
    seq_losses = masked_sum(loss_mat, loss_mask, axis=-1)
    tokens = loss_mask.sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (tokens + 1e-8)  # verl's 1e-8: an empty row gives 0
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        # Dr. GRPO: a constant divisor (the configured longest response), not the token count.
        seq_losses = seq_losses / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    # Rows with no valid token do not count as sequences (unless the caller counted them).
    has_tokens = (tokens > 0).to(seq_losses.dtype)
    rows = has_tokens.sum().clamp(min=1) if global_batch_size is None else global_batch_size
    return masked_sum(seq_losses, has_tokens) / rows


def agg_loss_weight(micro_mask: torch.Tensor, mini_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Weight of a micro-batch's aggregated loss in its mini-batch's, for gradient accumulation.

    With w = agg_loss_weight(micro_mask, mini_mask, mode), the sum over the micro-batches of
    w * agg_loss(micro) equals the mini-batch's loss as verl 0.9's engine aggregates it exactly
    (``agg_loss(mini, global_batch_size=mini rows)``, with the same ``loss_scale_factor``):
    token-mean weighs by the share of valid tokens, token-sum by 1, and sequence means by the
    micro-batch's non-empty rows over every row of the mini-batch. verl's engine divides a sequence
    mean by ``global_batch_size``, the mini-batch's rows (``verl/trainer/ppo/ray_trainer.py``,
    ``_update_actor``), so a row that rejection sampling emptied still counts. :data:`ROW_MEAN`, a
    mean over every row of the micro-batch, weighs by its rows over the mini-batch's, so the sum is
    the mean over the mini-batch's rows, empty ones included.

    Args:
        micro_mask: (micro, T') 0/1, rows of the mini-batch (T' <= T: a micro-batch cut to its
            own longest response counts the same tokens).
        mini_mask: (mini, T) 0/1, the whole mini-batch.

    Returns:
        Scalar tensor.
    """
    check_choice("loss_agg_mode", loss_agg_mode, (*LOSS_AGG_MODES, ROW_MEAN))
    check_ndim("micro_mask", micro_mask, 2)
    check_ndim("mini_mask", mini_mask, 2)
    if micro_mask.shape[0] > mini_mask.shape[0] or micro_mask.shape[1] > mini_mask.shape[1]:
        raise ValueError(
            f"micro_mask {tuple(micro_mask.shape)} must be rows of mini_mask {tuple(mini_mask.shape)}: no larger in "
            "either dimension"
        )
    check_values(masks={"micro_mask": micro_mask, "mini_mask": mini_mask}, min_valid=("mini_mask", mini_mask, 1))
    dtype = torch.promote_types(micro_mask.dtype, torch.float32)
    if loss_agg_mode == "token-sum":
        return torch.ones((), dtype=dtype, device=micro_mask.device)
    if loss_agg_mode == "token-mean":
        return micro_mask.sum().to(dtype) / mini_mask.sum()
    if loss_agg_mode == ROW_MEAN:
        return torch.tensor(micro_mask.shape[0] / mini_mask.shape[0], dtype=dtype, device=micro_mask.device)
    return (micro_mask.sum(dim=-1) > 0).sum().to(dtype) / mini_mask.shape[0]


# verl 0.9's policy-loss signature: every registered loss is called with these keywords and returns
# (loss, {metric name: scalar}). verl's other losses (GSPO, SAPO, CISPO, GMPO, GPG, Clip-Cov, KL-Cov,
# DPPO, DRO) are in refppo.algorithms.
POLICY_LOSS_INPUTS = (
    "old_log_prob",
    "log_prob",
    "advantages",
    "response_mask",
    "loss_agg_mode",
    "config",
    "rollout_is_weights",
)
POLICY_LOSSES = Registry("policy loss", inputs=POLICY_LOSS_INPUTS)
register_policy_loss = POLICY_LOSSES.register
get_policy_loss_fn = POLICY_LOSSES.get
# The settings verl keeps under actor.policy_loss (refppo keeps them beside the others, under actor).
POLICY_LOSS_SETTINGS = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta")
CLIP_SETTINGS = ("clip_ratio", "clip_ratio_low", "clip_ratio_high")


def policy_loss_config(actor, loss_scale_factor: float | None) -> ConfigView:
    """The ``config`` a registered policy loss receives, shaped as verl 0.9's ``ActorConfig``.

    ``config.clip_ratio`` and every other ``actor.*`` setting by its name; ``config.policy_loss``
    holds ``loss_mode`` (``actor.policy_loss``) and the settings verl keeps there
    (``config.policy_loss.clip_cov_ratio``, ...); ``config.global_batch_info`` holds the keywords a
    loss passes on to :func:`agg_loss`: ``loss_scale_factor`` alone, since refppo weighs its
    micro-batches and processes itself (:func:`agg_loss_weight`).

    Args:
        actor: the actor's settings (:class:`refppo.settings.config.ActorConfig` or any dataclass
            with the fields the loss reads).
        loss_scale_factor: seq-mean-token-sum-norm's divisor, as :func:`agg_loss` takes it.

    Returns:
        A :class:`ConfigView`.
    """
    if loss_scale_factor is not None:
        check_number("loss_scale_factor", loss_scale_factor, "(0, inf)")
    config = ConfigView(vars(actor))
    policy_loss = {"loss_mode": actor.policy_loss}
    for name in POLICY_LOSS_SETTINGS:
        policy_loss[name] = config.get(name)
    config["policy_loss"] = ConfigView(policy_loss)
    config["global_batch_info"] = {"loss_scale_factor": loss_scale_factor}
    return config


@checks_once
def compute_policy_loss(
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
    batch_num_tokens: torch.Tensor | int | None = None,
    global_batch_size: torch.Tensor | int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss with asymmetric and dual clipping (verl 0.9's vanilla policy loss).

    ratio = exp(clamp(log_prob - old_log_prob, -20, 20)) and, per token,
    L = max(-A * ratio, -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)).
    Dual-clip (Ye et al. 2019): where A < 0, L = min(L, -A * clip_ratio_c), which caps the loss
    at -clip_ratio_c * A, so a ratio above clip_ratio_c stops counting (zero gradient).

    Args:
        old_log_prob: (batch, T) log pi_old of the sampled tokens (no gradient).
        log_prob: (batch, T) log pi_theta of the same tokens (gradient flows).
        advantages: (batch, T).
        response_mask: (batch, T) 0/1.
        clip_ratio: epsilon; the default for both sides.
        clip_ratio_low: epsilon below 1 (defaults to clip_ratio).
        clip_ratio_high: epsilon above 1 (defaults to clip_ratio; DAPO's clip-higher).
        clip_ratio_c: dual-clip constant, > 1; None turns dual-clip off.
        loss_agg_mode: see agg_loss.
        rollout_is_weights: optional (batch, T) per-token importance weights >= 0 (rollout
            correction), multiplied into the per-token loss; no gradient.
        loss_scale_factor, batch_num_tokens, global_batch_size: see agg_loss.

    Returns:
        pg_loss: scalar.
        metrics, detached scalars named as verl logs them: ``actor/pg_clipfrac``, the fraction of
        valid tokens where the clipped term was active; ``actor/ppo_kl``, the masked mean of
        old_log_prob - log_prob (k1 estimate of KL(old || new)); ``actor/pg_clipfrac_lower``, the
        fraction of valid tokens with A < 0 capped by the dual clip.
    """
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    if clip_ratio_c is not None:
        check_number("clip_ratio_c", clip_ratio_c, "(1, inf)")
    check_pair_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)

    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    if clip_ratio_c is None:
        pg_losses = clip_pg_losses1
        pg_clipfrac_lower = torch.zeros((), device=pg_losses.device)
    else:
        pg_losses3 = -advantages * clip_ratio_c
        clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
        pg_clipfrac_lower = masked_mean(
            (torch.gt(clip_pg_losses1, pg_losses3) & (advantages < 0)).float(), response_mask
        )
        pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)

    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    counts = {"batch_num_tokens": batch_num_tokens, "global_batch_size": global_batch_size}
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor, **counts)
    metrics = {"actor/pg_clipfrac": pg_clipfrac, "actor/ppo_kl": ppo_kl, "actor/pg_clipfrac_lower": pg_clipfrac_lower}
    return pg_loss, {k: v.detach() for k, v in metrics.items()}


@register_policy_loss("clip", reads=CLIP_SETTINGS + ("clip_ratio_c",))
def clip_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: ConfigView,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`compute_policy_loss` with verl's policy-loss signature (verl's ``vanilla``): the
    clip's settings read from ``config`` (:func:`policy_loss_config`); tensors (batch, T)."""
    return compute_policy_loss(
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


@checks_once
def compute_ppo_penalty_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    penalty_kl_coef: float,
    penalty_kl_type: str = "kl",
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-penalty loss: -ratio * A + beta * KL(pi_old || pi_theta), per token (ch 2).

    The KL is estimated on the sampled tokens, which come from pi_old, with the chosen
    estimator (``kl_penalty(old_log_prob, log_prob, ...)``: pi_old is the sampling side). The
    settings are ``actor.penalty_kl_coef`` and ``actor.penalty_kl_type``.

    Args:
        old_log_prob: (batch, T) log pi_old (no gradient).
        log_prob: (batch, T) log pi_theta (gradient flows).
        advantages: (batch, T).
        response_mask: (batch, T) 0/1.
        penalty_kl_coef: beta >= 0.
        penalty_kl_type: KL estimator name (see refppo.kl).
        loss_agg_mode, loss_scale_factor: see agg_loss.
        rollout_is_weights: optional (batch, T) per-token importance weights >= 0 (rollout
            correction), multiplied into the per-token loss, penalty included; no gradient.

    Returns:
        loss: scalar.
        metrics: ``actor/ppo_kl``, the masked mean of the per-token KL estimate (detached), for a
        beta controller.
    """
    check_number("penalty_kl_coef", penalty_kl_coef, "[0, inf)")
    check_pair_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    kl = kl_penalty(old_log_prob.detach(), log_prob, penalty_kl_type)
    losses = -advantages * ratio + penalty_kl_coef * kl
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights.detach()
    loss = agg_loss(losses, response_mask, loss_agg_mode, loss_scale_factor)
    return loss, {"actor/ppo_kl": masked_mean(kl, response_mask).detach()}


@register_policy_loss("penalty", reads=("penalty_kl_coef", "penalty_kl_type"))
def penalty_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: ConfigView,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`compute_ppo_penalty_loss` with verl's policy-loss signature: beta and the KL
    estimator read from ``config`` (:func:`policy_loss_config`); tensors (batch, T)."""
    return compute_ppo_penalty_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        penalty_kl_coef=config.penalty_kl_coef,
        penalty_kl_type=config.penalty_kl_type,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        loss_scale_factor=config.global_batch_info["loss_scale_factor"],
    )


@checks_once
def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: 0.5 * agg(max((V - R)^2, (clip(V, V_old +- c) - R)^2)).

    Args:
        vpreds: (batch, T) current critic values (gradient flows).
        returns: (batch, T) targets (advantages + old values from GAE).
        values: (batch, T) old values recorded at rollout time.
        response_mask: (batch, T) 0/1.
        cliprange_value: c, >= 0 (verl's range; at 0 the clipped term is the old value's error); None
            turns clipping off.
        loss_agg_mode, loss_scale_factor: see agg_loss.

    Returns:
        vf_loss: scalar.
        vf_clipfrac: fraction of valid tokens where the clipped error was larger.
    """
    if cliprange_value is not None:
        check_number("cliprange_value", cliprange_value, "[0, inf)")
    check_loss_inputs(response_mask, vpreds=vpreds, returns=returns, values=values)
    vf_losses1 = (vpreds - returns) ** 2
    if cliprange_value is None:
        clipped_vf_losses = vf_losses1
        vf_clipfrac = torch.zeros((), device=vpreds.device)
    else:
        vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
        vf_losses2 = (vpredclipped - returns) ** 2
        clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
        vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    vf_loss = 0.5 * agg_loss(clipped_vf_losses, response_mask, loss_agg_mode, loss_scale_factor)
    return vf_loss, vf_clipfrac.detach()
