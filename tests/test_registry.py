"""The extension seams, used from outside the package as a researcher would: a new advantage
estimator, policy loss, KL estimator and model family, each a single definition that then works
through the config and the trainer."""

import subprocess
import sys

import pytest
import torch
from _trainers import RECORDS, TOK, first_char_is_seven, make_trainer, micro_batch_loss
from transformers import GPT2Config

from refppo.advantages import (
    ADV_ESTIMATORS,
    compute_advantage,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
    needs_critic,
    register_adv_est,
)
from refppo.algorithms.bypass import apply_bypass_mode
from refppo.algorithms.verl_advantages import (
    compute_gpg_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_remax_outcome_advantage,
)
from refppo.functional import masked_mean
from refppo.kl import kl_penalty, kl_penalty_types, register_kl_estimator
from refppo.losses import POLICY_LOSSES, agg_loss, get_policy_loss_fn, policy_loss_config, register_policy_loss
from refppo.registry import ConfigView, Registry
from refppo.rollout.forward import response_log_probs
from refppo.rollout.models import init_value_head, load_causal_lm, load_value_model, value_head
from refppo.settings.config import Config, RolloutCorrectionConfig, apply_overrides
from refppo.settings.validate import validate
from refppo.training.trainer import PPOTrainer


# ---- what a user's module would hold, written from verl 0.9's documented signatures ----------
@register_adv_est("test_reinforce")
def reinforce_advantage(token_level_rewards, response_mask, index=None, epsilon=1e-6, config=None, **kwargs):
    """REINFORCE without a baseline, discounted by ``config.gamma`` per token after the first, as
    verl's estimators read their settings: the sequence's return on every token; (B, T) twice."""
    lengths = response_mask.sum(-1, keepdim=True)
    ret = token_level_rewards.sum(-1, keepdim=True) * config.get("gamma", 1.0) ** (lengths - 1)
    adv = ret * response_mask
    return adv, adv


