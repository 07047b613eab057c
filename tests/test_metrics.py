import math

import pytest
import torch
from _inputs import batches, make_mask
from hypothesis import given

from refppo.algorithms.rollout_corr_metrics import offpolicy_metrics, rollout_is_metrics
from refppo.functional import masked_max_min
from refppo.training.metrics import masked_corr


@given(batches())
def test_masked_corr_and_extremes_match_plain_loops(b):
    gen, batch, length, kind = b
    mask = make_mask(kind, batch, length, gen)
    x = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    y = 0.7 * x + torch.randn(batch, length, generator=gen, dtype=torch.float64)
    x[mask == 0] = 1e6  # padding must not count
    pairs = [(float(a), float(c)) for a, c, m in zip(x.flatten(), y.flatten(), mask.flatten()) if m == 1]
    if pairs:
        big, small = masked_max_min(x, mask)
        assert (big.item(), small.item()) == (max(a for a, _ in pairs), min(a for a, _ in pairs))
    if len(pairs) >= 2:
        mx, my = (sum(v) / len(pairs) for v in zip(*pairs))
        cov = sum((a - mx) * (c - my) for a, c in pairs)
        pearson = cov / math.sqrt(sum((a - mx) ** 2 for a, _ in pairs) * sum((c - my) ** 2 for _, c in pairs))
        assert masked_corr(x, y, mask).item() == pytest.approx(pearson, abs=1e-9)
        assert masked_corr(x.float(), y.float(), mask).item() == pytest.approx(pearson, abs=1e-4)


