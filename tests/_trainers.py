"""A tiny trainer on a rule reward, shared by the trainer tests."""

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from refppo.advantages import needs_critic
from refppo.rollout.models import add_lora, load_causal_lm, load_value_model, tiny_config
from refppo.settings.config import Config, apply_overrides
from refppo.settings.validate import validate
from refppo.tasks.tokenizer import build_tokenizer
from refppo.training.trainer import PPOTrainer
from refppo.training.update import minibatch_updates

TOK = build_tokenizer()
# The sampler's log-probs against the trainer's (ch 6.5), as verl's rollout_correction settings.
MODES = {
    "decoupled": [],
    "bypass": ["algorithm.rollout_correction.bypass_mode=true"],
    "token_is": ["algorithm.rollout_correction.rollout_is=token"],
    "sequence_is": ["algorithm.rollout_correction.rollout_is=sequence"],
}
RECORDS = [{"prompt": f"{a}+{b}="} for a in range(10) for b in range(10)]


def first_char_is_seven(prompts, responses, records):
    """A rule reward a random tiny model can learn in seconds."""
    return torch.tensor([float(r[:1] == "7") for r in responses])


def make_trainer(
    overrides=(), seed=0, reward_fn=first_char_is_seven, with_critic=None, lora_rank=0, edit=None, adapt=None, **kw
):
    """A PPOTrainer on a 1-layer, 32-wide model: 16 prompts a step, 4 response tokens; a critic
    when the advantage estimator needs one (or as ``with_critic`` says); a LoRA actor of rank
    ``lora_rank`` if it is > 0, or ``adapt(actor)`` if given. ``critic.*`` overrides apply where
    the estimator has a critic (validate refuses them elsewhere), so tests can share one list
    across estimators. ``edit(config)``, if given, changes the validated config (to build one
    validate refuses)."""
    base = [
        "data.train_batch_size=16",
        "data.max_response_length=4",
        "actor.ppo_mini_batch_size=8",
        "actor.optim.lr=3e-3",
        "trainer.critic_warmup=0",
        f"trainer.seed={seed}",
    ]
    if needs_critic(apply_overrides(Config(), list(overrides)).algorithm.adv_estimator):
        overrides = ["critic.optim.lr=3e-3", *overrides]
    else:
        overrides = [o for o in overrides if not o.startswith("critic.")]
    config = validate(apply_overrides(Config(), [*base, *overrides]))
    if edit is not None:
        edit(config)
    torch.manual_seed(seed)
    model_config = tiny_config(TOK, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    actor = load_causal_lm(model_config)
    if lora_rank:
        actor = add_lora(actor, r=lora_rank)
    if adapt is not None:
        actor = adapt(actor)
    if with_critic is None:
        with_critic = needs_critic(config.algorithm.adv_estimator)
    critic = load_value_model(model_config) if with_critic else None
    return PPOTrainer(config, TOK, actor, critic, RECORDS, RECORDS[:8], reward_fn=reward_fn, **kw)


def same_state(source, target):
    """Set ``target``'s trained models, optimisers and learning-rate schedules to ``source``'s."""
    for name, learner in source.learners.items():
        other = target.learners[name]
        other.model.load_state_dict(learner.model.state_dict())
        other.optimizer.load_state_dict(learner.optimizer.state_dict())
        other.schedule.load_state_dict(learner.schedule.state_dict())


def assert_same_steps(plain, other, steps, rel, scale):
    """``steps`` training steps of two trainers that differ only in paths equal in exact
    arithmetic, each step started from the same weights and optimiser state (``other`` takes
    ``plain``'s): every metric, and the gradient of every optimiser step, equal to ``rel``
    (relative; for a metric near 0, ``rel`` x ``scale`` absolute, ``scale`` the size of the
    values it averages). Starting each step from the same state keeps Adam's amplification of
    rounding (``_tolerances``, rule 2) out of the comparison."""
    grads = []

    def record(optimizer, args, kwargs):
        grads.append([p.grad.clone() for group in optimizer.param_groups for p in group["params"]])

    hook = register_optimizer_step_pre_hook(record)
    try:
        for _ in range(steps):
            same_state(plain, other)
            grads.clear()
            a = plain.train_step()
            plain_updates = len(grads)
            b = other.train_step()
            assert len(grads) == 2 * plain_updates > 0
            step = plain.step
            for key in a:
                if not key.startswith(("timing", "perf/")):
                    assert b[key] == pytest.approx(a[key], rel=rel, abs=rel * scale), f"step {step}: {key}"
            for mine, theirs in zip(grads[:plain_updates], grads[plain_updates:]):
                for g, h in zip(mine, theirs):
                    assert (h - g).norm() <= rel * g.norm(), f"step {step}: a gradient differs"
    finally:
        hook.remove()


def minibatch_stats(trainer, batch, role):
    """The per-mini-batch stats of ``role``'s ("actor" or "critic") updates on ``batch``, as the
    trainer's update runs them (without the schedule's step)."""
    loss = trainer._actor_loss if role == "actor" else trainer._critic_loss
    settings = trainer._update_settings(role)
    return minibatch_updates(batch, trainer.learners[role], settings, loss, trainer.world)


def micro_batch_loss(terms):
    """The loss a micro-batch that is its whole mini-batch contributes: each term's coefficient
    times its value (every mode's weight is 1 there)."""
    return sum(term.coefficient * term.value for term in terms.values())