@register_policy_loss("test_verl_vanilla")
def verl_vanilla_loss(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """verl 0.9's compute_policy_loss_vanilla as its docs and code read: the clip and the dual clip
    from ``config``, rollout-correction weights, agg_loss with ``config.global_batch_info``, and
    metrics returned as Python floats."""
    clip_ratio = config.clip_ratio
    clip_ratio_low = config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio
    clip_ratio_high = config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio
    clip_ratio_c = config.get("clip_ratio_c", 3.0)
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    lower = torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float()
    pg_clipfrac_lower = masked_mean(lower, response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(
        loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info
    )
    metrics = {
        "actor/pg_clipfrac": pg_clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach().item(),
    }
    return pg_loss, metrics


@register_policy_loss("test_vanilla_pg", reads=())
def vanilla_pg_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None):
    """-A * log pi: no ratio, no clip, and no setting read."""
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


def test_registry_rejects_duplicates_and_missing_inputs_and_knows_what_each_reads():
    reg = Registry("widget", inputs=("x", "config"))

    @reg.register("a", "alias", reads=("scale",))
    def widget(x, config):
        return x * config.scale

    @reg.register("open")
    def open_widget(x, **kwargs):
        return x

    assert reg.names() == ("a", "alias", "open") and reg.get("alias") is widget
    assert widget(x=3.0, config=ConfigView(scale=2.0)) == 6.0 and ConfigView(scale=2.0).get("scale") == 2.0
    assert reg.reads("a", "scale") and not reg.reads("a", "shift") and reg.reads("open", "shift")
    assert reg.readers("scale") == ("a", "alias")
    with pytest.raises(ValueError, match="must accept x, config by keyword; it lacks config"):
        reg.register("b")(lambda x: x)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(lambda x, config: x)
    with pytest.raises(ValueError, match="widget"):
        reg.get("c")
    with pytest.raises(AttributeError, match="no setting 'shift'"):
        ConfigView(scale=2.0).shift  # noqa: B018


# DRO needs a beta; Clip-Cov's window wide enough to hold many tokens
BASE_SETTINGS = ["actor.dro_beta=0.5", "actor.clip_cov_lb=-10"]
# a value away from each base setting
CHANGED_SETTINGS = {
    "clip_ratio": 0.05,
    "clip_ratio_low": 0.05,
    "clip_ratio_high": 0.05,
    "clip_ratio_c": 1.5,
    "tau_pos": 0.05,
    "tau_neg": 0.05,
    "penalty_kl_coef": 0.05,
    "penalty_kl_type": "low_var_kl",
    "clip_cov_ratio": 0.5,
    "clip_cov_lb": -1.0,
    "kl_cov_ratio": 0.5,
    "ppo_kl_coef": 0.05,
    "dro_beta": 2.0,
}


def _loss_config(name, actor):
    """The config the trainer gives the loss ``name``: bypass mode's with its rollout correction."""
    config = policy_loss_config(actor, loss_scale_factor=None)
    if name == "bypass_mode":
        config = apply_bypass_mode(config, RolloutCorrectionConfig(bypass_mode=True))
    return config


def test_every_registered_loss_takes_verls_keywords_and_reads_only_declared_settings():
    """Each built-in loss, called with verl's seven keywords, gives the numbers of its formula
    called with the settings by name; a setting it does not declare changes nothing."""
    torch.manual_seed(0)
    old = -2 * torch.rand(8, 16, dtype=torch.float64)
    new = (old + 0.5 * torch.randn(8, 16, dtype=torch.float64)).clamp(max=-1e-3)  # ratios far from 1
    adv = torch.randn(8, 16, dtype=torch.float64)
    mask = torch.ones(8, 16, dtype=torch.float64)
    base = apply_overrides(Config(), BASE_SETTINGS).actor
    for name in POLICY_LOSSES.names():
        if name.startswith("test_"):
            continue
        base.policy_loss = name
        torch.manual_seed(0)  # Clip-Cov draws the tokens it cuts
        plain = get_policy_loss_fn(name)(
            old_log_prob=old,
            log_prob=new,
            advantages=adv,
            response_mask=mask,
            loss_agg_mode="seq-mean-token-mean",
            config=_loss_config(name, base),
            rollout_is_weights=None,
        )
        for setting, value in CHANGED_SETTINGS.items():
            changed = apply_overrides(Config(), [*BASE_SETTINGS, f"actor.{setting}={value}"]).actor
            changed.policy_loss = name
            torch.manual_seed(0)  # Clip-Cov draws the tokens it cuts
            other = get_policy_loss_fn(name)(
                old_log_prob=old,
                log_prob=new,
                advantages=adv,
                response_mask=mask,
                loss_agg_mode="seq-mean-token-mean",
                config=_loss_config(name, changed),
                rollout_is_weights=None,
            )
            moved = not torch.equal(other[0], plain[0])
            assert moved == POLICY_LOSSES.reads(name, setting), f"{name} and {setting}"


# ---- a new advantage estimator ------------------------------------------------------------
def test_every_registered_estimator_is_called_as_verls_compute_advantage_calls_it():
    """compute_advantage gives each built-in estimator's formula called with its settings by name:
    GAE gamma and lam, GRPO and pass@k norm_adv_by_std_in_grpo, REINFORCE++ gamma, and
    grpo_vectorized always the std (verl's generic call never passes the flag to it)."""
    torch.manual_seed(0)
    rewards = torch.randn(6, 5, dtype=torch.float64)
    mask = torch.ones(6, 5, dtype=torch.float64)
    mask[0, 3:] = 0
    data = {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "index": [0, 0, 1, 1, 2, 2],
        "values": torch.randn(6, 5, dtype=torch.float64),
    }
    algorithm = apply_overrides(Config(), ["algorithm.gamma=0.7", "algorithm.lam=0.8"]).algorithm
    algorithm.norm_adv_by_std_in_grpo = False
    index = data["index"]
    baselines = torch.randn(6, dtype=torch.float64)
    expected = {
        "gae": compute_gae_advantage_return(rewards, data["values"], mask, gamma=0.7, lam=0.8),
        "grpo": compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False),
        "grpo_vectorized": compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=True),
        "rloo": compute_rloo_outcome_advantage(rewards, mask, index),
        "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.7),
        "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, index),
        "gpg": compute_gpg_outcome_advantage(rewards, mask, index),
        "remax": compute_remax_outcome_advantage(rewards, baselines, mask),
        "opo": compute_opo_outcome_advantage(rewards, mask, index),
        "grpo_passk": compute_grpo_passk_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False),
    }
    # these read batch keys compute_advantage does not pass yet (components, sum_pi_squared,
    # old_log_probs): tests/test_verl_advantages_otb_gdpo.py checks that it refuses them
    needs_batch_keys = {"gdpo", "optimal_token_baseline", "tir_optimal_token_baseline"}
    assert set(expected) | needs_batch_keys == {name for name in ADV_ESTIMATORS.names() if not name.startswith("test_")}
    for name, (adv, ret) in expected.items():
        batch = data | {"reward_baselines": baselines} if name == "remax" else data
        got_adv, got_ret = compute_advantage(
            batch, adv_estimator=name, adv_estimator_fn=get_adv_estimator_fn(name), config=algorithm
        )
        assert torch.equal(got_adv, adv) and torch.equal(got_ret, ret), name


