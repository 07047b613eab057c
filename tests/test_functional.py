import math

import pytest
import torch
from _inputs import batches, make_mask
from hypothesis import given

from refppo.functional import (
    logprobs_from_hidden,
    logprobs_from_logits,
    masked_corr,
    masked_max_min,
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


@pytest.mark.parametrize("chunk_size", [1, 3, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_match_plain_loops(chunk_size, temperature):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen) * 3
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    logp, ent = logprobs_from_logits(logits, labels, temperature, chunk_size, calculate_entropy=True)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == (3, 5)
    for i in range(3):
        for t in range(5):
            ls = ref_log_softmax(logits[i, t].tolist(), temperature)
            assert logp[i, t].item() == pytest.approx(ls[int(labels[i, t])], abs=1e-5)
            assert ent[i, t].item() == pytest.approx(-sum(math.exp(x) * x for x in ls), abs=1e-5)
    assert torch.equal(logprobs_from_logits(logits, labels, temperature, chunk_size), logp)


@pytest.mark.parametrize("chunk_size", [1, 4, None])
def test_gradients_match_float64_autograd(chunk_size):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 7, 13, generator=gen) * 2).requires_grad_()
    labels = torch.randint(0, 13, (2, 7), generator=gen)
    w1, w2 = torch.randn(2, 7, generator=gen), torch.randn(2, 7, generator=gen)
    logp, ent = logprobs_from_logits(logits, labels, 0.8, chunk_size, calculate_entropy=True)
    ((logp * w1).sum() + (ent * w2).sum()).backward()

    x = logits.detach().double().requires_grad_()
    ls = torch.log_softmax(x / 0.8, dim=-1)
    ref_logp = ls.gather(-1, labels[..., None]).squeeze(-1)
    ref_ent = -(ls.exp() * ls).sum(-1)
    ((ref_logp * w1.double()).sum() + (ref_ent * w2.double()).sum()).backward()
    torch.testing.assert_close(logits.grad.double(), x.grad, atol=1e-5, rtol=1e-5)

    # Each output alone: the other output's gradient is zero (or, without entropy, absent).
    z1 = logits.detach().clone().requires_grad_()
    logprobs_from_logits(z1, labels).sum().backward()
    z2 = logits.detach().clone().requires_grad_()
    logprobs_from_logits(z2, labels, calculate_entropy=True)[1].sum().backward()
    y = logits.detach().double().requires_grad_()
    ly = torch.log_softmax(y, dim=-1)
    g_logp = torch.autograd.grad(ly.gather(-1, labels[..., None]).sum(), y, retain_graph=True)[0]
    g_ent = torch.autograd.grad(-(ly.exp() * ly).sum(), y)[0]
    torch.testing.assert_close(z1.grad.double(), g_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(z2.grad.double(), g_ent, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_an_unused_output_costs_no_backward_work(monkeypatch, fused):
    """Entropy computed (for a log) but not in the loss: its gradient is never formed (the
    backward gets None, not zeros) and the log-probs' gradient is bit for bit the one without
    entropy; the other way round, the entropy's gradient alone matches float64 autograd."""
    import refppo.functional as F

    seen = []
    plain = F._chunked_grads

    def spy(scaled, labels, grad_logp, grad_ent, *args):
        seen.append((grad_logp is None, grad_ent is None))
        return plain(scaled, labels, grad_logp, grad_ent, *args)

    monkeypatch.setattr(F, "_chunked_grads", spy)
    gen = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(2, 7, 6, generator=gen), torch.randn(13, 6, generator=gen)
    labels = torch.randint(0, 13, (2, 7), generator=gen)

    def grads(entropy: bool, use: int):
        x = (hidden if fused else hidden @ weight.T).detach().clone().requires_grad_()
        out = logprobs_from_hidden(x, weight, labels, 0.8, 3, entropy) if fused else logprobs_from_logits(x, labels, 0.8, 3, entropy)
        (out[use] if entropy else out).sum().backward()
        return x.grad

    without = grads(False, 0)
    with_unused_entropy = grads(True, 0)
    assert seen == [(False, True), (False, True)]
    assert torch.equal(with_unused_entropy, without)
    entropy_only = grads(True, 1)
    assert seen[-1] == (True, False)
    h = (hidden if fused else hidden @ weight.T).double().requires_grad_()
    ls = torch.log_softmax((h @ weight.double().T if fused else h) / 0.8, dim=-1)
    (ref,) = torch.autograd.grad(-(ls.exp() * ls).sum(), h)
    torch.testing.assert_close(entropy_only.double(), ref, atol=1e-5, rtol=1e-5)


def test_bf16_logits_give_float32_outputs_and_bf16_grads():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 9, generator=gen).bfloat16().requires_grad_()
    labels = torch.randint(0, 9, (4,), generator=gen)
    logp = logprobs_from_logits(logits, labels)
    assert logp.dtype == torch.float32
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref = torch.log_softmax(logits.detach().double(), -1).gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(logp.double(), ref, atol=1e-5, rtol=0)


def test_bad_logits_inputs():
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_from_logits(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="vocab"):
        logprobs_from_logits(torch.randn(5), torch.zeros((), dtype=torch.long))


@pytest.mark.parametrize("chunk_size", [1, 4, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_from_hidden_match_float64_autograd(chunk_size, temperature):
    """The LM head fused into the log-softmax: values and gradients (to the hidden states and to
    the head's weight) of a plain float64 log_softmax(hidden @ weight.T / temperature)."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 7, 6, generator=gen).requires_grad_()
    weight = torch.randn(13, 6, generator=gen).requires_grad_()
    labels = torch.randint(0, 13, (2, 7), generator=gen)
    w1, w2 = torch.randn(2, 7, generator=gen), torch.randn(2, 7, generator=gen)
    logp, ent = logprobs_from_hidden(hidden, weight, labels, temperature, chunk_size, calculate_entropy=True)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == (2, 7)
    ((logp * w1).sum() + (ent * w2).sum()).backward()

    h, w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ls = torch.log_softmax(h @ w.T / temperature, dim=-1)
    ref_logp, ref_ent = ls.gather(-1, labels[..., None]).squeeze(-1), -(ls.exp() * ls).sum(-1)
    g_h, g_w = torch.autograd.grad(ref_logp.sum(), (h, w), retain_graph=True)
    ((ref_logp * w1.double()).sum() + (ref_ent * w2.double()).sum()).backward()
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden.grad.double(), h.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w.grad, atol=1e-5, rtol=1e-5)
    # Without entropy: the same log-probs, and the log-probs' gradient alone.
    h2, w2_ = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logprobs_from_hidden(h2, w2_, labels, temperature, chunk_size).sum().backward()
    torch.testing.assert_close(h2.grad.double(), g_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w2_.grad.double(), g_w, atol=1e-5, rtol=1e-5)


def test_logprobs_from_hidden_frozen_head_and_bf16():
    """A frozen head (a LoRA actor's) gets no gradient and the hidden states still get theirs;
    bf16 inputs give float32 log-probs equal to those of the bf16 logits, bf16 gradients."""
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(5, 8, generator=gen).requires_grad_()
    weight = torch.randn(9, 8, generator=gen)
    labels = torch.randint(0, 9, (5,), generator=gen)
    logprobs_from_hidden(hidden, weight, labels, chunk_size=2).sum().backward()
    h = hidden.detach().double().requires_grad_()
    torch.log_softmax(h @ weight.double().T, -1).gather(-1, labels[:, None]).sum().backward()
    torch.testing.assert_close(hidden.grad.double(), h.grad, atol=1e-5, rtol=1e-5)

    hb, wb = hidden.detach().bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    logp = logprobs_from_hidden(hb, wb, labels, chunk_size=2)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, logprobs_from_logits(hb.detach() @ wb.detach().T, labels), atol=0, rtol=0)
    logp.sum().backward()
    assert hb.grad.dtype == wb.grad.dtype == torch.bfloat16
    h, w = hb.detach().double().requires_grad_(), wb.detach().double().requires_grad_()
    torch.log_softmax(h @ w.T, -1).gather(-1, labels[:, None]).sum().backward()
    torch.testing.assert_close(hb.grad.double(), h.grad, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(wb.grad.double(), w.grad, atol=2e-2, rtol=2e-2)


def test_logprobs_from_hidden_under_autocast_use_its_dtype():
    """Under autocast (bf16 on CUDA; checked here with the CPU's) the head's products run in the
    autocast dtype, as the LM head's own would: the log-probs equal those of the autocast logits,
    the gradients keep the inputs' float32."""
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(6, 8, generator=gen).requires_grad_()
    weight = torch.randn(11, 8, generator=gen).requires_grad_()
    labels = torch.randint(0, 11, (6,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = logprobs_from_hidden(hidden, weight, labels, chunk_size=4)
        logits = hidden @ weight.T
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(fused, logprobs_from_logits(logits.detach(), labels), atol=0, rtol=0)
    assert (fused - logprobs_from_hidden(hidden, weight, labels)).abs().max() > 1e-4, "float32 would differ"
    fused.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32


def test_logprobs_from_hidden_hold_no_whole_logits():
    """Peak memory of forward + backward: the fused version never holds (rows, vocab) logits,
    the LM head followed by the chunked log-softmax does (and their gradient)."""
    from refppo.memory import PeakMeter

    gen = torch.Generator().manual_seed(5)
    rows, width, vocab = 2048, 16, 4096
    hidden = torch.randn(rows, width, generator=gen).requires_grad_()
    weight = torch.randn(vocab, width, generator=gen).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    logits_bytes = rows * vocab * 4
    peaks = {}
    for name, fn in {
        "head then log-softmax": lambda: logprobs_from_logits(hidden @ weight.T, labels, chunk_size=32),
        "fused": lambda: logprobs_from_hidden(hidden, weight, labels, chunk_size=32),
    }.items():
        hidden.grad = weight.grad = None
        with PeakMeter() as meter:
            fn().sum().backward()
        peaks[name] = meter.peak
    assert peaks["head then log-softmax"] >= 2 * logits_bytes  # the logits and their gradient
    assert peaks["fused"] < logits_bytes / 8, peaks


def test_compiled_blocks_match_float64_and_replace_the_eager_ones(compiled_kernel_calls):
    """compiled=True (torch.compile's fused kernels, as actor.use_torch_compile runs them): the
    log-probs, entropies and both gradients of a plain float64 log-softmax, over blocks with a
    remainder, for float32 and bf16 logits and through the fused head; every block goes through
    the compiled functions, and with compiled=False none does."""
    calls = compiled_kernel_calls
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(3, 5, 11, generator=gen) * 3).requires_grad_()
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    w1, w2 = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    logp, ent = logprobs_from_logits(logits, labels, 0.7, 4, calculate_entropy=True, compiled=True)
    ((logp * w1).sum() + (ent * w2).sum()).backward()
    assert calls == ["forward"] * 4 + ["backward"] * 4, calls  # 15 rows in blocks of 4
    x = logits.detach().double().requires_grad_()
    ls = torch.log_softmax(x / 0.7, dim=-1)
    ref_logp, ref_ent = ls.gather(-1, labels[..., None]).squeeze(-1), -(ls.exp() * ls).sum(-1)
    ((ref_logp * w1.double()).sum() + (ref_ent * w2.double()).sum()).backward()
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits.grad.double(), x.grad, atol=1e-5, rtol=1e-5)

    calls.clear()
    eager = logprobs_from_logits(logits.detach(), labels, 0.7, 4, calculate_entropy=True)
    assert calls == []
    torch.testing.assert_close(eager, (logp.detach(), ent.detach()), atol=1e-5, rtol=1e-5)

    # bf16 logits: float32 log-probs of the bf16 values, a bf16 gradient
    xb = logits.detach().bfloat16().requires_grad_()
    logp_b = logprobs_from_logits(xb, labels, compiled=True)
    logp_b.sum().backward()
    assert logp_b.dtype == torch.float32 and xb.grad.dtype == torch.bfloat16
    y = xb.detach().double().requires_grad_()
    ref_b = torch.log_softmax(y, -1).gather(-1, labels[..., None]).squeeze(-1)
    ref_b.sum().backward()
    torch.testing.assert_close(logp_b.double(), ref_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(xb.grad.double(), y.grad, atol=1e-2, rtol=1e-2)

    # through the fused head: the gradients of the hidden states and of the head's weight
    calls.clear()
    hidden = torch.randn(3, 5, 6, generator=gen).requires_grad_()
    weight = torch.randn(11, 6, generator=gen).requires_grad_()
    logp, ent = logprobs_from_hidden(hidden, weight, labels, 0.7, 4, calculate_entropy=True, compiled=True)
    ((logp * w1).sum() + (ent * w2).sum()).backward()
    assert calls == ["forward"] * 4 + ["backward"] * 4, calls
    h, w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ls = torch.log_softmax(h @ w.T / 0.7, dim=-1)
    ((ls.gather(-1, labels[..., None]).squeeze(-1) * w1.double()).sum() + (-(ls.exp() * ls).sum(-1) * w2.double()).sum()).backward()
    torch.testing.assert_close(hidden.grad.double(), h.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_compiled_blocks_on_cuda_match_float64():
    """compiled=True on CUDA (Triton kernels) with bf16 logits of a real vocabulary's width: the
    float32 log-probs and entropies of float64, and a bf16 gradient within bf16 rounding."""
    gen = torch.Generator().manual_seed(8)
    logits = (torch.randn(1000, 32000, generator=gen) * 2).bfloat16().cuda().requires_grad_()
    labels = torch.randint(0, 32000, (1000,), generator=gen).cuda()
    w = torch.randn(1000, generator=gen).cuda()
    logp, ent = logprobs_from_logits(logits, labels, 0.7, calculate_entropy=True, compiled=True)
    ((logp * w).sum() + ent.sum()).backward()
    x = logits.detach().double().requires_grad_()
    ls = torch.log_softmax(x / 0.7, dim=-1)
    ref_logp, ref_ent = ls.gather(-1, labels[:, None]).squeeze(-1), -(ls.exp() * ls).sum(-1)
    ((ref_logp * w.double()).sum() + ref_ent.sum()).backward()
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-4, rtol=1e-4)
    assert logits.grad.dtype == torch.bfloat16
    assert float((logits.grad.double() - x.grad).norm() / x.grad.norm()) < 1e-2


def test_bad_hidden_inputs():
    h, w, y = torch.randn(2, 3, 4), torch.randn(7, 4), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="weight"):
        logprobs_from_hidden(h, torch.randn(7, 5), y)
    with pytest.raises(ValueError, match="labels"):
        logprobs_from_hidden(h, w, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_hidden(h, w, y, temperature=-1.0)
