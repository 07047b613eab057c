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
