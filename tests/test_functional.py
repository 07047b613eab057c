import math

import pytest
import torch
from _inputs import batches, make_mask
from hypothesis import given

from refppo.functional import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)


def ref_stats(values, mask):
    """verl's mean and unbiased variance over the valid entries, plain float64.

    verl divides by (count + 1e-8) in every masked mean, then applies n / (n - 1).
    """
    xs = [float(v) for v, m in zip(values.flatten(), mask.flatten()) if m == 1]
    n = len(xs)
    mean = sum(xs) / (n + 1e-8)
    var = sum((x - mean) ** 2 for x in xs) / (n + 1e-8) * n / (n - 1)
    return mean, var


@given(batches())
def test_masked_stats_match_plain_loops(b):
    gen, batch, length, kind = b
    mask = make_mask(kind, batch, length, gen)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    valid = [(float(v), float(m)) for v, m in zip(values.flatten(), mask.flatten())]
    total = sum(v for v, m in valid if m == 1)
    assert masked_sum(values, mask).item() == pytest.approx(total, abs=1e-12)
    n = sum(m for _, m in valid)
    assert masked_mean(values, mask).item() == pytest.approx(total / (n + 1e-8), abs=1e-12)
    for i in range(batch):
        row = [float(values[i, t]) for t in range(length) if mask[i, t] == 1]
        expect = sum(row) / (len(row) + 1e-8)
        assert masked_mean(values, mask, axis=-1)[i].item() == pytest.approx(expect, abs=1e-12)
    if n >= 2:
        mean, var = ref_stats(values, mask)
        assert masked_var(values, mask).item() == pytest.approx(var, rel=1e-10)
        assert masked_var(values, mask, unbiased=False).item() == pytest.approx(var * (n - 1) / n, rel=1e-10)
        w = masked_whiten(values, mask)
        for x, y in zip(values.flatten(), w.flatten()):
            assert y.item() == pytest.approx((float(x) - mean) / math.sqrt(var + 1e-8), abs=1e-9)
        w2 = masked_whiten(values, mask, shift_mean=False)
        for x, y in zip(values.flatten(), w2.flatten()):
            assert y.item() == pytest.approx((float(x) - mean) / math.sqrt(var + 1e-8) + mean, abs=1e-9)


