import math

import pytest
import torch
from _inputs import batches, make_mask
from hypothesis import given
from hypothesis import strategies as st

from refppo.losses import (
    LOSS_AGG_MODES,
    ROW_MEAN,
    agg_loss,
    agg_loss_weight,
    compute_policy_loss,
    compute_ppo_penalty_loss,
    compute_value_loss,
)


def ref_agg(loss, mask, mode, scale=None):
    """Plain float64 aggregation over lists of lists (verl 0.9's rules)."""
    rows = [[x for x, m in zip(xr, mr) if m == 1] for xr, mr in zip(loss, mask)]
    tokens = [x for r in rows for x in r]
    if mode == "token-mean":
        return sum(tokens) / len(tokens)
    if mode == "token-sum":
        return sum(tokens)
    per_seq = {
        "seq-mean-token-sum": lambda r: sum(r),
        "seq-mean-token-mean": lambda r: sum(r) / (len(r) + 1e-8),  # verl's 1e-8
        "seq-mean-token-sum-norm": lambda r: sum(r) / (len(loss[0]) if scale is None else scale),
    }[mode]
    seqs = [per_seq(r) for r in rows if r]
    return sum(seqs) / len(seqs)


def ref_policy_token_loss(old, new, a, low, high, c):
    """The clipped (and dual-clipped) per-token loss, written from the formula."""
    ratio = math.exp(min(max(new - old, -20.0), 20.0))
    clipped = min(max(ratio, 1 - low), 1 + high)
    loss = max(-a * ratio, -a * clipped)
    was_clipped = -a * clipped > -a * ratio
    lower = False
    if c is not None and a < 0:
        lower = loss > -a * c
        loss = min(loss, -a * c)
    return loss, was_clipped, lower


def random_policy_inputs(gen, batch, length):
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    new = old + torch.randn(batch, length, generator=gen, dtype=torch.float64) * 0.6
    adv = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return old, new, adv


