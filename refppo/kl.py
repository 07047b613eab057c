"""KL estimators and KL coefficient controllers (ch 2, 6).

``kl_penalty(logprob, ref_logprob)`` estimates KL(pi || pi_ref) from tokens sampled from pi,
where ``logprob = log pi(a_t|s_t)`` and ``ref_logprob = log pi_ref(a_t|s_t)``; both (batch, T).
With r = pi_ref / pi (the ratio the other way round):

    k1 = log pi - log pi_ref            unbiased, can be negative
    abs = |k1|
    k2 = 0.5 * (log pi - log pi_ref)^2  biased, but its gradient is the KL's gradient
    k3 = (r - 1) - log r                unbiased and >= 0 (Schulman's "low variance" estimator)

A name ending in "+" (e.g. "k3+") returns the estimator's value with k2's gradient.
"""

from __future__ import annotations

import torch

from refppo.guards.checks import TEMPERATURES, check_choice, check_number, check_same_shape, check_values, checks_once
from refppo.guards.inputs import check_kl_update
from refppo.registry import Registry

KL_ESTIMATORS = Registry("KL estimator")


def register_kl_estimator(*names: str):
    """Decorator: register ``fn(logprob, ref_logprob) -> (batch, T)`` under ``names``; each also gets
    its straight-through form ``name + "+"``."""
    if any(name.endswith("+") for name in names):
        raise ValueError(f"{names}: a trailing '+' marks the straight-through form; register the base name")
    return KL_ESTIMATORS.register(*names)


def kl_penalty_types() -> tuple[str, ...]:
    """Every name ``kl_penalty`` accepts: the registered estimators, then their "+" forms."""
    return KL_ESTIMATORS.names() + tuple(name + "+" for name in KL_ESTIMATORS.names())


@register_kl_estimator("kl", "k1")
def kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref; (batch, T) -> (batch, T)."""
    check_same_shape(logprob=logprob, ref_logprob=ref_logprob)
    return logprob - ref_logprob


@register_kl_estimator("abs")
def kl_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """|k1|; (batch, T) -> (batch, T)."""
    check_same_shape(logprob=logprob, ref_logprob=ref_logprob)
    return (logprob - ref_logprob).abs()


@register_kl_estimator("mse", "k2")
def kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (log pi - log pi_ref)^2; (batch, T) -> (batch, T)."""
    check_same_shape(logprob=logprob, ref_logprob=ref_logprob)
    return 0.5 * (logprob - ref_logprob).square()


@register_kl_estimator("low_var_kl", "k3")
def kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k3 = (r - 1) - log r with r = pi_ref / pi; (batch, T) -> (batch, T).

    Computed as expm1(x) - x: the same value as verl's exp(x) - x - 1 without its cancellation
    when x is small. Clamped as verl's: the log-ratio to +-20, the result to +-10.
    """
    check_same_shape(logprob=logprob, ref_logprob=ref_logprob)
    log_r = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(torch.expm1(log_r) - log_r, min=-10, max=10)


@checks_once
def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str = "kl") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of sampled tokens (verl's kl_penalty).

    Args:
        logprob: (batch, T) log pi(a_t | s_t) of the sampled tokens; the sampling policy.
        ref_logprob: (batch, T) log pi_ref(a_t | s_t) of the same tokens.
        kl_penalty: a registered estimator (kl/k1, abs, mse/k2, low_var_kl/k3, ...), optionally
            with "+" for its value with k2's gradient.

    Returns:
        (batch, T) per-token estimates (not masked).

    Raises:
        ValueError: an unknown name (never a fall-through to another estimator), mismatched
            shapes, NaN or inf in either input.
    """
    check_choice("kl_penalty", kl_penalty, kl_penalty_types())
    check_same_shape(logprob=logprob, ref_logprob=ref_logprob)
    check_values(finite={"logprob": logprob, "ref_logprob": ref_logprob})
    value = KL_ESTIMATORS.get(kl_penalty.removesuffix("+"))(logprob, ref_logprob)
    if not kl_penalty.endswith("+"):
        return value
    # Straight-through: forward value of the estimator, backward gradient of k2.
    k2 = kl_k2(logprob, ref_logprob)
    return k2 - k2.detach() + value.detach()


@checks_once
def kl_full(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Exact KL(pi || pi_ref) over the whole vocabulary at each position, in float32.

    sum_v pi(v) * (log pi(v) - log pi_ref(v)) with pi = softmax(logits / temperature).
    Holds (..., vocab) float32 intermediates: meant for small models and for checking estimators.

    Args:
        logits: (..., vocab) logits of pi.
        ref_logits: (..., vocab) logits of pi_ref.
        temperature: divides both.

    Returns:
        (...) float32 KL per position, >= 0.

    Raises:
        ValueError: mismatched shapes, a temperature not > 0, NaN or inf in either input.
    """
    check_same_shape(logits=logits, ref_logits=ref_logits)
    if logits.dim() < 1:
        raise ValueError("logits must be (..., vocab), got a scalar")
    check_number("temperature", temperature, TEMPERATURES)
    check_values(finite={"logits": logits, "ref_logits": ref_logits})
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    ref_logp = torch.log_softmax(ref_logits.float() / temperature, dim=-1)
    return (logp.exp() * (logp - ref_logp)).sum(-1)


class FixedKLController:
    """A constant KL coefficient beta (``algorithm.kl_ctrl.type=fixed``)."""

    def __init__(self, kl_coef: float):
        check_number("kl_coef", kl_coef, "[0, inf)")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int = 1) -> None:
        """Does nothing: beta stays fixed (the arguments are checked as the other controllers')."""
        check_kl_update(current_kl, n_steps)


class AdaptiveKLController:
    """Ziegler et al. (2019)'s controller (``algorithm.kl_ctrl.type=adaptive``).

    beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon): each step is
    proportional to the clipped relative error, so log beta integrates it (ch 6.3).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        check_number("init_kl_coef", init_kl_coef, "[0, inf)")
        check_number("target_kl", target_kl, "(0, inf)")
        check_number("horizon", horizon, "(0, inf)")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int = 1) -> None:
        """Move beta toward the target KL; ``n_steps`` is the number of samples in the batch."""
        check_kl_update(current_kl, n_steps)
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


class PPOPaperKLController:
    """The PPO paper's adaptive penalty (Schulman et al. 2017, section 4).

    Halve beta when KL < target / 1.5, double it when KL > target * 1.5, else keep it.
    """

    def __init__(self, init_kl_coef: float, target_kl: float):
        check_number("init_kl_coef", init_kl_coef, "[0, inf)")
        check_number("target_kl", target_kl, "(0, inf)")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)

    def update(self, current_kl: float, n_steps: int = 1) -> None:
        """Apply the 1.5x / 2x rule once (``n_steps`` is accepted for a common interface)."""
        check_kl_update(current_kl, n_steps)
        kl = float(current_kl)
        if kl < self.target / 1.5:
            self.value /= 2.0
        elif kl > self.target * 1.5:
            self.value *= 2.0


KL_CONTROLLER_TYPES = ("fixed", "adaptive", "ppo_paper")


def get_kl_controller(type: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None):
    """Build the controller named by ``algorithm.kl_ctrl.type``.

    Args:
        type: 'fixed', 'adaptive' (Ziegler et al.) or 'ppo_paper' (halve / double).
        kl_coef: initial beta.
        target_kl: target KL per token (adaptive, ppo_paper).
        horizon: samples over which the adaptive controller moves (adaptive).
    """
    check_choice("kl_ctrl.type", type, KL_CONTROLLER_TYPES)
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    return PPOPaperKLController(kl_coef, target_kl)
