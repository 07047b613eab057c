import math

import pytest
import torch

from refppo.settings.config import Config, apply_overrides
from refppo.settings.validate import validate
from refppo.training.optim import make_optimizer


def verl_lr_factors(total, warmup=-1, ratio=0.0, cosine=False, min_lr_ratio=0.0):
    """verl's get_constant_schedule_with_warmup / get_cosine_schedule_with_warmup (num_cycles 0.5)
    and its warm-up rule (``FSDPEngine._build_lr_scheduler`` in
    ``verl/workers/engine/fsdp/transformer_impl.py``: a warm-up of <= 0 steps takes the ratio),
    step by step."""
    if warmup <= 0:
        warmup = int(ratio * total)
    factors = []
    for step in range(total):
        if step < warmup:
            factors.append(float(step) / float(max(1, warmup)))
        elif not cosine:
            factors.append(1.0)
        else:
            progress = float(step - warmup) / float(max(1, total - warmup))
            x = math.cos(math.pi * 0.5 * 2.0 * progress)
            coef, intercept = (1 - min_lr_ratio) * 0.5, (1 + min_lr_ratio) * 0.5
            factors.append(max(min_lr_ratio, x * coef + intercept))
    return factors


@pytest.mark.parametrize(
    "overrides, verl",
    [
        ([], {}),
        (["lr_warmup_steps=4"], {"warmup": 4}),
        (["lr_warmup_steps=4", "lr_scheduler_type=cosine"], {"warmup": 4, "cosine": True}),
        (["lr_scheduler_type=cosine", "min_lr_ratio=0.1"], {"cosine": True, "min_lr_ratio": 0.1}),
        (
            ["lr_warmup_steps_ratio=0.3", "lr_scheduler_type=cosine", "min_lr_ratio=0.25"],
            {"ratio": 0.3, "cosine": True, "min_lr_ratio": 0.25},
        ),
        (["lr_warmup_steps_ratio=0.25"], {"ratio": 0.25}),  # int(0.25 x 14) = 3 steps, rounded down
        (["lr_warmup_steps=0", "lr_warmup_steps_ratio=0.25"], {"warmup": 0, "ratio": 0.25}),  # 0 takes the ratio
        (["lr_warmup_steps=-5", "lr_warmup_steps_ratio=0.5"], {"warmup": -5, "ratio": 0.5}),
        (["lr_warmup_steps=0"], {"warmup": 0}),
        (["lr_warmup_steps=20", "lr_scheduler_type=cosine"], {"warmup": 20, "cosine": True}),  # longer than the run
    ],
)
def test_lr_schedule_equals_verls(overrides, verl):
    total, lr = 14, 0.5
    config = validate(apply_overrides(Config(), [f"actor.optim.lr={lr}", *(f"actor.optim.{o}" for o in overrides)]))
    opt, sched = make_optimizer([torch.nn.Parameter(torch.zeros(1))], config.actor.optim, total_steps=total)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([lr * f for f in verl_lr_factors(total, **verl)], rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["actor.optim.lr_warmup_steps=3", "actor.optim.lr_warmup_steps_ratio=0.1"],
            r"actor.optim.lr_warmup_steps_ratio is read only with actor.optim.lr_warmup_steps=-1 \(or any <= 0\)",
        ),
        (
            ["critic.optim.min_lr_ratio=0.1"],
            "critic.optim.min_lr_ratio is read only with critic.optim.lr_scheduler_type=cosine",
        ),
        (
            ["actor.optim.lr_scheduler_type=linear"],
            "actor.optim.lr_scheduler_type='linear' is not one of constant, cosine",
        ),
        (
            ["actor.optim.lr_warmup_steps=2.5"],
            r"actor.optim.lr_warmup_steps='2.5': expected int",
        ),
        (
            ["critic.optim.lr_warmup_steps_ratio=1.5"],
            r"critic.optim.lr_warmup_steps_ratio=1.5 is outside its valid range \[0, 1\]",
        ),
        (
            ["actor.optim.lr_scheduler_type=cosine", "actor.optim.min_lr_ratio=-0.1"],
            r"actor.optim.min_lr_ratio=-0.1 is outside",
        ),
    ],
)
def test_bad_schedules_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(apply_overrides(Config(), overrides))


def test_the_old_scheduler_key_points_to_verls_name():
    with pytest.raises(
        ValueError, match="unknown config key 'actor.optim.lr_scheduler'; did you mean actor.optim.lr_scheduler_type"
    ):
        apply_overrides(Config(), ["actor.optim.lr_scheduler=cosine"])


