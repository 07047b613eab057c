import math
import subprocess
import sys
import typing

import pytest

from refppo.guards.checks import in_range
from refppo.settings.config import (
    Config,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    critic_setting,
    declarations,
    get_value,
    leaf_keys,
    owner_of,
)
from refppo.settings.validate import validate


def test_overrides_are_typed():
    c = apply_overrides(
        Config(),
        [
            "algorithm.gamma=0.99",
            "actor.ppo_epochs=4",
            "algorithm.use_kl_in_reward=true",
            "actor.clip_ratio_c=null",
            "actor.optim.betas=0.9,0.95",
            "algorithm.kl_ctrl.type=adaptive",
            "critic.model.path=/some/folder",
        ],
    )
    assert c.algorithm.gamma == 0.99 and isinstance(c.algorithm.gamma, float)
    assert c.actor.ppo_epochs == 4 and c.algorithm.use_kl_in_reward is True
    assert c.actor.clip_ratio_c is None and c.actor.optim.betas == (0.9, 0.95)
    assert c.algorithm.kl_ctrl.type == "adaptive" and c.critic.model.path == "/some/folder"
    assert Config().algorithm.gamma == 1.0  # defaults are not shared between instances


def test_unknown_key_names_the_closest():
    with pytest.raises(ValueError, match=r"unknown config key 'algorithm.gama'; did you mean algorithm.gamma"):
        apply_overrides(Config(), ["algorithm.gama=0.9"])
    with pytest.raises(ValueError, match="unknown config key 'zzz'$"):
        apply_overrides(Config(), ["zzz=1"])
    with pytest.raises(ValueError, match="must look like key=value"):
        apply_overrides(Config(), ["algorithm.gamma"])


