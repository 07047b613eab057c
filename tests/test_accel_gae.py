import pytest
import torch
from _inputs import batches, make_mask
from hypothesis import given
from hypothesis import strategies as st

from refppo.accel.gae import discounted_reverse_cumsum, packed_gae_advantage_return
from refppo.advantages import compute_gae_advantage_return


@given(st.integers(1, 70), st.sampled_from([0.0, 0.3, 0.9405, 1.0]), st.integers(0, 2**31 - 1))
def test_discounted_reverse_cumsum_matches_loop(length, discount, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, length, generator=gen, dtype=torch.float64)
    y = discounted_reverse_cumsum(x, discount)
    for i in range(3):
        acc = 0.0
        for t in reversed(range(length)):
            acc = x[i, t].item() + discount * acc
            assert y[i, t].item() == pytest.approx(acc, abs=1e-10)


@given(batches(max_len=40), st.sampled_from([0.0, 0.5, 0.95, 1.0]), st.sampled_from([0.0, 0.3, 0.95, 1.0]))
def test_packed_gae_equals_the_loop(b, gamma, lam):
    """Every mask shape (holes inside responses included, which both skip as verl does): the same
    advantages and returns as the plain reverse loop, in float64 to 1e-10."""
    gen, batch, length, kind = b
    mask = make_mask(kind, batch, length, gen)
    if mask.sum() < 2:
        mask[0, :] = 1.0
        if mask.sum() < 2:
            return
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    for plain, packed in zip(
        compute_gae_advantage_return(rewards, values, mask, gamma, lam),
        packed_gae_advantage_return(rewards, values, mask, gamma, lam),
    ):
        torch.testing.assert_close(packed, plain, atol=1e-10, rtol=1e-10)


def test_packed_gae_float32_long_sequence():
    gen = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(8, 1024, generator=gen), torch.randn(8, 1024, generator=gen)
    mask = make_mask("holes", 8, 1024, gen).float()
    for plain, packed in zip(
        compute_gae_advantage_return(rewards, values, mask, 1.0, 0.95),
        packed_gae_advantage_return(rewards, values, mask, 1.0, 0.95),
    ):
        torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)


def test_packed_gae_refuses_what_the_loop_refuses():
    r, v = torch.zeros(2, 3), torch.zeros(2, 3)
    for bad, message in [
        ((r, v, torch.full((2, 3), 0.5), 1.0, 0.95), "only 0 and 1"),
        ((r, v, torch.ones(2, 3), 1.5, 0.95), "gamma"),
    ]:
        for fn in (compute_gae_advantage_return, packed_gae_advantage_return):
            with pytest.raises(ValueError, match=message):
                fn(*bad)
