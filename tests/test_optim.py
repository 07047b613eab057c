import math

import pytest
import torch

from refppo.config import Config, apply_overrides
from refppo.optim import make_optimizer


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
