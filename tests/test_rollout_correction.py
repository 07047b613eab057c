import math

import pytest
import torch

from refppo.rollout_correction import compute_rollout_is_weights


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
    with pytest.raises(ValueError, match=r"threshold must be in \(0, inf\]"):
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
        if level == "token":
            valid = [w for row, mr in zip(rows, mask.tolist()) for w, k in zip(row, mr) if k]
        else:
            valid = [sum(w * k for w, k in zip(row, mr)) / sum(mr) for row, mr in zip(rows, mask.tolist()) if sum(mr)]
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