def test_masked_corr_edges():
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0]])
    x = torch.tensor([[1.0, 2, 9], [3, 9, 9]])
    assert masked_corr(x, -x, mask).item() == pytest.approx(-1.0)
    assert masked_corr(x, 2 * x + 1, mask).item() == pytest.approx(1.0)
    constant = torch.full((2, 3), 0.5)
    assert math.isnan(masked_corr(x, constant, mask).item())
    assert math.isnan(torch.corrcoef(torch.stack([x[mask.bool()], constant[mask.bool()]]))[0, 1].item())
    with pytest.raises(ValueError, match="fewer than 2 valid"):
        masked_corr(x, x, torch.tensor([[1.0, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="fewer than 1 valid"):
        masked_max_min(x, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="mask must contain only 0 and 1"):
        masked_max_min(x, torch.full((2, 3), 3.0))  # not read as a mask of ones
    with pytest.raises(ValueError, match="shape mismatch"):
        masked_corr(x, x, torch.ones(2, 4))


def _offpolicy_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(5, 6, generator=gen, dtype=torch.float64) * 2 - 0.05
    rollout = old + 0.6 * torch.randn(5, 6, generator=gen, dtype=torch.float64)
    mask = (torch.arange(6)[None, :] < torch.tensor([[6], [4], [1], [3], [5]])).double()
    return old, rollout, mask


@pytest.mark.parametrize("seed", range(3))
def test_offpolicy_metrics_are_verls(seed):
    """verl 0.9's compute_offpolicy_metrics, written plainly over Python lists in float64."""
    old, rollout, mask = _offpolicy_inputs(seed)
    rows = [
        [(o, r) for o, r, k in zip(ro, rr, rm) if k]
        for ro, rr, rm in zip(old.tolist(), rollout.tolist(), mask.tolist())
    ]
    tokens = [t for row in rows for t in row]
    train_seq = [sum(o for o, _ in row) / len(row) for row in rows]
    roll_seq = [sum(r for _, r in row) / len(row) for row in rows]
    diff = [r - t for r, t in zip(roll_seq, train_seq)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    want = {
        "training_ppl": mean([math.exp(-t) for t in train_seq]),
        "training_log_ppl": mean([-t for t in train_seq]),
        "kl": mean([r - o for o, r in tokens]),
        "k3_kl": mean([math.exp(o - r) - (o - r) - 1 for o, r in tokens]),
        "rollout_ppl": mean([math.exp(-r) for r in roll_seq]),
        "rollout_log_ppl": mean([-r for r in roll_seq]),
        "log_ppl_diff": mean(diff),
        "log_ppl_abs_diff": mean([abs(d) for d in diff]),
        "log_ppl_diff_max": max(diff),
        "log_ppl_diff_min": min(diff),
        "ppl_ratio": mean([math.exp(d) for d in diff]),
        "chi2_token": mean([math.exp(2 * (o - r)) for o, r in tokens]) - 1,
        "chi2_seq": mean([math.exp(2 * sum(o - r for o, r in row)) for row in rows]) - 1,
    }
    got = offpolicy_metrics(old, rollout, mask)
    assert set(got) == {f"rollout_corr/{k}" for k in want}
    for k, v in want.items():
        assert got[f"rollout_corr/{k}"].item() == pytest.approx(v, rel=1e-7), k


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [1.2, 2.0, "0.8_1.3", "0.5_1.1"])
def test_rollout_is_metrics_are_verls(level, threshold):
    """verl 0.9's compute_is_metrics, written plainly over Python lists in float64: truncated
    weights (TIS), or IcePop's ("lower_upper") zeroed outside the bounds, with its oob ratio."""
    old, rollout, mask = _offpolicy_inputs(7)
    rows = [
        [o - r for o, r, k in zip(ro, rr, rm) if k] for ro, rr, rm in zip(old.tolist(), rollout.tolist(), mask.tolist())
    ]
    if level == "token":
        raw = [[math.exp(x) for x in row] for row in rows]
    else:
        raw = [[math.exp(sum(row))] * len(row) for row in rows]
    lower, upper = map(float, threshold.split("_")) if isinstance(threshold, str) else (None, threshold)
    bottom = 1 / upper if lower is None else lower
    if lower is None:
        w = [[min(x, upper) for x in row] for row in raw]
    else:
        w = [[x if lower <= x <= upper else 0.0 for x in row] for row in raw]
    flat, raw_flat = [x for row in w for x in row], [x for row in raw for x in row]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    m = mean(flat)
    seq = [mean(row) for row in w]
    raw_seq = [mean(row) for row in raw]
    want = {
        "rollout_is_mean": m,
        "rollout_is_std": math.sqrt(max(mean([x * x for x in flat]) - m * m, 0.0)),
        "rollout_is_eff_sample_size": 1 / mean([(x / (m + 1e-8)) ** 2 for x in flat]),
        "rollout_is_seq_mean": mean(seq),
        "rollout_is_seq_std": math.sqrt(sum((x - mean(seq)) ** 2 for x in seq) / (len(seq) - 1)),
        "rollout_is_seq_max": max(seq),
        "rollout_is_seq_min": min(seq),
        "rollout_is_seq_max_deviation": max(abs(x - 1) for x in seq),
        "rollout_is_seq_fraction_high": mean([float(x > upper) for x in raw_seq]),
        "rollout_is_seq_fraction_low": mean([float(x < bottom) for x in raw_seq]),
    }
    if lower is not None:
        want["rollout_is_oob_ratio"] = mean([float(x < lower or x > upper) for x in raw_flat])
    if level == "token":
        want |= {
            "rollout_is_max": max(flat),
            "rollout_is_min": min(flat),
            "rollout_is_ratio_fraction_high": mean([float(x > upper) for x in raw_flat]),
            "rollout_is_ratio_fraction_low": mean([float(x < bottom) for x in raw_flat]),
        }
    else:
        sums = [sum(row) for row in rows]
        want |= {
            "rollout_is_max": math.exp(max(sums)),
            "rollout_is_min": math.exp(min(sums)),
            "rollout_is_ratio_fraction_high": mean([float(x > math.log(upper)) for x in sums]),
            "rollout_is_ratio_fraction_low": mean([float(x < math.log(bottom)) for x in sums]),
        }
    got = rollout_is_metrics(old, rollout, mask, threshold, level)
    assert set(got) == {f"rollout_corr/{k}" for k in want}
    for k, v in want.items():
        assert got[f"rollout_corr/{k}"].item() == pytest.approx(v, rel=1e-7, abs=1e-12), k
    assert 0 < want["rollout_is_ratio_fraction_high"] < 1 or 0 < want["rollout_is_ratio_fraction_low"] < 1
    # verl's rollout_is_batch_norm_factor: the mean weight, over tokens or over sequences
    normalized = rollout_is_metrics(old, rollout, mask, threshold, level, batch_normalize=True)
    factor = m if level == "token" else mean(seq)
    assert set(normalized) - set(got) == {"rollout_corr/rollout_is_batch_norm_factor"}
    assert normalized["rollout_corr/rollout_is_batch_norm_factor"].item() == pytest.approx(factor, rel=1e-7)