@given(
    batches(),
    st.sampled_from(LOSS_AGG_MODES),
    st.sampled_from([(0.2, None, None), (0.2, 0.2, 0.28), (0.1, 0.3, 0.05)]),
    st.sampled_from([None, 3.0, 1.5]),
)
def test_policy_loss_matches_formula(b, mode, clips, clip_c):
    gen, batch, length, kind = b
    mask = make_mask(kind, batch, length, gen)
    old, new, adv = random_policy_inputs(gen, batch, length)
    eps, lo, hi = clips
    low, high = (eps if lo is None else lo), (eps if hi is None else hi)
    loss, metrics = compute_policy_loss(old, new, adv, mask, eps, lo, hi, clip_c, mode)
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}  # verl 0.9's names
    clipfrac, ppo_kl, clipfrac_lower = (metrics[f"actor/{k}"] for k in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"))
    per_token = [
        [ref_policy_token_loss(o, n, a, low, high, clip_c) for o, n, a in zip(*rows)]
        for rows in zip(old.tolist(), new.tolist(), adv.tolist())
    ]
    m = mask.tolist()
    assert loss.item() == pytest.approx(ref_agg([[x[0] for x in r] for r in per_token], m, mode), abs=1e-9)
    assert clipfrac.item() == pytest.approx(
        ref_agg([[float(x[1]) for x in r] for r in per_token], m, "token-mean"), abs=1e-7
    )
    assert clipfrac_lower.item() == pytest.approx(
        ref_agg([[float(x[2]) for x in r] for r in per_token], m, "token-mean"), abs=1e-7
    )
    kl = [[o - n for o, n in zip(ro, rn)] for ro, rn in zip(old.tolist(), new.tolist())]
    assert ppo_kl.item() == pytest.approx(ref_agg(kl, m, "token-mean"), abs=1e-7)


def test_worked_example_from_seed_004():
    # old -2.0, new -1.5: ratio exp(0.5) = 1.6487, A = 0.5, eps 0.2 -> max(-0.824, -0.6) = -0.6
    loss, metrics = compute_policy_loss(
        torch.tensor([[-2.0]]), torch.tensor([[-1.5]]), torch.tensor([[0.5]]), torch.ones(1, 1), clip_ratio=0.2
    )
    assert loss.item() == pytest.approx(-0.6)
    assert metrics["actor/pg_clipfrac"].item() == 1.0 and metrics["actor/ppo_kl"].item() == pytest.approx(-0.5)


def grad_wrt_log_prob(log_ratio, a, clip_c=3.0, eps=0.2):
    new = torch.tensor([[log_ratio]], dtype=torch.float64, requires_grad=True)
    loss, _ = compute_policy_loss(
        torch.zeros(1, 1, dtype=torch.float64),
        new,
        torch.tensor([[a]], dtype=torch.float64),
        torch.ones(1, 1),
        clip_ratio=eps,
        clip_ratio_c=clip_c,
    )
    loss.backward()
    return loss.item(), new.grad.item()


@pytest.mark.parametrize(
    "ratio, a, clipped",
    [
        (1.5, 1.0, True),  # A > 0, ratio above 1 + eps: no more push up
        (1.1, 1.0, False),  # A > 0, inside the band
        (0.5, 1.0, False),  # A > 0, below 1 - eps: still pushed up (the min picks the unclipped term)
        (0.5, -1.0, True),  # A < 0, ratio below 1 - eps: no more push down
        (0.9, -1.0, False),  # A < 0, inside the band
        (2.0, -1.0, False),  # A < 0, above 1 + eps (below c): still pushed down
    ],
)
def test_six_cases_gradients(ratio, a, clipped):
    loss, g = grad_wrt_log_prob(math.log(ratio), a, clip_c=None)
    if clipped:
        assert g == 0.0
    else:
        # d(-A * ratio) / d log_prob = -A * ratio
        assert g == pytest.approx(-a * ratio, rel=1e-9)


def test_dual_clip_caps_negative_advantage_loss():
    a = -1.0
    loss, g = grad_wrt_log_prob(math.log(5.0), a, clip_c=3.0)
    assert loss == pytest.approx(-a * 3.0) and g == 0.0  # capped at -c * A = 3, no gradient
    loss, g = grad_wrt_log_prob(math.log(5.0), a, clip_c=None)
    assert loss == pytest.approx(5.0) and g == pytest.approx(5.0)  # without it the loss grows with the ratio
    loss, g = grad_wrt_log_prob(math.log(5.0), 1.0, clip_c=3.0)
    assert loss == pytest.approx(-1.2) and g == 0.0  # A > 0: dual-clip does nothing


def test_first_step_ratio_one_gives_plain_policy_gradient():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 4, generator=gen, dtype=torch.float64)
    new = old.clone().requires_grad_()
    adv = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    loss, metrics = compute_policy_loss(old, new, adv, torch.ones(3, 4))
    loss.backward()
    assert metrics["actor/pg_clipfrac"].item() == 0.0 and metrics["actor/ppo_kl"].item() == 0.0
    torch.testing.assert_close(new.grad, -adv / 12)


def test_rollout_is_weights_scale_each_token():
    gen = torch.Generator().manual_seed(1)
    old, new, adv = random_policy_inputs(gen, 2, 5)
    w = torch.rand(2, 5, generator=gen, dtype=torch.float64)
    mask = torch.ones(2, 5)
    base = [
        [ref_policy_token_loss(o, n, a, 0.2, 0.2, 3.0)[0] for o, n, a in zip(*r)]
        for r in zip(old.tolist(), new.tolist(), adv.tolist())
    ]
    weighted = [[x * wi for x, wi in zip(rb, rw)] for rb, rw in zip(base, w.tolist())]
    loss, _ = compute_policy_loss(old, new, adv, mask, rollout_is_weights=w)
    assert loss.item() == pytest.approx(ref_agg(weighted, mask.tolist(), "token-mean"), abs=1e-12)