def test_a_run_ended_by_its_epochs_keeps_the_schedule_of_total_training_steps():
    """verl (``RayPPOTrainer._create_dataloader``; the V1 trainer's ``_init_dataloader`` alike) sets
    ``optim.total_training_steps`` to ``trainer.total_training_steps`` when that is set, and ends the
    run when ``trainer.total_epochs`` passes over the prompts are done: a run cut short by its
    epochs keeps the long schedule. 100 prompts in batches of 16 give 6 steps an epoch."""
    from _trainers import make_trainer

    from refppo.training.fit import fit

    lr = 3e-3
    trainer = make_trainer(
        [
            "algorithm.adv_estimator=grpo",
            "rollout.n=2",
            "trainer.total_training_steps=20",
            "trainer.total_epochs=1",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "actor.optim.lr_scheduler_type=cosine",
            "actor.optim.lr_warmup_steps_ratio=0.1",
        ]
    )
    history = fit(trainer, progress_bar=False)
    assert [row["step"] for row in history] == [1, 2, 3, 4, 5, 6]
    after_each_step = [lr * f for f in verl_lr_factors(20, ratio=0.1, cosine=True)[1:7]]  # actor/lr: after s steps
    assert [row["actor/lr"] for row in history] == pytest.approx(after_each_step, rel=1e-6)  # float32 metrics


@pytest.mark.parametrize("steps, epochs", [(20, 1), (4, 1), (None, 2), (20, None), (None, 3)])
def test_run_and_schedule_lengths_are_verls(steps, epochs):
    """verl's ``RayPPOTrainer._create_dataloader``: the schedule spans ``total_training_steps`` when
    set, else ``len(dataloader) * total_epochs``; ``fit`` stops at whichever ends first. 100 prompts
    in batches of 16: 6 steps an epoch (the last partial batch dropped). refppo's null epochs bound
    nothing."""
    from refppo.training.data import schedule_steps, total_steps

    overrides = ["data.train_batch_size=16", "trainer.critic_warmup=0"]
    overrides.append(f"trainer.total_training_steps={'null' if steps is None else steps}")
    if epochs is not None:
        overrides.append(f"trainer.total_epochs={epochs}")
    config = validate(apply_overrides(Config(), overrides))
    loader = 100 // 16
    verl_schedule = steps if steps is not None else loader * epochs
    verl_run = verl_schedule if epochs is None else min(verl_schedule, loader * epochs)
    assert (total_steps(config, 100), schedule_steps(config, 100)) == (verl_run, verl_schedule)


def _adamw_float64(params, grads, lr, betas, eps, decays, steps):
    """AdamW written out (decoupled decay first, then Adam's bias-corrected step), each parameter
    with its own decay, over ``steps`` steps of the same gradients: the parameters after."""
    out = []
    for p, g, wd in zip(params, grads, decays):
        p = p.clone()
        m = torch.zeros_like(p)
        v = torch.zeros_like(p)
        for t in range(1, steps + 1):
            p = p * (1 - lr * wd)
            m = betas[0] * m + (1 - betas[0]) * g
            v = betas[1] * v + (1 - betas[1]) * g * g
            m_hat = m / (1 - betas[0] ** t)
            v_hat = v / (1 - betas[1] ** t)
            p = p - lr * m_hat / (v_hat.sqrt() + eps)
        out.append(p)
    return out


@pytest.mark.parametrize("decay_1d", [True, False])
def test_megatrons_optimizer_spares_1d_parameters_the_weight_decay(decay_1d):
    """verl's Megatron engine builds Megatron-Core's optimizer without a ``no_weight_decay_cond``
    (``get_megatron_optimizer`` in ``verl/utils/megatron/optimizer.py``), whose default parameter
    groups (``_get_param_groups`` in ``megatron/core/optimizer/__init__.py``) take no decay on a
    name ending in ``.bias`` or a 1-D parameter; verl's FSDP engine decays every parameter."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).double()
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    grads = [torch.randn_like(p) for p in params]
    lr, wd = 0.1, 0.3
    optim = validate(apply_overrides(Config(), [f"actor.optim.weight_decay={wd}"])).actor.optim
    optim.lr = lr
    optim.decay_1d_params = decay_1d
    optimizer, _ = make_optimizer(params, optim, total_steps=3)
    for _ in range(3):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
    decays = [wd if decay_1d or p.dim() != 1 else 0.0 for p in params]
    expected = _adamw_float64(start, grads, lr, optim.betas, 1e-8, decays, steps=3)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-12, atol=1e-12)
    assert [p.dim() for p in params] == [2, 2, 1, 1, 1], "an embedding, a weight, a bias, a norm's weight and bias"
