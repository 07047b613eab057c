"""Rollout correction (ch 6.5): the sampler (vLLM in verl; refppo's own generate, with other
kernels) and the trainer compute slightly different probabilities for the same tokens; truncated
importance weights pi_old / pi_rollout correct the policy loss for it
(``algorithm.rollout_correction.rollout_is``), and rejection sampling drops the tokens or responses
where the two diverge too far (``rollout_rs``)."""

from __future__ import annotations

import math

import torch

from refppo.functional import masked_mean, masked_sum
from refppo.guards.checks import check_choice, check_flag, check_same_shape, check_values, checks_once
from refppo.guards.inputs import check_loss_inputs

SAFETY_BOUND = 20.0  # log-ratios are clamped to +-20 before exp, so every weight stays finite
# verl 0.9's rejection criteria: a divergence estimator (k1, k2, k3) per token, or its sum, mean or
# maximum over a response
RS_OPTIONS = (
    *(f"{level}_{k}" for level in ("token", "seq_sum", "seq_mean") for k in ("k1", "k2", "k3")),
    "seq_max_k2",
    "seq_max_k3",
)


def is_bounds(threshold: float | str) -> tuple[float | None, float]:
    """verl's reading of ``rollout_is_threshold``: a number u (or its text) truncates the weights at
    u (TIS); ``"lower_upper"`` keeps the weights in [lower, upper] and zeroes the rest (IcePop).

    Returns:
        (lower or None, upper), with 0 < lower <= upper and upper > 0 (inf allowed for TIS).

    Raises:
        ValueError: anything else (a bool, a malformed text, bounds out of order).
    """
    parts = threshold.strip().split("_", 1) if isinstance(threshold, str) else [threshold]
    try:
        if isinstance(threshold, bool):
            raise TypeError
        bounds = [float(part) for part in parts]
    except (TypeError, ValueError):
        raise ValueError(f"threshold={threshold!r} must be a number or a 'lower_upper' text") from None
    lower, upper = (None, bounds[0]) if len(bounds) == 1 else bounds
    if not upper > 0 or (lower is not None and not (0 < lower <= upper < math.inf)):
        raise ValueError(f"threshold={threshold!r}: bounds must be positive, lower <= upper (IcePop's finite)")
    return lower, upper


@checks_once
def compute_rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    threshold: float | str,
    level: str = "token",
    batch_normalize: bool = False,
) -> torch.Tensor:
    """Truncated importance weights of the trainer's policy against the sampler's (verl 0.9's
    ``compute_rollout_correction_weights``), 0 on padding:

    - ``token``: w_t = min(exp(clamp(log pi_old - log pi_rollout, -20, 20)), threshold);
    - ``sequence``: one weight per response, min(exp(clamp(sum_t (log pi_old - log pi_rollout),
      -20, 20)), threshold), on each of its tokens (the product of the token ratios);
    - IcePop, a ``"lower_upper"`` threshold: the untruncated weight where it lies in
      [lower, upper], else 0;
    - ``batch_normalize``: then divided by their mean (over valid tokens for ``token``, over
      responses for ``sequence``, with verl's 1e-8 added to each count), unless that mean is at
      most 1e-8.

    Args:
        old_log_prob: (batch, T) log pi_old of the sampled tokens, the trainer's recomputation.
        rollout_log_prob: (batch, T) log pi_rollout of the same tokens, recorded by the sampler.
        response_mask: (batch, T) 0/1.
        threshold: C > 0, the truncation (inf: none; the clamp keeps weights below exp(20)), or
            ``"lower_upper"`` (:func:`is_bounds`).
        level: "token" or "sequence".
        batch_normalize: divide the weights by their batch mean.

    Returns:
        (batch, T) weights, no gradient.
    """
    lower, upper = is_bounds(threshold)
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
    raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * response_mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    if batch_normalize:
        weights = weights / is_batch_norm_factor(weights, response_mask, level)
    return weights.detach()