def test_a_verl_estimator_runs_unchanged_without_a_critic_and_reads_its_config():
    assert not needs_critic("test_reinforce") and needs_critic("gae") and not needs_critic("grpo")
    trainer = make_trainer(["algorithm.adv_estimator=test_reinforce", "algorithm.gamma=0.5"])
    assert trainer.critic is None
    batch, _ = trainer.make_experience(RECORDS[:16], {})
    scores = batch["token_level_scores"].sum(-1)  # the sequence scores
    lengths = batch["response_mask"].sum(-1)
    expected = (scores * 0.5 ** (lengths - 1))[:, None] * batch["response_mask"]
    assert torch.equal(batch["advantages"], expected)
    assert "values" not in batch
    assert all(torch.isfinite(torch.tensor(v)) for v in trainer.train_step().values())


def test_group_estimators_take_one_response_a_prompt_by_verls_rule_but_pass_at_k_needs_two():
    validate(apply_overrides(Config(), ["algorithm.adv_estimator=grpo"]))  # rollout.n=1: a group of one
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        validate(apply_overrides(Config(), ["algorithm.adv_estimator=grpo_passk"]))
    with pytest.raises(
        ValueError,
        match="algorithm.adv_estimator=.test_nope. is not one of gae, grpo, .*test_reinforce",
    ):
        validate(apply_overrides(Config(), ["algorithm.adv_estimator=test_nope"]))


def test_an_estimators_settings_are_refused_where_it_does_not_read_them():
    with pytest.raises(ValueError, match="algorithm.lam .*algorithm.adv_estimator=gae"):
        validate(apply_overrides(Config(), ["algorithm.adv_estimator=grpo", "algorithm.lam=0.9"]))
    with pytest.raises(ValueError, match="norm_adv_by_std_in_grpo.*adv_estimator=grpo or grpo_passk"):
        validate(
            apply_overrides(
                Config(), ["algorithm.adv_estimator=grpo_vectorized", "algorithm.norm_adv_by_std_in_grpo=false"]
            )
        )


def test_a_critic_given_to_an_estimator_without_values_is_an_error():
    with pytest.raises(ValueError, match="uses no critic"):
        make_trainer(["algorithm.adv_estimator=grpo", "rollout.n=2"], with_critic=True)


# ---- a new policy loss --------------------------------------------------------------------
def test_verls_vanilla_loss_written_by_a_user_trains_exactly_as_the_built_in_clip():
    """The same float32 operations in the same order: every metric and every weight equal, bit for bit."""
    overrides = ["actor.clip_ratio_high=0.28", "actor.ppo_epochs=2"]
    plain = make_trainer(overrides)
    user = make_trainer(overrides + ["actor.policy_loss=test_verl_vanilla"])
    for _ in range(2):
        a = plain.train_step()
        b = user.train_step()
        assert {k: v for k, v in a.items() if not k.startswith(("timing", "perf/"))} == {
            k: v for k, v in b.items() if not k.startswith(("timing", "perf/"))
        }
    for p, q in zip(plain.actor.parameters(), user.actor.parameters()):
        assert torch.equal(p, q)


def test_new_policy_loss_trains_and_logs_only_its_own_metrics():
    trainer = make_trainer(["actor.policy_loss=test_vanilla_pg"])
    metrics = trainer.train_step()
    assert "actor/mean_log_prob" in metrics and metrics["actor/mean_log_prob"] < 0
    assert not any(k.startswith(("actor/pg_clipfrac", "actor/ppo_kl")) for k in metrics)  # no zero-filled placeholders
    with pytest.raises(ValueError, match="actor.clip_ratio .*actor.policy_loss=clip or"):
        validate(apply_overrides(Config(), ["actor.policy_loss=test_vanilla_pg", "actor.clip_ratio=0.1"]))
    validate(apply_overrides(Config(), ["actor.policy_loss=test_verl_vanilla", "actor.clip_ratio=0.1"]))


def test_new_policy_loss_gradient_is_its_formula():
    trainer = make_trainer(["actor.policy_loss=test_vanilla_pg", "actor.optim.clip_grad=1e9"])
    batch, _ = trainer.make_experience(RECORDS[:16], {})
    terms, _ = trainer._actor_loss(batch)
    (g,) = torch.autograd.grad(micro_batch_loss(terms), [trainer.actor.lm_head.weight])
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