def test_bad_values():
    with pytest.raises(ValueError, match="actor.ppo_epochs='two': expected int"):
        apply_overrides(Config(), ["actor.ppo_epochs=two"])
    with pytest.raises(ValueError, match="algorithm.use_kl_in_reward='yes': expected bool"):
        apply_overrides(Config(), ["algorithm.use_kl_in_reward=yes"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor.ppo_mini_batch_size=24"], "must divide data.train_batch_size=64"),
        (["actor.ppo_micro_batch_size_per_gpu=5"], "must divide the mini-batch of 16 rows"),
        (["actor.clip_ratio_c=1.0"], "actor.clip_ratio_c=1.0 is outside its valid range \\(1, inf\\) \\(or null\\)"),
        (["algorithm.adv_estimator=grpo_passk"], "set rollout.n >= 2"),
        (["data.train_batch_size=1", "actor.ppo_mini_batch_size=1"], "a batch of one response .* use >= 2 responses"),
        (["algorithm.adv_estimator=vtrace"], "vtrace"),
        (["actor.loss_agg_mode=mean"], "actor.loss_agg_mode='mean' is not one of token-mean"),
        (["algorithm.kl_ctrl.type=pid"], "algorithm.kl_ctrl.type='pid'"),
        (["rollout.temperature=0"], "rollout.temperature=0.0 is outside its valid range \\[1e-6, inf\\)"),
        (["algorithm.lam=1.5"], "algorithm.lam=1.5 is outside its valid range \\[0, 1\\]"),
        (["reward_model.enable=true"], "needs reward_model.model.path"),
        (["data.task=file"], "needs data.train_files"),
        (["trainer.total_training_steps=0"], "trainer.total_training_steps=0 is outside its valid range \\[1, inf\\)"),
        (["critic.ppo_mini_batch_size=24"], "critic.ppo_mini_batch_size=24 must divide data.train_batch_size=64"),
        (
            ["critic.ppo_mini_batch_size=8", "critic.ppo_micro_batch_size_per_gpu=16"],
            "must divide the mini-batch of 8 rows",
        ),
        (["critic.ppo_epochs=0"], "critic.ppo_epochs=0 is outside"),
        (["reward_model.missing_eos_penalty=-1"], "reward_model.missing_eos_penalty=-1.0 is outside"),
        (["sft.teacher_carry_error=1.5"], "sft.teacher_carry_error=1.5 is outside its valid range \\[0, 1\\]"),
        (["rollout.cuda_graphs=true", "trainer.device=cpu"], "rollout.cuda_graphs=true needs a CUDA device"),
        (["critic.loss_scale_factor=0"], "critic.loss_scale_factor=0.0 is outside"),
        # Issue 13 item 4: settings that trained wrong without a word.
        (["actor.optim.clip_grad=-1"], r"actor.optim.clip_grad=-1.0 is outside its valid range \(0, inf\]"),
        (["critic.optim.clip_grad=0"], "critic.optim.clip_grad=0.0 is outside"),
        (["actor.entropy_coeff=nan"], r"actor.entropy_coeff=nan is outside its valid range \(-inf, inf\)"),
        (["actor.kl_loss_coef=-0.1"], "actor.kl_loss_coef=-0.1 is outside"),
        (["rollout.temperature=inf"], "rollout.temperature=inf is outside"),
        (["model.lora_alpha=0"], "model.lora_alpha=0 is outside"),
        (["actor.optim.lr=inf"], r"actor.optim.lr=inf is outside its valid range \[0, 1e10\]"),
        (["critic.optim.lr=-1e-3"], "critic.optim.lr=-0.001 is outside"),
        (["actor.optim.betas=0.9,1.0"], r"actor.optim.betas=1.0 is outside its valid range \[0, 1\)"),
        (["critic.cliprange_value=-0.5"], "critic.cliprange_value=-0.5 is outside"),
        (["actor.penalty_kl_coef=-1"], "actor.penalty_kl_coef=-1.0 is outside"),
        (["algorithm.kl_ctrl.kl_coef=nan"], "algorithm.kl_ctrl.kl_coef=nan is outside"),
        (["rollout.top_k=0"], r"rollout.top_k=0 is outside its valid range -1 or \[1, inf\)"),
        (["trainer.save_freq=0"], "trainer.save_freq=0 is outside"),
        (
            ["actor.ppo_micro_batch_size_per_gpu=0"],
            r"actor.ppo_micro_batch_size_per_gpu=0 is outside its valid range \[1, inf\) \(or null\)",
        ),
        (["trainer.total_training_steps=5"], "trainer.critic_warmup=6 must be <= trainer.total_training_steps=5"),
        (["actor.optim.lr=1e300"], r"actor.optim.lr=1e\+300 is outside its valid range \[0, 1e10\]"),
        (
            ["actor.clip_ratio_high=1e300"],
            r"actor.clip_ratio_high=1e\+300 is above float32's largest value 3.403e\+38: it would overflow in the "
            r"float32 tensors it enters$",
        ),
        (["actor.entropy_coeff=1e39"], r"actor.entropy_coeff=1e\+39 is above float32's largest value"),
        (["critic.optim.clip_grad=1e300"], r"float32 tensors it enters; for no bound give inf$"),
        (["sft.lr=1e11"], r"sft.lr=100000000000.0 is outside its valid range \(0, 1e10\]"),
        (["actor.optim.weight_decay=2"], r"actor.optim.weight_decay=2.0 is outside its valid range \[0, 1\]"),
        (["trainer.seed=4294967296"], "trainer.seed=4294967296 is outside its valid range \\[0, 4294967295\\]"),
        (["data.val_size=2490"], "data.val_size=2490 holds out too many of the arithmetic task's 2500 problems"),
        (["model.hidden_size=30"], "model.hidden_size=30 must be a multiple of model.num_attention_heads=4"),
        (["model.num_key_value_heads=3"], "model.num_key_value_heads=3 must divide model.num_attention_heads=4"),
        (["model.hidden_size=12"], "model.hidden_size / model.num_attention_heads = 3 must be even"),
        (
            [
                "algorithm.adv_estimator=grpo",
                "rollout.n=2",
                "trainer.critic_warmup=4",
                "trainer.total_training_steps=3",
            ],
            "trainer.critic_warmup=4 must be <= trainer.total_training_steps=3",
        ),
        (["sft.batch_size=0"], "sft.batch_size=0 is outside"),
        (["sft.steps=0"], "sft.steps=0 is outside"),
        (["sft.lr=nan"], "sft.lr=nan is outside"),
        (["rm.lr=0"], "rm.lr=0.0 is outside"),
        # Issue 13 item 5: options another option makes meaningless.
        (["data.task=arithmetic", "data.train_files=x.jsonl"], "data.train_files is read only with data.task=file"),
        (["data.val_files=x.jsonl"], "data.val_files is read only with data.task=file"),
        (
            ["reward_model.enable=true", "reward_model.model.path=rm", "reward_model.reward_fn=m:f"],
            "both give the training score",
        ),
        (["reward_model.model.path=rm"], "reward_model.model.path is read only with reward_model.enable=true"),
        (
            ["algorithm.adv_estimator=grpo", "rollout.n=2", "critic.model.path=c"],
            "critic.model.path=c is ignored: critic.model.path is read only with algorithm.adv_estimator=gae",
        ),
        (
            ["algorithm.adv_estimator=grpo", "rollout.n=2", "critic.model.enable_gradient_checkpointing=true"],
            "critic.model.enable_gradient_checkpointing=true is ignored: critic.model.enable_gradient_checkpointing "
            "is read only with algorithm.adv_estimator=gae",
        ),
        (["algorithm.adv_estimator=rloo", "rollout.n=2", "critic.optim.lr=1e-4"], "critic.optim.lr=0.0001 is ignored"),
        (
            ["algorithm.adv_estimator=grpo", "rollout.n=2", "algorithm.lam=0.9"],
            "algorithm.lam=0.9 is ignored: algorithm.lam is read only with algorithm.adv_estimator=gae",
        ),
        (
            ["algorithm.norm_adv_by_std_in_grpo=false"],
            "algorithm.norm_adv_by_std_in_grpo=false is ignored: .* read only with algorithm.adv_estimator=grpo",
        ),
        (
            ["algorithm.kl_ctrl.kl_coef=0.05"],
            r"algorithm.kl_ctrl.kl_coef=0.05 is ignored: .* read only with algorithm.use_kl_in_reward=true\. Set "
            r"that, or drop algorithm.kl_ctrl.kl_coef",
        ),
        (["algorithm.kl_penalty=low_var_kl"], "algorithm.kl_penalty=low_var_kl is ignored"),
        (
            ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.target_kl=0.5"],
            "algorithm.kl_ctrl.target_kl=0.5 is ignored: .* read only with algorithm.kl_ctrl.type=adaptive or "
            "ppo_paper",
        ),
        (
            ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=ppo_paper", "algorithm.kl_ctrl.horizon=100"],
            "algorithm.kl_ctrl.horizon=100.0 is ignored: .* read only with algorithm.kl_ctrl.type=adaptive",
        ),
        (["actor.kl_loss_coef=0.1"], "actor.kl_loss_coef=0.1 is ignored: .* read only with actor.use_kl_loss=true"),
        (["actor.kl_loss_type=mse"], "actor.kl_loss_type=mse is ignored"),
        (
            ["ref.log_prob_micro_batch_size_per_gpu=4"],
            r"ref.log_prob_micro_batch_size_per_gpu=4 is ignored: .* algorithm.use_kl_in_reward=true or "
            r"actor.use_kl_loss=true \(the reference pass\)",
        ),
        (
            ["actor.penalty_kl_coef=0.5"],
            "actor.penalty_kl_coef=0.5 is ignored: .* read only with actor.policy_loss=penalty",
        ),
        (
            ["actor.policy_loss=penalty", "actor.clip_ratio_c=null"],
            "actor.clip_ratio_c=null is ignored: .* read only with actor.policy_loss=clip",
        ),
        (
            ["actor.clip_ratio_low=0.1", "actor.clip_ratio_high=0.3", "actor.clip_ratio=0.25"],
            r"actor.clip_ratio=0.25 is ignored: .* read only with actor.clip_ratio_low or actor.clip_ratio_high null "
            r"\(both are set\)",
        ),
        (
            ["algorithm.rollout_correction.rollout_is_threshold=1.5"],
            "algorithm.rollout_correction.rollout_is_threshold=1.5 is ignored: .* read only with "
            "algorithm.rollout_correction.rollout_is=token or sequence",
        ),
        (
            ["algorithm.rollout_correction.loss_type=reinforce"],
            "algorithm.rollout_correction.loss_type=reinforce is ignored: .* read only with "
            "algorithm.rollout_correction.bypass_mode=true",
        ),
        (
            ["algorithm.rollout_correction.bypass_mode=true", "actor.policy_loss=gspo"],
            r"actor.policy_loss=gspo is ignored: .*bypass_mode=false \(bypass mode's own loss replaces it",
        ),
        (
            [
                "algorithm.rollout_correction.bypass_mode=true",
                "algorithm.rollout_correction.loss_type=reinforce",
                "actor.clip_ratio_c=5.0",
            ],
            r"actor.clip_ratio_c=5.0 is ignored: .*loss_type=ppo_clip \(bypass mode's REINFORCE has no clip\)",
        ),
        (
            ["algorithm.rollout_correction.rollout_is=tokens"],
            "algorithm.rollout_correction.rollout_is",
        ),
        (
            ["algorithm.rollout_correction.bypass_mode=true", "rollout.log_prob_micro_batch_size_per_gpu=4"],
            "rollout.log_prob_micro_batch_size_per_gpu=4 is ignored: .*bypass_mode=false",
        ),
        (
            ["actor.loss_scale_factor=8"],
            "actor.loss_scale_factor=8.0 is ignored: .* read only with actor.loss_agg_mode=seq-mean-token-sum-norm",
        ),
        (
            ["critic.loss_scale_factor=8"],
            r"critic.loss_scale_factor=8.0 is ignored: .* read only with "
            r"critic.loss_agg_mode=seq-mean-token-sum-norm \(null: actor.loss_agg_mode\)",
        ),
        (
            ["critic.loss_agg_mode=seq-mean-token-sum-norm", "critic.loss_scale_factor=8", "actor.loss_scale_factor=4"],
            "actor.loss_scale_factor=4.0 is ignored: .* or a critic whose loss mode is that with "
            "critic.loss_scale_factor null",
        ),
        (
            ["actor.entropy_coeff=0.01", "actor.calculate_entropy=true"],
            "actor.calculate_entropy=true is ignored: .* read only with actor.entropy_coeff=0",
        ),
        (
            ["actor.ppo_max_token_len_per_gpu=512"],
            "actor.ppo_max_token_len_per_gpu=512 is ignored: .* read only with actor.use_dynamic_bsz=true",
        ),
        (
            ["critic.ppo_max_token_len_per_gpu=512"],
            "critic.ppo_max_token_len_per_gpu=512 is ignored: .* read only with critic.use_dynamic_bsz=true",
        ),
        (
            ["reward_model.micro_batch_size_per_gpu=4"],
            "reward_model.micro_batch_size_per_gpu=4 is ignored: .* read only with reward_model.enable=true",
        ),
        (["model.lora_alpha=32"], "model.lora_alpha=32 is ignored: .* read only with model.lora_rank > 0"),
        (["data.prompt_key=question"], "data.prompt_key=question is ignored: .* read only with data.task=file"),
        (
            ["data.task=file", "data.train_files=t.jsonl", "data.val_files=v.jsonl", "data.val_size=10"],
            r"data.val_size=10 is ignored: .* read only with data.val_files=null \(data.val_files holds the "
            r"evaluation prompts\)",
        ),
        (
            ["actor.use_dynamic_bsz=true", "actor.ppo_micro_batch_size_per_gpu=4"],
            "actor.ppo_micro_batch_size_per_gpu=4 is ignored: .* read only with actor.use_dynamic_bsz=false",
        ),
        (
            ["actor.use_dynamic_bsz=true", "rollout.log_prob_micro_batch_size_per_gpu=4"],
            "rollout.log_prob_micro_batch_size_per_gpu=4 is ignored: .* read only with actor.use_dynamic_bsz=false",
        ),
        (
            [
                "actor.use_dynamic_bsz=true",
                "algorithm.use_kl_in_reward=true",
                "ref.log_prob_micro_batch_size_per_gpu=4",
            ],
            "ref.log_prob_micro_batch_size_per_gpu=4 is ignored: .* read only with actor.use_dynamic_bsz=false",
        ),
        (
            ["critic.use_dynamic_bsz=true", "critic.ppo_micro_batch_size_per_gpu=4"],
            "critic.ppo_micro_batch_size_per_gpu=4 is ignored: .* read only with critic.use_dynamic_bsz=false",
        ),
        (
            ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=23"],
            r"actor.ppo_max_token_len_per_gpu=23 is less than one sequence can be \(data.max_prompt_length \+ "
            r"data.max_response_length = 24\)",
        ),
        (
            ["critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=10"],
            "critic.ppo_max_token_len_per_gpu=10 is less than",
        ),
        (["actor.ppo_max_token_len_per_gpu=0"], "actor.ppo_max_token_len_per_gpu=0 is outside"),
    ],
)
def test_validation_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(apply_overrides(Config(), overrides))


