import subprocess
import sys

import pytest

from refppo.config import Config, apply_overrides, config_from_dict, config_to_dict, validate


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
        (["actor.clip_ratio_c=1.0"], "clip_ratio_c must be > 1"),
        (["algorithm.adv_estimator=grpo"], "set rollout.n >= 2"),
        (["algorithm.adv_estimator=vtrace"], "vtrace"),
        (["actor.loss_agg_mode=mean"], "actor.loss_agg_mode='mean' is not one of token-mean"),
        (["algorithm.kl_ctrl.type=pid"], "algorithm.kl_ctrl.type='pid'"),
        (["rollout.temperature=0"], "rollout.temperature must be > 0"),
        (["algorithm.lam=1.5"], "gamma and algorithm.lam must be in"),
        (["reward_model.enable=true"], "needs reward_model.model.path"),
        (["data.task=file"], "needs data.train_files"),
        (["trainer.total_training_steps=0"], "total_training_steps must be >= 1"),
        (["critic.ppo_mini_batch_size=24"], "critic.ppo_mini_batch_size=24 must divide data.train_batch_size=64"),
        (["critic.ppo_mini_batch_size=8", "critic.ppo_micro_batch_size_per_gpu=16"], "must divide the mini-batch of 8 rows"),
        (["critic.ppo_epochs=0"], "critic.ppo_epochs must be >= 1"),
        (["reward_model.missing_eos_penalty=-1"], "reward_model.missing_eos_penalty must be >= 0, got -1.0"),
        (["sft.teacher_carry_error=1.5"], r"sft.teacher_carry_error must be in \[0, 1\]"),
        (["rollout.cuda_graphs=true", "trainer.device=cpu"], "rollout.cuda_graphs=true needs a CUDA device"),
        (["critic.loss_scale_factor=0"], "critic.loss_scale_factor must be > 0"),
    ],
)
def test_validation_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(apply_overrides(Config(), overrides))


def test_round_trip_through_a_dict():
    c = apply_overrides(Config(), ["actor.clip_ratio_c=null", "algorithm.gamma=0.5", "actor.optim.betas=0.8,0.9"])
    assert config_from_dict(config_to_dict(c)) == c
    assert validate(Config()) == Config()


def test_importing_the_config_loads_no_model_library():
    code = "import sys, refppo.config; sys.exit('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
