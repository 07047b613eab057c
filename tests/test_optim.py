import math

import pytest
import torch

from refppo.config import Config, apply_overrides
from refppo.optim import adamw, make_optimizer


def test_lr_schedule_matches_the_formula():
    config = apply_overrides(Config(), ["actor.optim.lr=1.0", "actor.optim.lr_warmup_steps=4", "actor.optim.lr_scheduler=cosine"])
    opt, sched = make_optimizer([torch.nn.Parameter(torch.zeros(1))], config.actor.optim, total_steps=14)
    lrs = []
    for _ in range(14):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [(s + 1) / 4 for s in range(4)] + [0.5 * (1 + math.cos(math.pi * (s - 4) / 10)) for s in range(4, 14)]
    assert lrs == pytest.approx(expected)


def test_adamw_is_fused_and_matches_adamw_in_float64():
    """The fused step is AdamW's update: 30 steps with weight decay against a plain float64
    AdamW written out here, on random gradients."""
    g = torch.Generator().manual_seed(0)
    start = torch.randn(7, 5, generator=g)
    grads = [torch.randn(7, 5, generator=g) for _ in range(30)]
    lr, (b1, b2), wd, eps = 1e-2, (0.8, 0.95), 0.1, 1e-8
    p = torch.nn.Parameter(start.clone())
    opt = adamw([p], lr=lr, betas=(b1, b2), weight_decay=wd)
    assert opt.defaults["fused"], "a float32 CPU parameter should get the fused kernel"
    x, m, v = start.double(), torch.zeros(7, 5, dtype=torch.float64), torch.zeros(7, 5, dtype=torch.float64)
    for t, grad in enumerate(grads, start=1):
        p.grad = grad.clone()
        opt.step()
        x = x * (1 - lr * wd)
        m = b1 * m + (1 - b1) * grad.double()
        v = b2 * v + (1 - b2) * grad.double() ** 2
        x = x - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
    torch.testing.assert_close(p.detach().double(), x, rtol=1e-5, atol=1e-6)


def test_adamw_falls_back_to_the_loop_where_no_fused_kernel_exists():
    opt = adamw([torch.nn.Parameter(torch.zeros(2, device="meta"))], lr=1e-3)
    assert not opt.defaults["fused"]
