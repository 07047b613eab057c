"""The extension seams, used from outside the package as a researcher would: a new advantage
estimator, policy loss, KL estimator and model family, each a single definition that then works
through the config and the trainer."""

import subprocess
import sys

import pytest
import torch
from _trainers import RECORDS, TOK, first_char_is_seven, make_trainer
from transformers import GPT2Config

from refppo.advantages import needs_critic, register_adv_est
from refppo.functional import masked_mean
from refppo.kl import kl_penalty, kl_penalty_types, register_kl_estimator
from refppo.losses import agg_loss, register_policy_loss
from refppo.registry import Registry
from refppo.rollout.forward import response_log_probs
from refppo.rollout.models import init_value_head, load_causal_lm, load_value_model, value_head
from refppo.settings.config import Config, apply_overrides
from refppo.settings.validate import validate
from refppo.training.trainer import PPOTrainer


# ---- what a user's module would hold ------------------------------------------------------
@register_adv_est("test_reinforce")
def reinforce_advantage(token_level_rewards, response_mask):
    """REINFORCE without a baseline: the sequence's return on every token; (B, T) -> (B, T) twice."""
    adv = token_level_rewards.sum(-1, keepdim=True) * response_mask
    return adv, adv


@register_adv_est("test_value_baseline")
def value_baseline_advantage(token_level_rewards, values, response_mask, gamma):
    """Return minus the first value: declares ``values``, so it needs a critic."""
    ret = token_level_rewards.sum(-1, keepdim=True) * gamma
    adv = (ret - values[:, :1]) * response_mask
    return adv, ret * response_mask


@register_policy_loss("test_vanilla_pg")
def vanilla_pg_loss(log_prob, advantages, response_mask, loss_agg_mode):
    """-A * log pi: no ratio, no clip."""
    loss = agg_loss(-advantages * log_prob, response_mask, loss_agg_mode)
    return loss, {"actor/mean_log_prob": masked_mean(log_prob, response_mask).detach()}


@register_kl_estimator("test_sq")
def squared_log_ratio(logprob, ref_logprob):
    """(log pi - log pi_ref)^2, twice k2."""
    return (logprob - ref_logprob).square()


# ---- the registry itself ------------------------------------------------------------------
@pytest.mark.parametrize(
    "module, getter, name",
    [
        ("refppo.advantages", "get_adv_estimator_fn", "remax"),
        ("refppo.advantages", "get_adv_estimator_fn", "grpo_passk"),
        ("refppo.losses", "get_policy_loss_fn", "gspo"),
        ("refppo.losses", "get_policy_loss_fn", "dppo_tv"),
    ],
)
def test_verls_other_names_are_registered_whichever_module_is_imported_first(module, getter, name):
    """A fresh interpreter that imports only the registry's own module still finds verl's other
    estimators and losses (the package imports the modules that register them)."""
    code = f"from {module} import {getter}; print({getter}({name!r}).__module__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() in (
        "refppo.algorithms.verl_advantages",
        "refppo.algorithms.verl_losses",
        "refppo.algorithms.divergence_losses",
    )


def test_registry_rejects_duplicates_and_hidden_inputs_and_names_what_is_missing():
    reg = Registry("widget")

    @reg.register("a", "alias")
    def widget(x, scale=2.0):
        return x * scale

    assert reg.names() == ("a", "alias") and reg.get("alias") is widget
    assert reg.call("a", x=3.0, unused=1) == 6.0 and reg.call("a", x=3.0, scale=1.0) == 3.0
    assert reg.takes("a", "scale") and not reg.takes("a", "y")
    with pytest.raises(ValueError, match="'a' needs x"):
        reg.call("a", scale=1.0)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(lambda x: x)
    with pytest.raises(ValueError, match="no \\*args or \\*\\*kwargs"):
        reg.register("b")(lambda **kw: 0)
    with pytest.raises(ValueError, match="unknown widget 'c'|widget"):
        reg.get("c")


# ---- a new advantage estimator ------------------------------------------------------------
def test_new_advantage_estimator_runs_without_a_critic():
    assert not needs_critic("test_reinforce") and needs_critic("test_value_baseline") and needs_critic("gae")
    trainer = make_trainer(["algorithm.adv_estimator=test_reinforce"])  # rollout.n=1 is fine: no index
    assert trainer.critic is None
    batch, _ = trainer.make_experience(RECORDS[:16], {})
    scores = batch["token_level_scores"].sum(-1)  # the sequence scores
    assert torch.equal(batch["advantages"], scores[:, None] * batch["response_mask"])
    assert "values" not in batch
    assert all(torch.isfinite(torch.tensor(v)) for v in trainer.train_step().values())


def test_new_estimator_declaring_values_gets_a_critic_and_its_inputs_by_name():
    trainer = make_trainer(["algorithm.adv_estimator=test_value_baseline", "algorithm.gamma=0.5"])
    assert trainer.critic is not None
    batch, _ = trainer.make_experience(RECORDS[:16], {})
    scores = batch["token_level_scores"].sum(-1)  # the sequence scores
    mask = batch["response_mask"]
    assert torch.allclose(batch["advantages"], (0.5 * scores[:, None] - batch["values"][:, :1]) * mask)
    with pytest.raises(ValueError, match="needs a critic"):
        make_trainer(["algorithm.adv_estimator=test_value_baseline"], with_critic=False)


