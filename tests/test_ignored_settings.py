"""Settings that another setting turns off (refppo.settings.validate.ignored_settings) are really unread:
changing one, past validate, leaves a trainer's steps exactly as they were."""

import pytest
import torch
from _trainers import make_trainer

from refppo.settings.config import Config, declarations, owner_of
from refppo.settings.validate import choices_of, ignored_settings

# The trainer is given its models and data: these are read by refppo's commands, not by it.
NOT_THE_TRAINERS = ("data.", "model.", "reward_model.model.")
BASES = {
    "ppo": ["actor.ppo_epochs=2"],
    "penalty": ["actor.policy_loss=penalty"],
    "grpo, bypass reinforce, ppo_paper": [
        "algorithm.adv_estimator=grpo",
        "rollout.n=2",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=4",
        "algorithm.rollout_correction.bypass_mode=true",
        "algorithm.rollout_correction.loss_type=reinforce",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=ppo_paper",
        "actor.optim.lr_warmup_steps=1",
    ],
    "clip-higher, fixed KL": [
        "actor.clip_ratio_low=0.1",
        "actor.clip_ratio_high=0.3",
        "algorithm.use_kl_in_reward=true",
    ],
}


def another_value(key, value):
    """A valid value unlike ``value`` that a reader would notice: another name, the other
    boolean, a count of 1 (a token budget of 1 token fails), a float half as large (a bound
    above 1 nearly 1), or a path."""
    declaration = declarations(Config())[key]
    names = choices_of(declaration)
    if names is not None:
        return names[-1] if names[-1] != value else names[0]
    if isinstance(value, bool):
        return not value
    if isinstance(value, tuple):
        return tuple(v / 2 for v in value)
    if isinstance(value, str):
        return "/nowhere"
    if value is None:  # unset: derived from another setting
        return 2 if key.endswith("epochs") else 1 if key.endswith("size_per_gpu") or key.endswith("batch_size") else 0.5
    if isinstance(value, int):
        return 1 if value != 1 else 2
    if str(declaration.valid).startswith("(1,"):  # the dual clip: a ratio above it stops counting
        return 1 + (value - 1) / 100
    return value / 2 if value else 0.5


def two_steps(overrides, edit=None):
    """The trainer, its two steps' metrics (times and memory left out) and the actor's weights after them."""
    trainer = make_trainer(overrides, edit=edit)
    metrics = [
        {k: v for k, v in trainer.train_step().items() if not k.startswith(("timing", "perf/"))} for _ in range(2)
    ]
    return trainer, metrics, [p.detach().clone() for p in trainer.actor.parameters()]


@pytest.mark.parametrize("base", BASES)
def test_changing_an_ignored_setting_changes_nothing(base):
    overrides = BASES[base]
    trainer, metrics, weights = two_steps(overrides)
    ignored = [k for k in ignored_settings(trainer.config) if not k.startswith(NOT_THE_TRAINERS)]
    assert len(ignored) >= 3, ignored
    for key in ignored:

        def edit(config, key=key):
            owner, name = owner_of(config, key)
            setattr(owner, name, another_value(key, getattr(owner, name)))

        _, other_metrics, other_weights = two_steps(overrides, edit)
        assert other_metrics == metrics, key
        assert all(torch.equal(a, b) for a, b in zip(weights, other_weights)), key
