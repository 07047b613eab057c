import math

import pytest
import torch

from refppo.algorithms.rollout_correction import compute_rollout_is_weights


@pytest.mark.parametrize("threshold", [2.0, 0.5, math.inf])
def test_rollout_is_weights_equal_verls_truncated_ratios(threshold):
    """min(exp(clamp(old - rollout, -20, 20)), C) on valid tokens, 0 on padding; log-ratios far
    beyond +-20 (a sampler that found a token the trainer calls impossible, or the reverse) give
    exp(+-20), never inf or 0, in float32 as in float64."""
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    rollout = old + torch.randn(3, 6, generator=gen, dtype=torch.float64)
    rollout[0, :3] = old[0, :3] - torch.tensor([25.0, 100.0, 20.0], dtype=torch.float64)  # log-ratio +25, +100, +20
    rollout[1, :2] = old[1, :2] + torch.tensor([30.0, 120.0], dtype=torch.float64)  # -30, -120
    mask = (torch.arange(6)[None, :] < torch.tensor([[6], [4], [1]])).double()  # right-padded
    expected = [
        [min(math.exp(max(-20.0, min(20.0, o - r))), threshold) if m else 0.0 for o, r, m in zip(ro, rr, rm)]
        for ro, rr, rm in zip(old.tolist(), rollout.tolist(), mask.tolist())
    ]
    for dtype in (torch.float64, torch.float32):
        w = compute_rollout_is_weights(old.to(dtype), rollout.to(dtype), mask.to(dtype), threshold)
        assert w.dtype == dtype and bool(torch.isfinite(w).all())
        torch.testing.assert_close(w.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match=r"threshold=0.0: bounds must be positive"):
        compute_rollout_is_weights(old, rollout, mask, 0.0)


def _plain_weights(old, rollout, mask, threshold, level, normalize):
    """verl 0.9's compute_rollout_correction_weights, row by row in float64 Python."""
    rows = []
    for o, r, m in zip(old.tolist(), rollout.tolist(), mask.tolist()):
        if level == "token":
            raw = [math.exp(max(-20.0, min(20.0, a - b))) for a, b in zip(o, r)]
        else:
            total = sum((a - b) * k for a, b, k in zip(o, r, m))
            raw = [math.exp(max(-20.0, min(20.0, total)))] * len(o)
        rows.append([min(w * k, threshold) for w, k in zip(raw, m)])
    if normalize:
        if level == "token":  # verl's masked means divide by the count plus 1e-8
            valid = [w for row, mr in zip(rows, mask.tolist()) for w, k in zip(row, mr) if k]
            mean = sum(valid) / (len(valid) + 1e-8)
        else:
            per_row = [sum(w * k for w, k in zip(row, mr)) / (sum(mr) + 1e-8) for row, mr in zip(rows, mask.tolist())]
            valid = [w for w, mr in zip(per_row, mask.tolist()) if sum(mr)]
            mean = sum(valid) / len(valid)
        if mean > 1e-8:
            rows = [[w / mean for w in row] for row in rows]
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("threshold", [2.0, 1.1, math.inf])
def test_rollout_is_weights_per_token_or_sequence_equal_verls(level, normalize, threshold):
    """Both levels, with and without the batch normalisation, equal the plain float64 formula on
    random right-padded rows, one of them empty; a sequence's weight is one number on all its
    tokens, the product of its token ratios before truncation."""
    gen = torch.Generator().manual_seed(11)
    old = torch.randn(4, 5, generator=gen, dtype=torch.float64) * 0.3
    rollout = old + torch.randn(4, 5, generator=gen, dtype=torch.float64) * 0.2
    mask = (torch.arange(5)[None, :] < torch.tensor([[5], [3], [0], [1]])).double()
    w = compute_rollout_is_weights(old, rollout, mask, threshold, level, normalize)
    torch.testing.assert_close(w, _plain_weights(old, rollout, mask, threshold, level, normalize), rtol=1e-12, atol=0)
    assert not w.requires_grad and bool((w[2] == 0).all())
    if level == "sequence":
        for row, n in ((0, 5), (1, 3)):
            assert len(set(w[row, :n].tolist())) == 1
        if not normalize and threshold == math.inf:
            ratio = torch.exp(((old - rollout) * mask)[1].sum())
            torch.testing.assert_close(w[1, 0], ratio)
    if normalize:
        if level == "token":
            mean = (w * mask).sum() / mask.sum()
        else:
            mean = w[[0, 1, 3], 0].mean()
        torch.testing.assert_close(mean, torch.tensor(1.0, dtype=torch.float64))