@given(batches(), st.sampled_from(["kl", "low_var_kl", "mse"]))
def test_ppo_penalty_loss_matches_formula(b, est):
    gen, batch, length, kind = b
    mask = make_mask(kind, batch, length, gen)
    old, new, adv = random_policy_inputs(gen, batch, length)
    loss, metrics = compute_ppo_penalty_loss(old, new, adv, mask, penalty_kl_coef=0.3, penalty_kl_type=est)
    kl = metrics["actor/ppo_kl"]

    def kl_old_new(o, n):  # samples come from pi_old: KL(old || new), ratio r = new / old
        if est == "kl":
            return o - n
        if est == "mse":
            return 0.5 * (o - n) ** 2
        return min(math.exp(n - o) - 1 - (n - o), 10.0)  # k3, clamped at 10 as verl does

    per = [
        [-a * math.exp(n - o) + 0.3 * kl_old_new(o, n) for o, n, a in zip(*r)]
        for r in zip(old.tolist(), new.tolist(), adv.tolist())
    ]
    kls = [[kl_old_new(o, n) for o, n in zip(*r)] for r in zip(old.tolist(), new.tolist())]
    assert loss.item() == pytest.approx(ref_agg(per, mask.tolist(), "token-mean"), abs=1e-9)
    assert kl.item() == pytest.approx(ref_agg(kls, mask.tolist(), "token-mean"), abs=1e-7)


@given(batches(), st.sampled_from([None, 0.0, 0.2, 0.5]), st.sampled_from(LOSS_AGG_MODES))
def test_value_loss_matches_formula(b, clip, mode):
    gen, batch, length, kind = b
    mask = make_mask(kind, batch, length, gen)
    vpreds, returns, values = (torch.randn(batch, length, generator=gen, dtype=torch.float64) for _ in range(3))
    loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, clip, mode)
    per, frac = [], []
    for rv, rr, ro in zip(vpreds.tolist(), returns.tolist(), values.tolist()):
        pr, fr = [], []
        for v, r, o in zip(rv, rr, ro):
            l1 = (v - r) ** 2
            l2 = l1 if clip is None else (min(max(v, o - clip), o + clip) - r) ** 2
            pr.append(max(l1, l2))
            fr.append(float(l2 > l1))
        per.append(pr)
        frac.append(fr)
    assert loss.item() == pytest.approx(0.5 * ref_agg(per, mask.tolist(), mode), abs=1e-9)
    assert clipfrac.item() == pytest.approx(ref_agg(frac, mask.tolist(), "token-mean"), abs=1e-7)


