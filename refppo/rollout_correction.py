"""Rollout correction (ch 6): the sampler (vLLM in verl; refppo's own generate, with other kernels)
and the trainer compute slightly different probabilities for the same tokens; truncated
importance weights pi_old / pi_rollout correct the policy loss for it
(``actor.policy_mode=rollout_correction``)."""

from __future__ import annotations

import torch

from refppo.checks import check_number, check_same_shape, check_values, checks_once


@checks_once
def compute_rollout_is_weights(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """Truncated importance weights of the trainer's policy against the sampler's, per token
    (verl's token-level ``compute_rollout_correction_weights``): min(exp(clamp(log pi_old -
    log pi_rollout, -20, 20)), threshold), 0 on padding. The bound keeps every weight finite
    (exp(20) at most) even with ``threshold=inf``.

    Args:
        old_log_prob: (batch, T) log pi_old of the sampled tokens, the trainer's recomputation.
        rollout_log_prob: (batch, T) log pi_rollout of the same tokens, recorded by the sampler.
        response_mask: (batch, T) 0/1.
        threshold: C > 0, the truncation.

    Returns:
        (batch, T) weights in [0, C], no gradient.
    """
    check_number("threshold", threshold, "(0, inf]")
    check_same_shape(old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask)
    check_values(
        masks={"response_mask": response_mask},
        finite={"old_log_prob": old_log_prob, "rollout_log_prob": rollout_log_prob},
        where=response_mask,
    )
    log_ratio = torch.clamp(old_log_prob - rollout_log_prob, min=-20.0, max=20.0)
    return (torch.exp(log_ratio) * response_mask).clamp(max=threshold).detach()