def test_nan_in_padding_does_not_leak():
    values = torch.tensor([[1.0, 2.0, float("nan")]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert masked_sum(values, mask).item() == 3.0
    assert masked_mean(values, mask).item() == pytest.approx(1.5)
    assert masked_var(values, mask).item() == pytest.approx(0.5)


def test_whiten_refuses_bad_masks_and_values():
    values = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    for bad in (0.5, -1.0, 2.0):
        mask = torch.ones(2, 3)
        mask[0, 1] = bad
        with pytest.raises(ValueError, match="mask must contain only 0 and 1"):
            masked_whiten(values, mask)
    with_nan = values.clone()
    with_nan[1, 2] = float("nan")
    with pytest.raises(ValueError, match="values contains NaN or inf at a valid token"):
        masked_whiten(with_nan, torch.ones(2, 3))
    padding = torch.tensor([[1.0, 1, 1], [1, 1, 0]])  # NaN in padding is fine, and stays out
    assert torch.isfinite(masked_whiten(with_nan, padding)[padding.bool()]).all()
    with pytest.raises(ValueError, match="shape mismatch"):
        masked_whiten(values, torch.ones(2, 4))


def test_whiten_needs_two_valid_tokens():
    with pytest.raises(ValueError, match="fewer than 2 valid"):
        masked_whiten(torch.randn(2, 3), torch.tensor([[0, 0, 1.0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="fewer than 1 valid"):
        masked_var(torch.randn(1, 3), torch.zeros(1, 3), unbiased=False)
    with pytest.raises(ValueError, match="shape mismatch"):
        masked_var(torch.randn(2, 3), torch.ones(2, 4))


def ref_log_softmax(row, temperature):
    """Plain float64 log-softmax of one list of logits."""
    z = [x / temperature for x in row]
    mx = max(z)
    lse = mx + math.log(sum(math.exp(x - mx) for x in z))
    return [x - lse for x in z]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_match_plain_loops(temperature):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen) * 3
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    logp, ent = logprobs_from_logits(logits, labels, temperature), entropy_from_logits(logits, temperature)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == (3, 5)
    for i in range(3):
        for t in range(5):
            ls = ref_log_softmax(logits[i, t].tolist(), temperature)
            assert logp[i, t].item() == pytest.approx(ls[int(labels[i, t])], abs=1e-5)
            assert ent[i, t].item() == pytest.approx(-sum(math.exp(x) * x for x in ls), abs=1e-5)


def test_a_temperature_that_would_overflow_the_scaled_logits_is_refused():
    """logits / T in float32: 1e-300 rounds to 0 there (NaN log-probs); the floor, 1e-6, is greedy
    in all but name and finite."""
    logits, labels = torch.tensor([[30.0, -30.0, 0.0]]), torch.tensor([0])
    for t in (1e-300, 1e-40, 9e-7):
        with pytest.raises(ValueError, match=rf"temperature must be in \[1e-6, inf\), got {t}"):
            logprobs_from_logits(logits, labels, t)
        with pytest.raises(ValueError, match="temperature must be in"):
            entropy_from_logits(logits, t)
    assert logprobs_from_logits(logits, labels, 1e-6).item() == 0.0
    assert entropy_from_logits(logits, 1e-6).item() == 0.0


def test_gradients_match_float64_autograd():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 7, 13, generator=gen) * 2).requires_grad_()
    labels = torch.randint(0, 13, (2, 7), generator=gen)
    w1, w2 = torch.randn(2, 7, generator=gen), torch.randn(2, 7, generator=gen)
    logp, ent = logprobs_from_logits(logits, labels, 0.8), entropy_from_logits(logits, 0.8)
    ((logp * w1).sum() + (ent * w2).sum()).backward()
    x = logits.detach().double().requires_grad_()
    ls = torch.log_softmax(x / 0.8, dim=-1)
    ref_logp = ls.gather(-1, labels[..., None]).squeeze(-1)
    ref_ent = -(ls.exp() * ls).sum(-1)
    ((ref_logp * w1.double()).sum() + (ref_ent * w2.double()).sum()).backward()
    torch.testing.assert_close(logits.grad.double(), x.grad, atol=1e-5, rtol=1e-5)


def test_bf16_logits_give_float32_outputs_and_bf16_grads():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 9, generator=gen).bfloat16().requires_grad_()
    labels = torch.randint(0, 9, (4,), generator=gen)
    logp = logprobs_from_logits(logits, labels)
    assert logp.dtype == entropy_from_logits(logits).dtype == torch.float32
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref = torch.log_softmax(logits.detach().double(), -1).gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(logp.double(), ref, atol=1e-5, rtol=0)


def test_bad_logits_inputs():
    with pytest.raises(ValueError, match="labels must be integer token ids of shape"):
        logprobs_from_logits(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="vocab"):
        logprobs_from_logits(torch.randn(5), torch.zeros((), dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        entropy_from_logits(torch.randn(2, 5), temperature=-1.0)


def test_a_nan_is_a_non_finite_error_and_other_bad_values_a_plain_value_error():
    from refppo.guards.checks import NonFiniteError, check_values

    mask, x = torch.ones(2, 3), torch.zeros(2, 3)
    with pytest.raises(NonFiniteError, match="x contains NaN or inf"):
        check_values(masks={"mask": mask}, finite={"x": x.clone().fill_(float("nan"))})
    with pytest.raises(NonFiniteError, match="mask must contain only 0 and 1; x contains NaN or inf"):
        check_values(masks={"mask": mask * 2}, finite={"x": x.clone().fill_(float("inf"))})
    for bad in [dict(masks={"mask": mask * 2}, finite={"x": x}), dict(nonnegative={"x": x - 1})]:
        with pytest.raises(ValueError) as refused:
            check_values(**bad)
        assert type(refused.value) is ValueError