def test_value_clip_stops_gradient_outside_band():
    # deepspeed-chat / 003.9: the max picks the clipped error when the new value ran past the band.
    vpreds = torch.tensor([[2.0]], requires_grad=True)
    loss, clipfrac = compute_value_loss(vpreds, torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * 4.0) and vpreds.grad.item() == pytest.approx(2.0)
    vpreds = torch.tensor([[2.0]], requires_grad=True)
    loss, clipfrac = compute_value_loss(vpreds, torch.tensor([[3.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * 1.8**2) and vpreds.grad.item() == 0.0 and clipfrac.item() == 1.0


@given(batches(), st.sampled_from(LOSS_AGG_MODES))
def test_agg_loss_matches_plain_loops(b, mode):
    gen, batch, length, kind = b
    mask = make_mask(kind, batch, length, gen)
    loss_mat = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    loss_mat[mask == 0] = float("nan")  # padding must not leak
    assert agg_loss(loss_mat, mask, mode).item() == pytest.approx(
        ref_agg(loss_mat.tolist(), mask.tolist(), mode), abs=1e-9
    )


def test_seq_mean_token_sum_norm_is_a_mean_of_sequences_over_a_constant():
    """Dr. GRPO / verl 0.9: each sequence's token sum over a constant, averaged over sequences;
    the constant does not follow the batch's width, so a short batch is not scaled up."""
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", 8).item() == pytest.approx((6 / 8 + 4 / 8) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((6 / 3 + 4 / 3) / 2)
    # The same responses in a batch cut to width 2 (generation stopped early): same loss with a constant.
    short = agg_loss(loss[:1, :2], mask[:1, :2], "seq-mean-token-sum-norm", 8)
    assert short.item() == pytest.approx(3 / 8)
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"loss_scale_factor must be in \(0, inf\)"):
        compute_policy_loss(x, x, x, m, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=0)


def test_both_policy_losses_ignore_nan_in_padding():
    """Padding may hold anything: the clip and the penalty loss check valid tokens only."""
    x, m = torch.zeros(2, 3), torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    old = x.clone()
    old[0, 2] = float("nan")
    assert torch.isfinite(compute_policy_loss(old, x, x, m)[0])
    loss, metrics = compute_ppo_penalty_loss(old, x, x, m, penalty_kl_coef=0.1)
    assert torch.isfinite(loss) and torch.isfinite(metrics["actor/ppo_kl"])


def test_negative_importance_weights_are_refused():
    """A negative weight would flip its token's loss: an error, at valid tokens only."""
    x, m = torch.zeros(2, 3), torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    weights = torch.ones(2, 3)
    weights[0, 2] = -1.0  # padding: ignored
    compute_policy_loss(x, x, x, m, rollout_is_weights=weights)
    weights[1, 0] = -0.5
    with pytest.raises(ValueError, match="rollout_is_weights has a negative entry at a valid token"):
        compute_policy_loss(x, x, x, m, rollout_is_weights=weights)


def test_loss_bad_input():
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"clip_ratio_c must be in \(1, inf\)"):
        compute_policy_loss(x, x, x, m, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'; valid: seq-mean-token-mean"):
        compute_policy_loss(x, x, x, m, loss_agg_mode="mean")
    with pytest.raises(ValueError, match="shape mismatch"):
        compute_policy_loss(x, torch.zeros(2, 4), x, m)
    with pytest.raises(ValueError, match="only 0 and 1"):
        compute_value_loss(x, x, x, m * 2, 0.2)
    with pytest.raises(ValueError, match="fewer than 1 valid"):
        compute_policy_loss(x, x, x, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="advantages contains NaN"):
        compute_policy_loss(x, x, torch.full((2, 3), float("nan")), m)
    with pytest.raises(ValueError, match=r"cliprange_value must be in \[0, inf\)"):
        compute_value_loss(x, x, x, m, -0.1)
    with pytest.raises(ValueError, match=r"clip_ratio must be in \[0, 1\)"):
        compute_policy_loss(x, x, x, m, clip_ratio=1.2)
    with pytest.raises(ValueError, match=r"penalty_kl_coef must be in \[0, inf\)"):
        compute_ppo_penalty_loss(x, x, x, m, penalty_kl_coef=-1.0)


@given(batches(), st.sampled_from(["ragged", "holes", "with_empty_rows"]), st.integers(1, 4))
def test_micro_batch_weights_rebuild_the_mini_batch_loss(b, kind, n_micro):
    """Gradient accumulation: sum of weight * agg_loss(micro) == the mini-batch's loss as verl's
    engine aggregates it, every mode: a sequence mean over every row of the mini-batch, an empty
    one included (``global_batch_size``)."""
    gen, batch, length, _ = b
    mask = make_mask(kind, batch, length, gen)
    loss_mat = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    for mode in LOSS_AGG_MODES:
        whole = agg_loss(loss_mat, mask, mode, global_batch_size=batch)
        total = 0.0
        for rows in torch.arange(batch).tensor_split(n_micro):
            if len(rows) == 0 or mask[rows].sum() == 0:
                continue  # a micro-batch with no valid token contributes nothing
            total += (agg_loss_weight(mask[rows], mask, mode) * agg_loss(loss_mat[rows], mask[rows], mode)).item()
        assert math.isclose(total, whole.item(), rel_tol=1e-9, abs_tol=1e-12), mode


@given(batches(), st.sampled_from(["ragged", "holes", "with_empty_rows"]), st.integers(1, 4))
def test_row_mean_weights_rebuild_the_mean_over_every_row(b, kind, n_micro):
    """ROW_MEAN, a loss that is the mean over every row of its batch (GMPO's), empty rows included:
    sum of weight * (mean over the micro-batch's rows) == the mean over the mini-batch's rows."""
    gen, batch, length, _ = b
    mask = make_mask(kind, batch, length, gen)
    row_losses = torch.randn(batch, generator=gen, dtype=torch.float64) * (mask.sum(-1) > 0)
    total = 0.0
    for rows in torch.arange(batch).tensor_split(n_micro):
        if len(rows):
            total += (agg_loss_weight(mask[rows], mask, ROW_MEAN) * row_losses[rows].mean()).item()
    assert math.isclose(total, row_losses.mean().item(), rel_tol=1e-9, abs_tol=1e-12)
