"""Token-level rewards (ch 5, 6): where the sequence score goes, reward clipping, the KL
penalty in the reward and a penalty for responses that never emitted EOS (DAPO's soft overlong
punishment: :mod:`refppo.algorithms.overlong`).

Shapes: scores (batch,), per-token tensors (batch, T), response-only.
"""

from __future__ import annotations

import torch

from refppo.functional import last_valid_index, masked_mean
from refppo.guards.checks import (
    check_ndim,
    check_number,
    check_same_shape,
    check_tensors,
    check_values,
    checks_once,
)
from refppo.guards.inputs import check_score_inputs
from refppo.kl import kl_penalty as kl_penalty_fn


@checks_once
def place_score_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token-level scores: each sequence's score on its last valid response token, 0 elsewhere.

    Args:
        scores: (batch,) sequence scores (reward model or rule).
        response_mask: (batch, T) 0/1; every row needs at least one 1.

    Returns:
        (batch, T) ``token_level_scores`` in the dtype of ``scores`` (at least float32).
    """
    check_score_inputs(scores, response_mask)
    last = last_valid_index(response_mask)
    dtype = torch.promote_types(scores.dtype, torch.float32)
    out = torch.zeros(response_mask.shape, dtype=dtype, device=scores.device)
    return out.scatter_(1, last[:, None], scores.to(dtype)[:, None])


@checks_once
def clip_reward(scores: torch.Tensor, clip_reward_value: float) -> torch.Tensor:
    """Clamp scores to [-clip_reward_value, clip_reward_value] (deepspeed-chat uses 5).

    Args:
        scores: any shape.
        clip_reward_value: > 0.

    Returns:
        Tensor of the same shape.
    """
    check_number("clip_reward_value", clip_reward_value, "(0, inf)")
    check_tensors(scores=scores)
    check_values(finite={"scores": scores})
    return torch.clamp(scores, -clip_reward_value, clip_reward_value)


@checks_once
def apply_missing_eos_penalty(scores: torch.Tensor, is_truncated: torch.Tensor, penalty: float) -> torch.Tensor:
    """Subtract ``penalty`` from the score of every response that never produced EOS.

    Args:
        scores: (batch,).
        is_truncated: (batch,) bool, True where the response hit the length limit.
        penalty: >= 0.

    Returns:
        (batch,) penalised scores.
    """
    check_number("penalty", penalty, "[0, inf)")
    check_ndim("scores", scores, 1)
    check_same_shape(scores=scores, is_truncated=is_truncated)
    check_values(masks={"is_truncated": is_truncated}, finite={"scores": scores})
    return scores - penalty * is_truncated.to(scores.dtype)


@torch.no_grad()
@checks_once
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL in the reward: token_level_rewards = scores - beta * KL_t on every valid token.

    KL_t = kl_penalty(old_log_probs, ref_log_prob), an estimate of KL(pi_old || pi_ref) on the
    sampled token, masked to the response. With k1 this is the notes' r_t = -beta * (log pi -
    log pi_ref) on each token and r_T = score + r_KL on the last one.

    Args:
        token_level_scores: (batch, T) score on the last valid token, 0 elsewhere.
        old_log_probs: (batch, T) log pi_old of the sampled tokens.
        ref_log_prob: (batch, T) log pi_ref of the same tokens.
        response_mask: (batch, T) 0/1.
        kl_coef: beta >= 0 (the controller's current value).
        kl_penalty: KL estimator name (see refppo.kl).

    Returns:
        token_level_rewards: (batch, T).
        current_kl: scalar, the batch mean of each sequence's masked mean KL, which the KL
            controller is updated with (as verl).
    """
    check_number("kl_coef", kl_coef, "[0, inf)")
    tensors = dict(token_level_scores=token_level_scores, old_log_probs=old_log_probs, ref_log_prob=ref_log_prob)
    check_same_shape(**tensors, response_mask=response_mask)
    check_values(masks={"response_mask": response_mask}, finite=tensors)
    kld = kl_penalty_fn(old_log_probs, ref_log_prob, kl_penalty) * response_mask
    token_level_rewards = token_level_scores - kl_coef * kld
    current_kl = masked_mean(kld, response_mask, axis=-1).mean()
    return token_level_rewards, current_kl
