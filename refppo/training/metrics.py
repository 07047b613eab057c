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

from refppo.algorithms.rollout_corr_metrics import offpolicy_metrics, rollout_is_metrics
from refppo.functional import masked_max_min, masked_mean, masked_sum, masked_var
from refppo.guards.checks import check_same_shape, check_values
from refppo.settings.config import Config


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


def gdpo_metrics(components: dict[str, torch.Tensor], keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """verl 0.9's ``gdpo/<key>/{mean,std,max,min}`` of each component GDPO normalises (``fit`` in
    ``verl/trainer/ppo/ray_trainer.py``: numpy's, so the std divides by n).

    Args:
        components: name -> (B,) the reward function's values.
        keys: ``algorithm.gdpo_reward_keys``.

    Returns:
        Scalar tensors.
    """
    out = {}
    for key in keys:
        if key not in components:  # verl logs the keys it finds; GDPO itself refuses a missing one
            continue
        values = components[key].float()
        out[f"gdpo/{key}/mean"] = values.mean()
        out[f"gdpo/{key}/std"] = values.std(correction=0)
        out[f"gdpo/{key}/max"] = values.max()
        out[f"gdpo/{key}/min"] = values.min()
    return out


def variance_proxy_metrics(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """verl 0.9's ``variance_proxy/*`` of a batch that holds ``sum_pi_squared``
    (``compute_variance_proxy_metrics`` in ``verl/trainer/ppo/metric_utils.py``), the parts that need
    no gradient: with W = sum over a response's tokens of 1 - 2 pi_t + sum_v pi_v^2 (pi_t =
    exp(old_log_probs); times rho^2 with ``rollout_is_weights``) and A each response's mean
    advantage, ``proxy2_total_power`` = mean(A^2 max(W, 0)) (with the weights, mean(rho_bar^2 A^2
    W_0), rho_bar each response's mean weight and W_0 the sum without rho^2, at least 0),
    ``expected_a_squared`` = mean(A^2) and ``expected_w`` = mean(W).

    Args:
        batch: an evaluated batch with ``sum_pi_squared``, ``old_log_probs``, ``advantages`` and
            ``response_mask`` (B, T), and maybe ``rollout_is_weights``.

    Returns:
        Scalar tensors.
    """
    mask = batch["response_mask"]
    w_per_token = 1 - 2 * torch.exp(batch["old_log_probs"]) + batch["sum_pi_squared"]
    weights = batch.get("rollout_is_weights")
    if weights is not None:
        rho_squared = weights.square()
        w_per_token = w_per_token * rho_squared
    advantages = masked_mean(batch["advantages"], mask, axis=-1)
    w_values = masked_sum(w_per_token, mask, axis=-1)
    if weights is None:
        total_power = (advantages.square() * w_values.clamp(min=0.0)).mean()
    else:  # verl divides the rho^2 back out of W, clamped away from 0
        w_original = masked_sum(w_per_token / rho_squared.clamp(min=1e-10), mask, axis=-1).clamp(min=0.0)
        total_power = (masked_mean(weights, mask, axis=-1).square() * advantages.square() * w_original).mean()
    return {
        "variance_proxy/proxy2_total_power": total_power,
        "variance_proxy/expected_a_squared": advantages.square().mean(),
        "variance_proxy/expected_w": w_values.mean(),
    }


def gradient_noise_proxies(metrics: dict[str, float], rows: int) -> dict[str, float]:
    """The rest of verl 0.9's ``variance_proxy/*``, from the step's gathered metrics:
    ``proxy1_signal_strength`` = actor/grad_norm^2 and ``proxy3_pure_noise`` = max(0, (proxy2 -
    proxy1) / (rows - 1)); both 0 in a step without an actor update or with one row, as verl.

    Args:
        metrics: the step's metrics, with ``variance_proxy/proxy2_total_power``.
        rows: the batch's responses.
    """
    grad_norm = metrics.get("actor/grad_norm")
    signal = 0.0 if grad_norm is None else grad_norm**2
    noise = 0.0
    if grad_norm is not None and rows > 1:
        noise = max(0.0, (metrics["variance_proxy/proxy2_total_power"] - signal) / (rows - 1))
    return {"variance_proxy/proxy1_signal_strength": signal, "variance_proxy/proxy3_pure_noise": noise}


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
        their ``clip_ratio``, ``response/aborted_ratio`` and ``response_length_non_aborted/*``
        (the responses of at least one token), and, outside bypass mode, the sampler's probabilities
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
    response_length = sampled.sum(-1).float()
    for name, length, limit in (
        ("response_length", response_length, config.data.max_response_length),
        ("prompt_length", prompt_length, config.data.max_prompt_length),
    ):
        mean_max_min(name, length, rows)
        out[f"{name}/clip_ratio"] = (length == limit).float().mean()
    # verl counts a response of no tokens as aborted by its engine (refppo's sampler never aborts one)
    kept = (response_length > 0).to(rows.dtype)
    out["response/aborted_ratio"] = 1 - kept.float().mean()
    mean_max_min("response_length_non_aborted", response_length, kept)
    at_limit = (response_length == config.data.max_response_length).float()
    out["response_length_non_aborted/clip_ratio"] = masked_mean(at_limit, kept)
    return out


def gather(metrics: dict, per_mini: list[dict], device: torch.device) -> dict[str, float]:
    """``metrics`` and each update statistic over the mini-batches, as floats, read in one host
    transfer: the largest value of a name with "max" in it, the smallest of one with "min", else
    the mean (verl's ``reduce_metrics``, ``verl/utils/metric/utils.py``).

    Args:
        metrics: name -> scalar tensor or number.
        per_mini: one dict of scalar tensors per mini-batch update.
        device: where the tensors are.
    """
    out = dict(metrics)
    for k in sorted({k for m in per_mini for k in m}):
        values = torch.stack([torch.as_tensor(m[k], device=device, dtype=torch.float32) for m in per_mini if k in m])
        if "max" in k:
            out[k] = values.max()
        elif "min" in k:
            out[k] = values.min()
        else:
            out[k] = values.mean()
    names = list(out)
    flat = torch.stack([torch.as_tensor(out[k], dtype=torch.float32, device=device) for k in names]).tolist()
    return dict(zip(names, flat))


def throughput_metrics(
    batch: dict[str, torch.Tensor], timing: dict[str, float], processes: int = 1
) -> dict[str, float]:
    """verl's ``compute_timing_metrics`` per-token part and ``compute_throughout_metrics``
    (``verl/trainer/ppo/metric_utils.py``): tokens counted from the attention mask, so a token that
    rejection sampling masked out of the loss still counts as generated.

    Args:
        batch: the whole step's batch: ``attention_mask`` (B, P + R) and ``responses`` (B, R).
        timing: ``timing_s/<phase>`` seconds, ``timing_s/step`` included.
        processes: the run's processes (verl's ``n_gpus``).

    Returns:
        ``timing_per_token_ms/<phase>`` (generation per response token, the other phases per
        prompt + response token), ``perf/total_num_tokens``, ``perf/time_per_step`` and
        ``perf/throughput`` (tokens per second per process).
    """
    width = batch["responses"].shape[1]
    sampled = batch["attention_mask"][:, -width:]  # every generated token, rejected or not
    counts = torch.stack([batch["attention_mask"].sum(), sampled.sum()]).tolist()
    total, responses = (int(c) for c in counts)
    step = timing["timing_s/step"]
    out = {"perf/total_num_tokens": total, "perf/time_per_step": step, "perf/throughput": total / (step * processes)}
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
