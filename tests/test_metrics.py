import math

import pytest
import torch
from _inputs import batches, make_mask
from hypothesis import given

from refppo.metrics import masked_corr, masked_max_min


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
    with pytest.raises(ValueError, match="shape mismatch"):
        masked_corr(x, x, torch.ones(2, 4))