def test_rollout_is_weights_refuse_an_unknown_level():
    old = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="rollout_is level 'tokens'"):
        compute_rollout_is_weights(old, old, torch.ones(1, 2), 2.0, "tokens")


def _plain_rs(old, rollout, mask, bounds):
    """verl 0.9's compute_rollout_rejection_mask, row by row in float64 Python: the kept-token mask
    and the token / row fractions it reports."""
    keep_rows, per_option, stats = [], {}, {}
    for name in bounds:
        per_option[name], stats[name] = [], ([], [])
    for o, r, m in zip(old.tolist(), rollout.tolist(), mask.tolist()):
        lr = [max(-20.0, min(20.0, a - b)) for a, b in zip(o, r)]
        est = {"k1": [-x for x in lr], "k2": [0.5 * x * x for x in lr], "k3": [math.exp(x) - 1 - x for x in lr]}
        keep = [True] * len(o)
        for name, (lower, upper) in bounds.items():
            level, k = name.rsplit("_", 1)
            valid = [e for e, v in zip(est[k], m) if v]
            if level == "token":
                row = est[k]
                one = sum(valid) / (len(valid) + 1e-8)  # the row's value in the statistics: its mean
            else:
                if level == "seq_sum":
                    one = sum(valid)
                elif level == "seq_mean":
                    one = sum(valid) / (len(valid) + 1e-8)
                else:
                    one = max(valid) if valid else 0.0
                row = [one] * len(o)
            stats[name][0].append(row)
            stats[name][1].append(one)
            ok = [(math.log(lower) <= x <= math.log(upper)) if k == "k1" else x <= upper for x in row]
            per_option[name].append(ok)
            keep = [a and b for a, b in zip(keep, ok)]
        keep_rows.append(keep)
    return keep_rows, per_option, stats


