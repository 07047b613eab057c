"""A step's metrics as verl logs them (ch 5): the batch's (verl's ``compute_data_metrics`` and
``calculate_debug_metrics``), the updates' means, the phases' times, throughput, peak memory, and
the progress bar's fields.
Every value stays on the device until :func:`gather` reads them in one host transfer."""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator

import torch

from refppo.algorithms.rollout_correction import compute_rollout_is_weights, is_batch_norm_factor, is_bounds
from refppo.functional import masked_mean, masked_var
from refppo.guards.checks import check_same_shape, check_values
from refppo.settings.config import Config


def masked_max_min(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest and smallest of ``values`` where ``mask`` is 1 (no host sync).

    Args:
        values: (*shape) floating tensor.
        mask: (*shape) tensor of 0/1 with at least one 1.

    Returns:
        (max, min) scalar tensors.

    Raises:
        ValueError: shapes differ, or no valid position.
    """
    check_same_shape(values=values, mask=mask)
    check_values(masks={"mask": mask}, min_valid=("mask", mask, 1))
    valid = mask.bool()
    return values.masked_fill(~valid, -torch.inf).max(), values.masked_fill(~valid, torch.inf).min()


def masked_corr(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of ``x`` and ``y`` over the positions where ``mask`` is 1.

    verl's ``training/rollout_actor_probs_pearson_corr`` (``torch.corrcoef`` of the masked
    values), without gathering them, so no host sync.

    Args:
        x, y: (*shape) tensors.
        mask: (*shape) tensor of 0/1.

    Returns:
        Scalar tensor in [-1, 1]; NaN when ``x`` or ``y`` is constant over the mask, as
        ``torch.corrcoef`` gives.

    Raises:
        ValueError: shapes differ, or fewer than 2 valid positions.
    """
    check_same_shape(x=x, y=y, mask=mask)
    check_values(min_valid=("mask", mask, 2))
    dx = x - masked_mean(x, mask)
    dy = y - masked_mean(y, mask)
    covariance = masked_mean(dx * dy, mask)
    return (covariance / (masked_mean(dx * dx, mask) * masked_mean(dy * dy, mask)).sqrt()).clamp(-1.0, 1.0)


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
    out["rollout_is_std"] = spread if mask.sum() > 1 else torch.zeros_like(mean)
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


def explained_variance(returns: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """verl's ``critic/vf_explained_var``: 1 - Var(returns - values) / (Var(returns) + 1e-5), both
    variances unbiased over the valid tokens of the whole batch. 1 for a perfect critic, 0 for one
    that predicts the mean, negative for worse.

    Args:
        returns, values: (batch, T) the critic's targets and its predictions.
        response_mask: (batch, T) 0/1 with at least 2 ones.

    Returns:
        Scalar.
    """
    return 1.0 - masked_var(returns - values, response_mask) / (masked_var(returns, response_mask) + 1e-5)


def data_metrics(batch: dict[str, torch.Tensor], config: Config, use_critic: bool) -> dict[str, torch.Tensor]:
    """verl's ``compute_data_metrics`` and ``calculate_debug_metrics`` of an evaluated batch.

    Args:
        batch: an evaluated batch (``refppo.training.trainer``'s layout): token-level scores and rewards,
            advantages, returns, (values), old and rollout log-probs, masks, prompts.
        config: the run's settings (the length limits, ``algorithm.rollout_correction``).
        use_critic: the batch holds the critic's ``values``.

    Returns:
        ``critic/score/{mean,max,min}``, the same for rewards, advantages, returns (and values,
        with ``critic/vf_explained_var``), ``response_length/*`` and ``prompt_length/*`` with
        their ``clip_ratio``, and, outside bypass mode, the sampler's probabilities
        against the recomputed ones (``training/rollout_probs_diff_*``,
        ``training/rollout_actor_probs_pearson_corr``); scalar tensors.
    """
    mask = batch["response_mask"]  # the advantages' tokens (rejection sampling may have dropped some)
    sampled = batch["attention_mask"][:, batch["prompts"].shape[1] :]  # every sampled token, as verl measures
    rows = torch.ones_like(mask[:, 0])
    out = {}

    def mean_max_min(name: str, values: torch.Tensor, valid: torch.Tensor) -> None:
        out[f"{name}/mean"] = masked_mean(values, valid)
        out[f"{name}/max"], out[f"{name}/min"] = masked_max_min(values, valid)

    mean_max_min("critic/score", batch["token_level_scores"].sum(-1), rows)
    mean_max_min("critic/rewards", batch["token_level_rewards"].sum(-1), rows)
    mean_max_min("critic/advantages", batch["advantages"], mask)
    mean_max_min("critic/returns", batch["returns"], mask)
    if use_critic:
        mean_max_min("critic/values", batch["values"], mask)
        out["critic/vf_explained_var"] = explained_variance(batch["returns"], batch["values"], mask)
    if not config.algorithm.rollout_correction.bypass_mode:
        # verl's debug metrics: the sampler's token probabilities against the trainer's own
        # recomputation; far from 0 (and a correlation below 1) when the two disagree
        old = batch["old_log_probs"].exp()
        rollout = batch["rollout_log_probs"].exp()
        diff = (old - rollout).abs()
        out["training/rollout_probs_diff_mean"] = masked_mean(diff, sampled)
        out["training/rollout_probs_diff_max"] = masked_max_min(diff, sampled)[0]
        out["training/rollout_probs_diff_std"] = masked_var(diff, sampled).sqrt()
        out["training/rollout_actor_probs_pearson_corr"] = masked_corr(old, rollout, sampled)
        # verl's rollout-correction diagnostics, logged in decoupled mode (bypass has no pi_old to compare)
        old_lp = batch["old_log_probs"]
        rollout_lp = batch["rollout_log_probs"]
        correction = config.algorithm.rollout_correction
        out |= offpolicy_metrics(old_lp, rollout_lp, sampled)
        if correction.rollout_is is not None:
            out |= rollout_is_metrics(
                old_lp,
                rollout_lp,
                sampled,
                threshold=correction.rollout_is_threshold,
                level=correction.rollout_is,
                batch_normalize=correction.rollout_is_batch_normalize,
            )
    prompt_length = batch["attention_mask"][:, : batch["prompts"].shape[1]].sum(-1).float()
    for name, length, limit in (
        ("response_length", sampled.sum(-1).float(), config.data.max_response_length),
        ("prompt_length", prompt_length, config.data.max_prompt_length),
    ):
        mean_max_min(name, length, rows)
        out[f"{name}/clip_ratio"] = (length == limit).float().mean()
    return out


def gather(metrics: dict, per_mini: list[dict], device: torch.device) -> dict[str, float]:
    """``metrics`` and the mean of each update statistic over the mini-batches, as floats, read
    in one host transfer.

    Args:
        metrics: name -> scalar tensor or number.
        per_mini: one dict of scalar tensors per mini-batch update.
        device: where the tensors are.
    """
    out = dict(metrics)
    for k in sorted({k for m in per_mini for k in m}):
        values = [m[k] for m in per_mini if k in m]
        out[k] = sum(torch.as_tensor(v, device=device, dtype=torch.float32) for v in values) / len(values)
    names = list(out)
    flat = torch.stack([torch.as_tensor(out[k], dtype=torch.float32, device=device) for k in names]).tolist()
    return dict(zip(names, flat))


def throughput_metrics(batch: dict[str, torch.Tensor], timing: dict[str, float]) -> dict[str, float]:
    """verl's ``compute_timing_metrics`` per-token part and ``compute_throughout_metrics`` (one GPU).

    Args:
        batch: needs ``attention_mask`` (B, P + R) and ``response_mask`` (B, R).
        timing: ``timing_s/<phase>`` seconds, ``timing_s/step`` included.

    Returns:
        ``timing_per_token_ms/<phase>`` (generation per response token, the other phases per
        prompt + response token), ``perf/total_num_tokens``, ``perf/time_per_step`` and
        ``perf/throughput`` (tokens per second).
    """
    counts = torch.stack([batch["attention_mask"].sum(), batch["response_mask"].sum()]).tolist()
    total, responses = (int(c) for c in counts)
    step = timing["timing_s/step"]
    out = {"perf/total_num_tokens": total, "perf/time_per_step": step, "perf/throughput": total / step}
    for phase in ("gen", "ref", "values", "adv", "update_critic", "update_actor"):
        if f"timing_s/{phase}" in timing:
            tokens = responses if phase == "gen" else total
            out[f"timing_per_token_ms/{phase}"] = timing[f"timing_s/{phase}"] * 1000 / tokens
    return out


# The progress bar's fields: (label, metric); a metric the step did not compute is left out.
BAR_FIELDS = (
    ("score", "critic/score/mean"),
    ("val", "val/score"),
    ("ref_kl", "actor/reward_kl_penalty"),  # KL to the reference, in the reward ...
    ("kl_loss", "actor/kl_loss"),  # ... or in the loss
    ("ppo_kl", "actor/ppo_kl"),  # old vs new policy
    ("step_s", "timing_s/step"),
)


def bar_fields(metrics: dict[str, float]) -> dict[str, str]:
    """The progress bar's postfix for one step's metrics."""
    return {label: f"{metrics[key]:.4g}" for label, key in BAR_FIELDS if key in metrics}


@contextlib.contextmanager
def timer(timing: dict, name: str, device: torch.device) -> Iterator[None]:
    """Add the block's wall time (its device work included) to ``timing["timing_s/<name>"]``;
    in a ``torch.profiler`` trace its operators sit under a range of that name."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.profiler.record_function(f"timing_s/{name}"):
        yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    timing[f"timing_s/{name}"] = timing.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


def peak_memory_gb(device: torch.device) -> float:
    """CUDA: the peak allocated since the last reset. CPU: the process's peak resident set (Linux KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
