"""verl 0.9's diagnostics of the trainer's probabilities against the sampler's
(``verl/trainer/ppo/rollout_corr_helper.py``): the off-policy gap and the importance weights'
statistics, logged under ``rollout_corr/``. The trainer logs them once a step in decoupled mode;
bypass mode's loss, from each micro-batch against the policy being updated."""

from __future__ import annotations

import torch

from refppo.algorithms.rollout_correction import compute_rollout_is_weights, is_batch_norm_factor, is_bounds
from refppo.functional import masked_max_min, masked_mean


def offpolicy_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """verl 0.9's off-policy diagnostics of the trainer's log-probs against the sampler's
    (``compute_offpolicy_metrics``), logged under ``rollout_corr/``.

    Args:
        old_log_prob: (batch, T) log pi_old, the trainer's recomputation.
        rollout_log_prob: (batch, T) log pi_rollout, the sampler's.
        response_mask: (batch, T) 0/1, at least one 1.

    Returns:
        Scalar tensors: ``training_ppl`` and ``rollout_ppl`` (the batch mean of each sequence's
        exp(-mean log-prob)) and their ``_log_ppl``; ``kl`` = mean(log pi_rollout - log pi_old) and
        ``k3_kl``, estimates of KL(pi_rollout || pi_old) over the tokens; ``log_ppl_diff`` (mean,
        ``_abs_``, ``_max``, ``_min`` over sequences) and ``ppl_ratio``; ``chi2_token`` = E[rho^2] - 1
        and ``chi2_seq`` = E[(prod rho)^2] - 1, rho = pi_old / pi_rollout with log rho clamped to +-20.
    """
    mask = response_mask
    train_seq = masked_mean(old_log_prob, mask, axis=-1)
    rollout_seq = masked_mean(rollout_log_prob, mask, axis=-1)
    log_ratio = old_log_prob - rollout_log_prob
    diff = rollout_seq - train_seq  # log(training ppl / rollout ppl), per sequence
    seq_log_ratio = (log_ratio * mask).sum(-1).clamp(-20.0, 20.0)
    out = {
        "training_ppl": torch.exp(-train_seq).mean(),
        "training_log_ppl": (-train_seq).mean(),
        "kl": masked_mean(-log_ratio, mask),
        "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask),
        "rollout_ppl": torch.exp(-rollout_seq).mean(),
        "rollout_log_ppl": (-rollout_seq).mean(),
        "log_ppl_diff": diff.mean(),
        "log_ppl_abs_diff": diff.abs().mean(),
        "log_ppl_diff_max": diff.max(),
        "log_ppl_diff_min": diff.min(),
        "ppl_ratio": torch.exp(diff).mean(),
        "chi2_token": masked_mean(torch.exp(log_ratio.clamp(-20.0, 20.0)).square(), mask) - 1.0,
        "chi2_seq": torch.exp(2.0 * seq_log_ratio).mean() - 1.0,
    }
    return {f"rollout_corr/{k}": v.detach() for k, v in out.items()}


def rollout_is_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    threshold: float,
    level: str,
    batch_normalize: bool = False,
) -> dict[str, torch.Tensor]:
    """verl 0.9's statistics of the truncated importance weights (``compute_is_metrics``, before
    any batch normalisation), logged under ``rollout_corr/``.

    Args:
        old_log_prob, rollout_log_prob, response_mask: (batch, T), as :func:`offpolicy_metrics`.
        threshold: the truncation C (the low bound of the fractions is 1 / C), or IcePop's
            ``"lower_upper"`` (the fractions' bounds; ``rollout_is_oob_ratio`` is added).
        level: "token" or "sequence", as :func:`refppo.algorithms.rollout_correction.compute_rollout_is_weights`.
        batch_normalize: ``rollout_is_batch_normalize``; adds ``rollout_is_batch_norm_factor``, what
            the weights are divided by (:func:`refppo.algorithms.rollout_correction.is_batch_norm_factor`).

    Returns:
        Scalar tensors: ``rollout_is_mean``, ``_max``, ``_min`` (a sequence's from its unclamped
        log-ratio), ``_ratio_fraction_high`` and ``_low`` (raw weights beyond C or below 1 / C: over
        tokens, or over sequences), ``_std``, ``_eff_sample_size`` = 1 / mean((w / mean w)^2), and
        per sequence (each one's mean weight) ``_seq_mean``, ``_seq_std``, ``_seq_max``, ``_seq_min``,
        ``_seq_max_deviation`` (from 1), ``_seq_fraction_high`` and ``_low``.
    """
    mask, (lower, upper) = response_mask, is_bounds(threshold)
    bottom = 1 / upper if lower is None else lower  # the low fractions' bound: 1 / C for TIS
    weights = compute_rollout_is_weights(old_log_prob, rollout_log_prob, mask, threshold, level)
    log_ratio = (old_log_prob - rollout_log_prob) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True)
    raw = torch.exp(log_ratio.clamp(-20.0, 20.0)).expand_as(mask) * mask
    high = torch.log(torch.tensor(upper, dtype=log_ratio.dtype))
    low = torch.log(torch.tensor(bottom))
    out = {"rollout_is_mean": masked_mean(weights, mask)}
    if level == "sequence":
        out |= {
            "rollout_is_max": torch.exp(log_ratio.max().clamp(max=20.0)),
            "rollout_is_min": torch.exp(log_ratio.min()),
            "rollout_is_ratio_fraction_high": (log_ratio > high).float().mean(),
            "rollout_is_ratio_fraction_low": (log_ratio < low).float().mean(),
        }
    else:
        out |= {
            "rollout_is_ratio_fraction_high": masked_mean((raw > upper).float(), mask),
            "rollout_is_ratio_fraction_low": masked_mean((raw < bottom).float(), mask),
        }
        out["rollout_is_max"], out["rollout_is_min"] = masked_max_min(weights, mask)
    mean = masked_mean(weights, mask)
    spread = (masked_mean(weights.square(), mask) - mean.square()).clamp(min=0.0).sqrt()
    out["rollout_is_std"] = torch.where(mask.sum() > 1, spread, 0.0)  # no host sync: bypass runs it per micro-batch
    out["rollout_is_eff_sample_size"] = 1.0 / masked_mean((weights / (mean + 1e-8)).square(), mask)
    seq = masked_mean(weights, mask, axis=-1)
    raw_seq = masked_mean(raw, mask, axis=-1)
    out |= {
        "rollout_is_seq_mean": seq.mean(),
        "rollout_is_seq_std": seq.std() if seq.numel() > 1 else torch.zeros_like(mean),
        "rollout_is_seq_max": seq.max(),
        "rollout_is_seq_min": seq.min(),
        "rollout_is_seq_max_deviation": (seq - 1.0).abs().max(),
        "rollout_is_seq_fraction_high": (raw_seq > upper).float().mean(),
        "rollout_is_seq_fraction_low": (raw_seq < bottom).float().mean(),
    }
    if lower is not None:  # IcePop: the share of weights it zeroed
        out["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).float(), mask)
    if batch_normalize:
        out["rollout_is_batch_norm_factor"] = is_batch_norm_factor(weights, mask, level)
    return {f"rollout_corr/{k}": v.detach() for k, v in out.items()}