def _plain_rs_summary(token_stats, row_values, mask, sequence, lower, upper):
    """verl 0.9's compute_rs_metrics in plain Python: ``token_stats`` per row (a sequence
    criterion's value repeated), ``row_values`` each row's value; ``lower`` None for the criteria
    with an upper bound only (verl's apply_lower_threshold false, its lower bound 0)."""
    tokens = [x for row, m in zip(token_stats, mask) for x, k in zip(row, m) if k]
    rows = [v for v, m in zip(row_values, mask) if sum(m)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    out = {"mean": mean(tokens)}
    pool = rows if sequence else tokens
    out |= {"max": max(pool), "min": min(pool), "fraction_high": mean([float(x > upper) for x in pool])}
    out["fraction_low"] = 0.0 if lower is None else mean([float(x < lower) for x in pool])
    clamped = [min(max(x, 0.0 if lower is None else lower), upper) for x in tokens]
    out["std"] = math.sqrt(max(mean([x * x for x in clamped]) - mean(clamped) ** 2, 0.0)) if len(tokens) > 1 else 0.0
    m = mean(rows)
    out["seq_mean"], out["seq_max"], out["seq_min"] = m, max(rows), min(rows)
    out["seq_std"] = math.sqrt(sum((x - m) ** 2 for x in rows) / (len(rows) - 1)) if len(rows) > 1 else 0.0
    out["seq_max_deviation"] = max(abs(x) for x in rows)
    out["seq_fraction_high"] = mean([float(x > upper) for x in rows])
    if lower is not None:
        out["seq_fraction_low"] = mean([float(x < lower) for x in rows])
    return out


@pytest.mark.parametrize(
    "rollout_rs, threshold",
    [
        ("token_k1", "0.5_1.5"),
        ("token_k1", 1.5),  # one number u: the ratio bounds 1/u and u
        ("token_k2,token_k3", 0.3),
        ("seq_sum_k1,seq_sum_k2,seq_sum_k3", "0.2_3.0,0.8,0.5"),
        ("seq_mean_k1,seq_mean_k2,seq_mean_k3", "0.6_1.6,0.3,0.3"),
        ("seq_max_k2,seq_max_k3,token_k1", "0.4,0.4,0.3_3"),
    ],
)
def test_rollout_rejection_equals_verls(rollout_rs, threshold):
    from refppo.algorithms.rollout_correction import compute_rollout_rs_mask, rs_thresholds

    gen = torch.Generator().manual_seed(len(rollout_rs))
    old = torch.randn(6, 7, generator=gen, dtype=torch.float64) - 2
    rollout = old + 0.7 * torch.randn(6, 7, generator=gen, dtype=torch.float64)
    rollout[0, 0] = old[0, 0] - 50  # beyond the +-20 clamp
    mask = (torch.arange(7)[None, :] < torch.tensor([[7], [5], [3], [1], [0], [6]])).double()  # an empty row
    bounds = rs_thresholds(rollout_rs, threshold)
    keep, per_option, stats = _plain_rs(old, rollout, mask, bounds)
    got, metrics = compute_rollout_rs_mask(old, rollout, mask, rollout_rs, threshold)
    expected = mask * torch.tensor(keep, dtype=torch.float64)
    assert torch.equal(got, expected) and 0 < got.sum() < mask.sum(), "some tokens kept, some rejected"
    valid = mask.bool()
    rows = [bool(v.any()) for v in valid]
    for name, ok in per_option.items():
        ok = torch.tensor(ok)
        assert metrics[f"rollout_corr/rollout_rs_{name}_masked_fraction"] == pytest.approx(
            float((~ok & valid).sum() / valid.sum())
        )
        dropped = [bool((~o & v).any()) for o, v in zip(ok, valid)]
        assert metrics[f"rollout_corr/rollout_rs_{name}_seq_masked_fraction"] == pytest.approx(
            sum(d and r for d, r in zip(dropped, rows)) / sum(rows)
        )
        lower, upper = bounds[name]
        lower, upper = (math.log(lower), math.log(upper)) if name.endswith("k1") else (None, upper)
        want = _plain_rs_summary(*stats[name], mask.tolist(), not name.startswith("token"), lower, upper)
        got_stats = {k.rpartition(f"rs_{name}_")[2]: v.item() for k, v in metrics.items() if f"rs_{name}_" in k}
        del got_stats["masked_fraction"], got_stats["seq_masked_fraction"]
        assert got_stats == pytest.approx(want, rel=1e-6, abs=1e-12), name
    kept = torch.tensor(keep)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(
        float((~kept & valid).sum() / valid.sum())
    )
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(
        float((~kept & valid).any(-1).float().mean())
    )


@pytest.mark.parametrize(
    "rollout_rs, threshold, message",
    [
        ("token_k4", 2.0, "each option must be one of"),
        ("token_k1", None, "rollout_rs needs rollout_rs_threshold"),
        ("token_k1,token_k2", "2,3,4", "one threshold for all 2 rollout_rs options, or one each"),
        ("token_k2", "0.5_2", "takes one upper bound"),
        ("token_k1", "2_0.5", "lower <= upper"),
        ("token_k1", 0.5, "lower <= upper"),  # 1/0.5 = 2 > 0.5
        ("seq_mean_k3", "-1", "positive"),
        ("token_k1", "a_b", "is not a number"),
    ],
)
def test_rollout_rejection_thresholds_are_read_as_verl_reads_them(rollout_rs, threshold, message):
    from refppo.algorithms.rollout_correction import rs_thresholds

    with pytest.raises(ValueError, match=message):
        rs_thresholds(rollout_rs, threshold)


def test_rejected_tokens_leave_the_advantages_and_the_update_only():
    """As verl: the score and the KL in the reward see every sampled token, the advantages (and so
    the losses, which read the same mask) only the kept ones, and the logged lengths count every
    sampled token."""
    from _trainers import make_trainer

    rs = ["algorithm.rollout_correction.rollout_rs=token_k2", "algorithm.rollout_correction.rollout_rs_threshold=2e-7"]
    kl = ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.1"]
    plain, rejecting = make_trainer(kl), make_trainer([*kl, *rs])
    records = plain.sampler.next_batch()
    a, _ = plain.make_experience(records, {})
    batch = {k: v.clone() for k, v in a.items() if k not in ("advantages", "returns", "token_level_scores")}
    gen = torch.Generator().manual_seed(0)  # a sampler that disagrees a little, token by token
    batch["rollout_log_probs"] = batch["rollout_log_probs"] + 1e-3 * torch.randn(
        batch["rollout_log_probs"].shape, generator=gen
    )
    sampled = a["response_mask"].clone()
    scores = a["token_level_scores"].sum(-1)
    stats = rejecting.evaluate(batch, scores, {}, {})
    kept = batch["response_mask"]
    assert 0 < kept.sum() < sampled.sum() and bool((kept <= sampled).all())
    assert stats["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 - float(kept.sum() / sampled.sum()))
    torch.testing.assert_close(batch["token_level_scores"], a["token_level_scores"])  # on the sampled last token
    torch.testing.assert_close(batch["token_level_rewards"], a["token_level_rewards"])  # the KL on every token
    from refppo.advantages import compute_gae_advantage_return

    expected, _ = compute_gae_advantage_return(batch["token_level_rewards"], batch["values"], kept, 1.0, 1.0)
    torch.testing.assert_close(batch["advantages"], expected)  # GAE and its whitening over the kept tokens
    from refppo.training.metrics import data_metrics

    logged = data_metrics(batch, rejecting.config, True)
    assert float(logged["response_length/mean"]) == pytest.approx(float(sampled.sum(-1).float().mean()))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("normalize", [False, True])
def test_icepop_keeps_the_weights_inside_its_bounds_and_zeroes_the_rest(level, normalize):
    """verl's IcePop ("lower_upper"): the untruncated weight where lower <= w <= upper, else 0,
    then the same batch normalisation as TIS."""
    from refppo.algorithms.rollout_correction import is_bounds

    gen = torch.Generator().manual_seed(5)
    old = torch.randn(5, 6, generator=gen, dtype=torch.float64) * 0.3
    rollout = old + torch.randn(5, 6, generator=gen, dtype=torch.float64) * 0.3
    mask = (torch.arange(6)[None, :] < torch.tensor([[6], [4], [0], [2], [5]])).double()
    lower, upper = is_bounds("0.8_1.25")
    raw = _plain_weights(old, rollout, mask, math.inf, level, False)
    kept = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    if normalize:
        if level == "token":
            mean = (kept * mask).sum() / (mask.sum() + 1e-8)
        else:
            rows = mask.sum(-1) > 0
            mean = ((kept * mask).sum(-1) / (mask.sum(-1) + 1e-8))[rows].mean()
        kept = kept / mean
    got = compute_rollout_is_weights(old, rollout, mask, "0.8_1.25", level, normalize)
    torch.testing.assert_close(got, kept, rtol=1e-12, atol=0)
    assert bool(((raw < lower) | (raw > upper))[mask.bool()].any()) and bool((got[mask.bool()] > 0).any())


@pytest.mark.parametrize(
    "threshold, bounds",
    [(2.0, (None, 2.0)), ("2.0", (None, 2.0)), ("0.5_2", (0.5, 2.0)), (math.inf, (None, math.inf))],
)
def test_is_bounds_read_as_verl_reads_them(threshold, bounds):
    from refppo.algorithms.rollout_correction import is_bounds

    assert is_bounds(threshold) == bounds


@pytest.mark.parametrize("threshold", [0.0, -1.0, math.nan, "a", "2_0.5", "0_1", "0.5_inf", True, None])
def test_is_bounds_refuse_what_verl_refuses(threshold):
    from refppo.algorithms.rollout_correction import is_bounds

    with pytest.raises(ValueError, match="threshold"):
        is_bounds(threshold)


def test_an_icepop_text_is_never_read_as_a_number():
    """Python reads "0.5_2" as 0.52: the setting keeps the text, which verl reads as IcePop's bounds."""
    from refppo.settings.config import Config, apply_overrides
    from refppo.settings.validate import validate

    on = ["algorithm.rollout_correction.rollout_is=token"]
    config = validate(apply_overrides(Config(), [*on, "algorithm.rollout_correction.rollout_is_threshold=0.5_2"]))
    assert config.algorithm.rollout_correction.rollout_is_threshold == "0.5_2"
    with pytest.raises(ValueError, match="rollout_is_threshold='2_0.5': bounds must be positive, lower <= upper"):
        validate(apply_overrides(Config(), [*on, "algorithm.rollout_correction.rollout_is_threshold=2_0.5"]))