@checks_once
def is_batch_norm_factor(rollout_is_weights: torch.Tensor, response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """What ``rollout_is_batch_normalize`` divides the importance weights by (verl 0.9's
    ``rollout_is_batch_norm_factor``): their mean, over the valid tokens for ``token``, over the
    responses for ``sequence`` (each response's weight once, the mean over its tokens; verl's 1e-8
    in the counts), or 1 when that mean is at most 1e-8.

    Args:
        rollout_is_weights: (batch, T) truncated weights >= 0, before normalisation.
        response_mask: (batch, T) 0/1.
        level: "token" or "sequence".

    Returns:
        Scalar tensor.
    """
    check_choice("rollout_is level", level, ("token", "sequence"))
    check_loss_inputs(response_mask, rollout_is_weights=rollout_is_weights)
    if level == "token":
        mean = masked_mean(rollout_is_weights, response_mask)
    else:
        per_row = masked_mean(rollout_is_weights, response_mask, axis=-1)
        rows = (response_mask.sum(-1) > 0).to(rollout_is_weights.dtype)
        mean = (per_row * rows).sum() / rows.sum().clamp(min=1e-8)
    return torch.where(mean > 1e-8, mean, torch.ones_like(mean))


def rs_thresholds(rollout_rs: str, threshold: str | float | None) -> dict[str, tuple[float | None, float]]:
    """verl's reading of ``rollout_rs`` and ``rollout_rs_threshold``: comma-separated options (a
    repeat counted once), and one threshold for all of them or one per option. A k1 option takes
    ratio bounds ``lower_upper`` (one number u means 1/u_u); the others one upper bound.

    Args:
        rollout_rs: e.g. ``"token_k1,seq_mean_k3"``, each of :data:`RS_OPTIONS`.
        threshold: e.g. ``2.0``, ``"0.5_2.0"`` or ``"0.5_2.0,0.01"``.

    Returns:
        option -> (lower bound or None, upper bound), all > 0.

    Raises:
        ValueError: an unknown option, a missing or malformed threshold, or bounds not 0 < lower <= upper.
    """
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    if not options or any(o not in RS_OPTIONS for o in options):
        raise ValueError(f"rollout_rs={rollout_rs}: each option must be one of {', '.join(RS_OPTIONS)}")
    specs = [t.strip() for t in str(threshold).split(",") if t.strip()] if threshold is not None else []
    if len(specs) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold={threshold}: one threshold for all {len(options)} rollout_rs options, or one each"
            if threshold is not None
            else "rollout_rs needs rollout_rs_threshold"
        )
    out = {}
    for option, spec in zip(options, specs * len(options) if len(specs) == 1 else specs):
        try:
            bounds = [float(x) for x in spec.split("_")]
        except ValueError:
            raise ValueError(f"rollout_rs_threshold: {spec!r} for {option} is not a number") from None
        if option.endswith("k1"):
            lower, upper = bounds if len(bounds) == 2 else (1.0 / bounds[0], bounds[0])
        elif len(bounds) == 1:
            lower = None
            upper = bounds[0]
        else:
            raise ValueError(f"rollout_rs_threshold: {option} takes one upper bound, not {spec!r}")
        if not (len(bounds) <= 2 and upper > 0 and (lower is None or 0 < lower <= upper)):
            raise ValueError(f"rollout_rs_threshold: {spec!r} for {option} must be positive bounds, lower <= upper")
        out[option] = (lower, upper)
    return out


def _rs_summary(
    prefix: str,
    token_stat: torch.Tensor,
    seq_stat: torch.Tensor | None,
    response_mask: torch.Tensor,
    lower: float | None,
    upper: float,
) -> dict[str, torch.Tensor]:
    """verl 0.9's statistics of one rejection criterion (``compute_rs_metrics``), named
    ``<prefix>_<stat>``: the statistic's mean over the valid tokens; its max and min, and the shares
    above ``upper`` and below ``lower``, over the tokens (a token criterion) or the responses (a
    sequence criterion); its std clamped to the bounds; and ``seq_*``: the same over the responses
    with tokens, each response's value being ``seq_stat`` or, for a token criterion, its tokens' mean.

    Args:
        prefix: e.g. ``rollout_corr/rollout_rs_token_k1``.
        token_stat: (batch, T) each token's statistic (its response's, for a sequence criterion).
        seq_stat: (batch,) each response's statistic for a sequence criterion, else None.
        response_mask: (batch, T) 0/1 with at least one valid token.
        lower, upper: the bounds the statistic is tested against (logs for k1); lower is None for
            the upper-bound criteria, whose ``fraction_low`` is 0 and ``seq_fraction_low`` absent.

    Returns:
        name -> detached scalar.
    """
    valid = response_mask.bool()
    rows = (response_mask.sum(-1) > 0).to(token_stat.dtype)
    per_row = masked_mean(token_stat, response_mask, axis=-1) if seq_stat is None else seq_stat
    n_rows = rows.sum()

    def over_rows(x):
        return (x * rows).sum() / n_rows

    def extremes(x, mask):
        return x.masked_fill(~mask, -math.inf).max(), x.masked_fill(~mask, math.inf).min()

    low = -math.inf if lower is None else lower  # the upper-bound criteria report no share below
    sequence = seq_stat is not None
    out = {"mean": masked_mean(token_stat, response_mask)}
    out["max"], out["min"] = extremes(token_stat, valid)  # a response's value on each of its tokens: the same
    high_share = over_rows((per_row > upper).to(rows.dtype))
    out["fraction_high"] = high_share if sequence else masked_mean((token_stat > upper).to(rows.dtype), response_mask)
    low_share = over_rows((per_row < low).to(rows.dtype))
    out["fraction_low"] = low_share if sequence else masked_mean((token_stat < low).to(rows.dtype), response_mask)
    clamped = token_stat.clamp(min=0.0 if lower is None else lower, max=upper)
    variance = masked_mean(clamped.square(), response_mask) - masked_mean(clamped, response_mask).square()
    out["std"] = torch.where(valid.sum() > 1, variance.clamp(min=0).sqrt(), 0.0)
    seq_mean = over_rows(per_row)
    seq_var = ((per_row - seq_mean) * rows).square().sum() / (n_rows - 1).clamp(min=1)
    out |= {"seq_mean": seq_mean, "seq_std": torch.where(n_rows > 1, seq_var.sqrt(), 0.0)}
    out["seq_max"], out["seq_min"] = extremes(per_row, rows.bool())
    out["seq_max_deviation"] = extremes(per_row.abs(), rows.bool())[0]
    out["seq_fraction_high"] = high_share
    if lower is not None:
        out["seq_fraction_low"] = low_share
    return {f"{prefix}_{k}": v.detach() for k, v in out.items()}