def test_unset_critic_settings_are_the_actors_as_verl_interpolates_them():
    c = validate(
        apply_overrides(
            Config(), ["actor.loss_agg_mode=seq-mean-token-sum-norm", "actor.loss_scale_factor=4", "actor.ppo_epochs=3"]
        )
    )
    assert [
        critic_setting(c, k) for k in ("loss_agg_mode", "loss_scale_factor", "ppo_epochs", "ppo_mini_batch_size")
    ] == ["seq-mean-token-sum-norm", 4, 3, 16]
    own = validate(apply_overrides(Config(), ["critic.loss_agg_mode=token-sum", "critic.ppo_mini_batch_size=8"]))
    assert critic_setting(own, "loss_agg_mode") == "token-sum" and critic_setting(own, "ppo_mini_batch_size") == 8
    # The critic alone reads the actor's constant: no refusal.
    validate(apply_overrides(Config(), ["critic.loss_agg_mode=seq-mean-token-sum-norm", "actor.loss_scale_factor=4"]))


def test_round_trip_through_a_dict():
    c = apply_overrides(Config(), ["actor.clip_ratio_c=null", "algorithm.gamma=0.5", "actor.optim.betas=0.8,0.9"])
    assert config_from_dict(config_to_dict(c)) == c
    assert validate(Config()) == Config()