def test_an_estimator_that_compares_a_group_asks_for_rollout_n():
    config = apply_overrides(Config(), ["algorithm.adv_estimator=grpo"])
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        validate(config)
    with pytest.raises(
        ValueError,
        match="algorithm.adv_estimator=.test_nope. is not one of gae, grpo, grpo_vectorized, rloo, .*test_reinforce",
    ):
        validate(apply_overrides(Config(), ["algorithm.adv_estimator=test_nope"]))


def test_a_critic_given_to_an_estimator_without_values_is_an_error():
    with pytest.raises(ValueError, match="uses no critic"):
        make_trainer(["algorithm.adv_estimator=grpo", "rollout.n=2"], with_critic=True)


# ---- a new policy loss --------------------------------------------------------------------
def test_new_policy_loss_trains_and_logs_only_its_own_metrics():
    trainer = make_trainer(["actor.policy_loss=test_vanilla_pg"])
    metrics = trainer.train_step()
    assert "actor/mean_log_prob" in metrics and metrics["actor/mean_log_prob"] < 0
    assert not any(k.startswith(("actor/pg_clipfrac", "actor/ppo_kl")) for k in metrics)  # no zero-filled placeholders
    with pytest.raises(ValueError, match="takes no weights"):
        validate(
            apply_overrides(
                Config(), ["actor.policy_loss=test_vanilla_pg", "algorithm.rollout_correction.rollout_is=token"]
            )
        )
    with pytest.raises(ValueError, match="takes no weights"):
        validate(
            apply_overrides(Config(), ["actor.policy_loss=penalty", "algorithm.rollout_correction.rollout_is=token"])
        )


def test_new_policy_loss_gradient_is_its_formula():
    trainer = make_trainer(["actor.policy_loss=test_vanilla_pg", "actor.grad_clip=1e9"])
    batch, _ = trainer.make_experience(RECORDS[:16], {})
    loss, _ = trainer._actor_loss(batch)
    (g,) = torch.autograd.grad(loss, [trainer.actor.lm_head.weight])
    mask = batch["response_mask"]
    logp, _ = response_log_probs(trainer.actor, batch, 1.0)
    plain = -(batch["advantages"] * logp * mask).sum() / mask.sum()  # token-mean
    (g_plain,) = torch.autograd.grad(plain, [trainer.actor.lm_head.weight])
    assert torch.allclose(g, g_plain, atol=1e-6)


# ---- a new KL estimator -------------------------------------------------------------------
def test_new_kl_estimator_gets_a_straight_through_form_and_reaches_the_config():
    assert {"test_sq", "test_sq+"} <= set(kl_penalty_types())
    logp = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(3, 5, dtype=torch.float64)
    assert torch.equal(kl_penalty(logp, ref, "test_sq"), (logp - ref).square())
    st = kl_penalty(logp, ref, "test_sq+")
    assert torch.equal(st, (logp - ref).square())
    (g,) = torch.autograd.grad(st.sum(), logp)
    assert torch.allclose(g, logp - ref)  # k2's gradient
    with pytest.raises(ValueError, match="trailing"):
        register_kl_estimator("bad+")
    trainer = make_trainer(
        ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=test_sq", "algorithm.kl_ctrl.kl_coef=0.1"]
    )
    batch, stats = trainer.make_experience(RECORDS[:16], {})
    mask = batch["response_mask"]
    kl = (batch["old_log_probs"] - batch["ref_log_prob"]).square() * mask
    assert torch.allclose(batch["token_level_rewards"], batch["token_level_scores"] - 0.1 * kl)


# ---- a new model family -------------------------------------------------------------------
def test_a_gpt2_actor_and_critic_train_through_the_same_code():
    config = GPT2Config(
        vocab_size=len(TOK),
        n_embd=32,
        n_layer=1,
        n_head=2,
        n_positions=64,
        bos_token_id=TOK.bos_token_id,
        eos_token_id=TOK.eos_token_id,
        pad_token_id=TOK.pad_token_id,
    )
    torch.manual_seed(0)
    actor, critic = load_causal_lm(config), load_value_model(config)
    assert value_head(critic) is critic.classifier and torch.equal(critic.classifier.bias, torch.zeros(1))
    run_config = validate(
        apply_overrides(
            Config(), ["data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "data.max_response_length=4"]
        )
    )
    trainer = PPOTrainer(run_config, TOK, actor, critic, RECORDS, RECORDS[:4], reward_fn=first_char_is_seven)
    metrics = trainer.train_step()
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert metrics["critic/vf_loss"] > 0 and "critic/vf_explained_var" in metrics
    with pytest.raises(ValueError, match="VALUE_HEAD_NAMES"):
        init_value_head(actor)  # a causal LM has no scalar head