@checks_once
def compute_rollout_rs_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str,
    threshold: str | float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Rejection sampling of tokens or responses whose probabilities under the trainer and the
    sampler diverge (verl 0.9's ``compute_rollout_rejection_mask``). With the log-ratio
    l = clamp(log pi_old - log pi_rollout, -20, 20), the estimators are k1 = -l, k2 = l^2 / 2 and
    k3 = exp(l) - 1 - l. A ``token_`` option tests each token; a ``seq_sum_``, ``seq_mean_``
    (verl's, with its 1e-8) or ``seq_max_`` option tests a response's masked sum, mean or maximum
    and keeps or drops all its tokens. k1 keeps log(lower) <= k1 <= log(upper), the others
    k <= upper. A token is kept when every option keeps it.

    Args:
        old_log_prob, rollout_log_prob: (batch, T) log pi_old and log pi_rollout of the sampled tokens.
        response_mask: (batch, T) 0/1.
        rollout_rs, threshold: as :func:`rs_thresholds`.

    Returns:
        (mask (batch, T), the response mask with the rejected tokens 0; metrics as verl names them
        under ``rollout_corr/``: ``rollout_rs_masked_fraction`` (of the valid tokens),
        ``rollout_rs_seq_masked_fraction`` (of the rows) and, per option,
        ``rollout_rs_<option>_masked_fraction`` and ``_seq_masked_fraction`` (of the responses with
        tokens) and the statistics of :func:`_rs_summary`).
    """
    bounds = rs_thresholds(rollout_rs, threshold)
    check_same_shape(old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask)
    check_values(
        masks={"response_mask": response_mask},
        finite={"old_log_prob": old_log_prob, "rollout_log_prob": rollout_log_prob},
        where=response_mask,
    )
    log_ratio = (old_log_prob - rollout_log_prob).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    estimators = {"k1": -log_ratio, "k2": 0.5 * log_ratio**2, "k3": torch.exp(log_ratio) - 1.0 - log_ratio}
    valid = response_mask.bool()
    rows = response_mask.sum(-1) > 0
    keep = torch.ones_like(valid)
    metrics = {}
    for option, (lower, upper) in bounds.items():
        level, k = option.rsplit("_", 1)
        stat = estimators[k]
        if level == "seq_sum":
            stat = masked_sum(stat, response_mask, axis=-1)[:, None]
        elif level == "seq_mean":
            stat = masked_mean(stat, response_mask, axis=-1)[:, None]
        elif level == "seq_max":  # an empty response's maximum is 0, as verl's
            stat = stat.masked_fill(~valid, -math.inf).max(dim=-1, keepdim=True).values
            stat = torch.where(stat == -math.inf, 0.0, stat)
        low, high = (math.log(lower), math.log(upper)) if k == "k1" else (None, upper)
        kept = ((stat >= low) & (stat <= high) if k == "k1" else stat <= high).expand_as(valid)
        keep &= kept
        dropped = (~kept & valid).any(-1)
        name = f"rollout_corr/rollout_rs_{option}"
        metrics |= _rs_summary(
            name, stat.expand_as(log_ratio), None if level == "token" else stat[:, 0], response_mask, low, high
        )
        metrics[f"{name}_masked_fraction"] = masked_mean((~kept).to(log_ratio.dtype), response_mask)
        metrics[f"{name}_seq_masked_fraction"] = (dropped & rows).sum() / rows.sum().clamp(min=1)
    metrics["rollout_corr/rollout_rs_masked_fraction"] = masked_mean((~keep).to(log_ratio.dtype), response_mask)
    metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = (~keep & valid).any(-1).float().mean()
    return (response_mask * keep).to(response_mask.dtype), {k: v.detach() for k, v in metrics.items()}
