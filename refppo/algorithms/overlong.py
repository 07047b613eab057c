"""DAPO's soft overlong punishment (Yu et al. 2025), as verl's DAPO reward manager applies it
(``reward_model.reward_manager=dapo``, ``reward_model.overlong_buffer.*``): a response that runs into
the last ``buffer_len`` tokens before the length limit loses score with each token.

Shapes: scores and lengths (batch,), masks (batch, T), response-only.
"""

from __future__ import annotations

import torch

from refppo.guards.checks import check_flag, check_ndim, check_number, check_tensors, check_values, checks_once


@checks_once
def overlong_penalty(
    response_length: torch.Tensor, max_response_length: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment (verl's DAPO reward manager): 0 for a response of up to
    ``max_response_length - buffer_len`` tokens, then falling linearly with each further token, to
    ``-penalty_factor`` at ``max_response_length``.

    Args:
        response_length: (batch,) tokens in each response (its EOS included).
        max_response_length: the longest response (``data.max_response_length``).
        buffer_len: the length of the sloped part, in (0, max_response_length].
        penalty_factor: >= 0.

    Returns:
        (batch,) float32 penalties, <= 0, added to the scores.
    """
    check_number("max_response_length", max_response_length, "[1, inf)")
    check_number("buffer_len", buffer_len, f"(0, {max_response_length}]")
    check_number("penalty_factor", penalty_factor, "[0, inf)")
    check_ndim("response_length", response_length, 1)
    check_values(finite={"response_length": response_length.float()})
    exceed = response_length.float() - (max_response_length - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)


@checks_once
def overlong_shaped(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    max_response_length: int,
    buffer_len: int,
    penalty_factor: float,
    log: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scores plus :func:`overlong_penalty` of each response's length, as verl's DAPO reward manager.

    Args:
        scores: (B,) a rule's scores.
        response_mask: (B, R) 0/1; a response's length is its row sum.
        max_response_length, buffer_len, penalty_factor: as :func:`overlong_penalty`.
        log: also return the penalties, as verl's ``overlong_buffer_cfg.log`` does.

    Returns:
        (scores (B,), extras): with ``log``, ``overlong_reward`` (the penalties) and ``overlong``
        (1 where penalised), verl's names; else no extras.
    """
    check_flag("log", log)
    check_ndim("scores", scores, 1)
    check_tensors(scores=scores, response_mask=response_mask)
    check_values(masks={"response_mask": response_mask}, finite={"scores": scores})
    if response_mask.dim() != 2 or response_mask.shape[0] != scores.shape[0]:
        raise ValueError(f"response_mask must be ({scores.shape[0]}, R), got shape {tuple(response_mask.shape)}")
    penalty = overlong_penalty(response_mask.sum(-1), max_response_length, buffer_len, penalty_factor)
    extras = {"overlong_reward": penalty, "overlong": (penalty < 0).float()} if log else {}
    return scores + penalty, extras
