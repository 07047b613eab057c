"""Rollout correction (ch 6.5): the sampler (vLLM in verl; refppo's own generate, with other
kernels) and the trainer compute slightly different probabilities for the same tokens; truncated
importance weights pi_old / pi_rollout correct the policy loss for it
(``algorithm.rollout_correction.rollout_is``)."""

from __future__ import annotations

import torch

from refppo.checks import check_choice, check_flag, check_number, check_same_shape, check_values, checks_once

SAFETY_BOUND = 20.0  # log-ratios are clamped to +-20 before exp, so every weight stays finite


@checks_once
def compute_rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    threshold: float,
    level: str = "token",
    batch_normalize: bool = False,
) -> torch.Tensor:
    """Truncated importance weights of the trainer's policy against the sampler's (verl 0.9's
    ``compute_rollout_correction_weights``), 0 on padding:

    - ``token``: w_t = min(exp(clamp(log pi_old - log pi_rollout, -20, 20)), threshold);
    - ``sequence``: one weight per response, min(exp(clamp(sum_t (log pi_old - log pi_rollout),
      -20, 20)), threshold), on each of its tokens (the product of the token ratios);
    - ``batch_normalize``: then divided by their mean (over valid tokens for ``token``, over
      responses for ``sequence``), unless that mean is at most 1e-8.

    Args:
        old_log_prob: (batch, T) log pi_old of the sampled tokens, the trainer's recomputation.
        rollout_log_prob: (batch, T) log pi_rollout of the same tokens, recorded by the sampler.
        response_mask: (batch, T) 0/1.
        threshold: C > 0, the truncation (inf: none; the clamp keeps weights below exp(20)).
        level: "token" or "sequence".
        batch_normalize: divide the weights by their batch mean.

    Returns:
        (batch, T) weights, no gradient.
    """
    check_number("threshold", threshold, "(0, inf]")
    check_choice("rollout_is level", level, ("token", "sequence"))
    check_flag("batch_normalize", batch_normalize)
    check_same_shape(old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask)
    check_values(
        masks={"response_mask": response_mask},
        finite={"old_log_prob": old_log_prob, "rollout_log_prob": rollout_log_prob},
        where=response_mask,
    )
    log_ratio = (old_log_prob - rollout_log_prob) * response_mask
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(response_mask)
    weights = (torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * response_mask).clamp(max=threshold)
    if batch_normalize:
        if level == "token":
            mean = (weights * response_mask).sum() / response_mask.sum()
        else:  # each response's weight once (the mean over its tokens), over the responses with tokens
            per_row = (weights * response_mask).sum(-1) / response_mask.sum(-1).clamp(min=1)
            rows = (response_mask.sum(-1) > 0).to(weights.dtype)
            mean = (per_row * rows).sum() / rows.sum().clamp(min=1e-8)
        weights = torch.where(mean > 1e-8, weights / mean, weights)
    return weights.detach()
