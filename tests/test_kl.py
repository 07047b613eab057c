import math

import pytest
import torch
from _inputs import batches
from hypothesis import given
from hypothesis import strategies as st

from refppo.kl import (
    AdaptiveKLController,
    FixedKLController,
    PPOPaperKLController,
    get_kl_controller,
    kl_full,
    kl_penalty,
    kl_penalty_types,
)

BUILT_IN = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
NAMES = BUILT_IN + tuple(name + "+" for name in BUILT_IN)


def test_every_built_in_estimator_and_its_plus_form_is_registered():
    assert set(NAMES) <= set(kl_penalty_types())


def ref_estimator(lp, ref, name):
    """The estimators written from Schulman's note, float64; r = pi_ref / pi."""
    x = lp - ref
    if name in ("kl", "k1"):
        return x
    if name == "abs":
        return abs(x)
    if name in ("mse", "k2"):
        return 0.5 * x * x
    log_r = min(max(-x, -20.0), 20.0)
    return min(max(math.exp(log_r) - 1 - log_r, -10.0), 10.0)


@given(batches(), st.sampled_from(NAMES))
def test_estimators_match_formulas(b, name):
    gen, batch, length, _ = b
    lp = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 4
    ref = lp + torch.randn(batch, length, generator=gen, dtype=torch.float64)
    out = kl_penalty(lp, ref, name)
    base = name.rstrip("+")
    for o, a, r in zip(out.flatten().tolist(), lp.flatten().tolist(), ref.flatten().tolist()):
        assert o == pytest.approx(ref_estimator(a, r, base), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("name", ["k1+", "kl+", "abs+", "low_var_kl+", "k3+", "k2+", "mse+"])
def test_straight_through_variants_carry_k2_gradient(name):
    gen = torch.Generator().manual_seed(0)
    lp = (-torch.rand(3, 4, generator=gen, dtype=torch.float64)).requires_grad_()
    ref = lp.detach() + torch.randn(3, 4, generator=gen, dtype=torch.float64)
    out = kl_penalty(lp, ref, name)
    torch.testing.assert_close(out, kl_penalty(lp, ref, name.rstrip("+")))  # the estimator's value
    out.sum().backward()
    torch.testing.assert_close(lp.grad, lp.detach() - ref)  # d/dlp of 0.5 (lp - ref)^2


def test_k3_is_accurate_for_tiny_differences():
    # verl's exp(x) - x - 1 loses all digits in float32 when |x| ~ 1e-4; expm1(x) - x keeps them.
    lp = torch.full((5,), -1.0)
    ref = lp + torch.tensor([1e-4, -1e-4, 3e-4, 1e-3, -2e-4])
    got = kl_penalty(lp, ref, "k3").double()
    x = ref.double() - lp.double()
    exact = torch.tensor([math.expm1(v) - v for v in x.tolist()], dtype=torch.float64)
    assert ((got - exact).abs() / exact).max().item() < 1e-3
    naive = (torch.exp(ref - lp) - (ref - lp) - 1).double()
    assert ((naive - exact).abs() / exact).max().item() > 1e-2  # what the stable form avoids


def test_k1_and_k3_are_unbiased_k2_is_not():
    # Monte Carlo on a categorical: E_pi[k1] = E_pi[k3] = KL(pi || ref); k2 is biased.
    # Scale 0.5 keeps pi_ref / pi small: verl's clamp of k3 at 10 never bites (see below).
    gen = torch.Generator().manual_seed(0)
    logits = 0.5 * torch.randn(8, generator=gen, dtype=torch.float64)
    ref_logits = 0.5 * torch.randn(8, generator=gen, dtype=torch.float64)
    logp, ref_logp = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    exact = sum(math.exp(a) * (a - b) for a, b in zip(logp.tolist(), ref_logp.tolist()))
    sample = torch.multinomial(logp.exp(), 400_000, replacement=True, generator=gen)
    for name, unbiased in (("k1", True), ("k3", True), ("k2", False)):
        est = kl_penalty(logp[sample], ref_logp[sample], name).mean().item()
        expect = sum(math.exp(a) * ref_estimator(a, b, name) for a, b in zip(logp.tolist(), ref_logp.tolist()))
        assert est == pytest.approx(expect, abs=0.01)  # sample mean matches the estimator's expectation
        assert (abs(expect - exact) < 1e-12) is unbiased


def test_kl_full_matches_plain_sum():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, 3, 7, generator=gen), torch.randn(2, 3, 7, generator=gen)
    out = kl_full(a, b, temperature=0.9)
    for i in range(2):
        for t in range(3):
            p = [math.exp(x / 0.9) for x in a[i, t].tolist()]
            q = [math.exp(x / 0.9) for x in b[i, t].tolist()]
            p, q = [x / sum(p) for x in p], [x / sum(q) for x in q]
            assert out[i, t].item() == pytest.approx(sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)), abs=1e-5)


def test_adaptive_controller_follows_ziegler_rule():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10_000)
    beta = 0.1
    for kl in [0.0, 3.0, 6.0, 7.0, 50.0]:
        ctrl.update(kl, n_steps=256)
        beta *= 1 + min(max(kl / 6.0 - 1, -0.2), 0.2) * 256 / 10_000
        assert ctrl.value == pytest.approx(beta, rel=1e-12)


def test_fixed_and_ppo_paper_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 10)
    assert fixed.value == 0.05
    ctrl = PPOPaperKLController(init_kl_coef=1.0, target_kl=0.01)
    for kl, expect in [(0.02, 2.0), (0.001, 1.0), (0.012, 1.0), (0.0066, 0.5), (0.0068, 0.5)]:
        ctrl.update(kl)
        assert ctrl.value == expect


def test_controller_factory_and_errors():
    assert isinstance(get_kl_controller("fixed", 0.1), FixedKLController)
    assert isinstance(get_kl_controller("adaptive", 0.1, 6.0, 10000), AdaptiveKLController)
    assert isinstance(get_kl_controller("ppo_paper", 0.1, 0.01), PPOPaperKLController)
    with pytest.raises(ValueError, match="valid: adaptive, fixed, ppo_paper"):
        get_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="horizon"):
        get_kl_controller("adaptive", 0.1, 6.0, 0)
    with pytest.raises(ValueError, match="target_kl"):
        get_kl_controller("ppo_paper", 0.1, None or 0.0)
    with pytest.raises(ValueError, match="unknown kl_penalty 'k4'"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match="shape mismatch"):
        kl_penalty(torch.zeros(2), torch.zeros(3))


def test_k3_clamp_at_ten_biases_rare_large_ratios():
    # A token with pi_ref / pi = e^3: k3 = e^3 - 1 - 3 = 16.1, clamped to 10 as in verl.
    out = kl_penalty(torch.tensor([-5.0]), torch.tensor([-2.0]), "k3")
    assert out.item() == 10.0


def test_non_finite_log_probs_are_refused_by_every_estimator():
    good = torch.zeros(2, 3)
    for bad in (float("nan"), float("-inf"), float("inf")):
        x = good.clone()
        x[1, 2] = bad
        for name in ("kl", "k3", "k2+"):
            with pytest.raises(ValueError, match="logprob contains NaN or inf"):
                kl_penalty(x, good, name)
            with pytest.raises(ValueError, match="ref_logprob contains NaN or inf"):
                kl_penalty(good, x, name)