def test_importing_the_config_loads_no_model_library():
    code = "import sys, refppo.settings.config; sys.exit('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_every_numeric_setting_has_a_valid_range():
    """A new numeric field must declare its range, or validation would let NaN and inf through."""
    config = Config()
    numeric = []
    for key in leaf_keys(config):
        value = get_value(config, key)
        hint = str(typing.get_type_hints(type(owner_of(config, key)[0]))[key.rsplit(".", 1)[1]])
        numbers = value if isinstance(value, tuple) else (value,)
        if (
            all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers)
            or "int" in hint
            or "float" in hint
        ):
            numeric.append(key)
    assert len(numeric) > 50
    ranged = [key for key, d in declarations(config).items() if isinstance(d.valid, str)]
    assert sorted(set(numeric) - set(ranged)) == []
    assert sorted(set(ranged) - set(numeric)) == []  # a range only on numbers


@pytest.mark.parametrize(
    "value, spec, inside",
    [
        (0.0, "[0, 1)", True),
        (1.0, "[0, 1)", False),
        (1.0, "(0, 1]", True),
        (0.0, "(0, 1]", False),
        (math.inf, "(0, inf)", False),
        (math.inf, "(0, inf]", True),
        (math.nan, "(-inf, inf)", False),
        (-1, "-1 or [1, inf)", True),
        (0, "-1 or [1, inf)", False),
        (7, "-1 or [1, inf)", True),
    ],
)
def test_in_range(value, spec, inside):
    assert in_range(value, spec) is inside


def test_a_run_without_a_critic_accepts_no_warm_up_and_any_length():
    # verl's GRPO scripts pass trainer.critic_warmup=0; the default warm-up does not bound the steps.
    for overrides in (["trainer.critic_warmup=0"], ["trainer.total_training_steps=2"]):
        validate(apply_overrides(Config(), ["algorithm.adv_estimator=grpo", "rollout.n=2", *overrides]))
