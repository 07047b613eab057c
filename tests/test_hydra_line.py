"""Hydra's command-line grammar and configuration files, with the meanings verl's ``main_ppo``
(``@hydra.main(config_path="config", config_name="ppo_trainer")``) gives them."""

import json

import pytest
from test_verl_names import _gsm8k_files, chat_model  # noqa: F401  (a fixture)

from refppo.runs.cli import main
from refppo.settings.overrides import command_settings


def test_plus_adds_a_key_verls_configuration_lacks_and_refuses_one_it_has():
    """Hydra: ``+key=value`` appends a key and fails on one the config has ("Could not append to
    config. An item is already at ..."); ``++key=value`` sets it either way."""
    with pytest.raises(ValueError, match=r"Hydra refuses \+ on a key verl's configuration has; give actor_rollout"):
        command_settings("ppo", ["+actor_rollout_ref.actor.optim.lr=1e-6"])
    with pytest.raises(ValueError, match=r"Hydra refuses \+"):
        command_settings("ppo", ["+algorithm.use_pf_ppo=false"])  # a key verl has and refppo lacks
    config, _ = command_settings("ppo", ["++actor_rollout_ref.actor.optim.lr=1e-6"])
    assert config.actor.optim.lr == 1e-6
    # the DAPO reward keywords verl's config lacks, which its DAPO lines add with +
    dapo = ["reward.reward_manager.name=dapo", "+reward.reward_kwargs.overlong_buffer_cfg.enable=true"]
    config, _ = command_settings("ppo", [*dapo, "+reward.reward_kwargs.overlong_buffer_cfg.len=4"])
    assert config.reward_model.overlong_buffer.enable and config.reward_model.overlong_buffer.len == 4


def test_tilde_is_refused_by_name():
    with pytest.raises(ValueError, match="Hydra's ~ removes trainer.logger from verl's configuration"):
        command_settings("ppo", ["~trainer.logger"])


@pytest.mark.parametrize("name", ["ppo_trainer", "ppo_megatron_trainer.yaml"])
def test_verls_own_configuration_adds_nothing_but_its_engine(name):
    """``--config-path=config`` is main_ppo's own folder; its two trainer configurations have the
    same algorithm defaults (their generated YAMLs differ in engine settings, in the Megatron
    spelling of the schedule and clip: optim.lr_decay_style, optim.clip_grad, and in the critic's
    seed). ``ppo_megatron_trainer.yaml`` is ``ppo_trainer`` with ``override model_engine: megatron``,
    whose critic takes the actor's ``data_loader_seed`` unless given (``critic/megatron_critic.yaml``),
    in a file's ``defaults`` list too."""
    seed = ["actor_rollout_ref.actor.data_loader_seed=7", "actor_rollout_ref.actor.shuffle=true"]
    config, notes = command_settings("ppo", ["--config-path=config", f"--config-name={name}", "trainer.seed=3", *seed])
    assert config.trainer.seed == 3 and any("verl's own configuration" in n for n in notes)
    assert config.critic.data_loader_seed == (7 if name.startswith("ppo_megatron") else 42)


def test_a_file_on_verls_megatron_configuration_takes_its_engine(tmp_path):
    (tmp_path / "mine.yaml").write_text(
        "defaults:\n  - ppo_megatron_trainer\n  - _self_\nactor_rollout_ref:\n  actor:\n"
        "    data_loader_seed: 7\n    shuffle: true\n"
    )
    config, notes = command_settings("ppo", [f"--config-path={tmp_path}", "--config-name=mine"])
    assert config.critic.data_loader_seed == 7 and any(n.startswith("model_engine=megatron picks") for n in notes)


YAML = """
defaults:
  - ppo_trainer
  - _self_
algorithm:
  adv_estimator: grpo
data:
  train_batch_size: 8
  max_prompt_length: 64
  max_response_length: 4
actor_rollout_ref:
  actor:
    ppo_mini_batch_size: 4
    optim:
      lr: 2.0e-5
  rollout:
    n: 2
    prompt_length: ${data.max_prompt_length}
trainer:
  logger: ["console"]
  total_training_steps: 1
  val_before_train: false
  test_freq: -1
"""


def test_a_yaml_configuration_is_read_then_the_command_line(tmp_path):
    (tmp_path / "mine.yaml").write_text(YAML)
    line = ["--config-path", str(tmp_path), "--config-name=mine", "actor_rollout_ref.actor.optim.lr=1e-5"]
    config, notes = command_settings("ppo", line)
    assert config.algorithm.adv_estimator == "grpo" and config.rollout.n == 2
    assert config.actor.optim.lr == 1e-5, "the command line comes after the file"
    assert config.data.max_prompt_length == 64 and config.trainer.logger == ("console",)
    assert any(n.startswith(f"the settings of {tmp_path / 'mine.yaml'}") for n in notes)


def test_a_yaml_configuration_runs(chat_model, tmp_path):  # noqa: F811
    _gsm8k_files(tmp_path, ("train", "test"), 16)
    (tmp_path / "mine.yaml").write_text(YAML)
    out = tmp_path / "run"
    line = [
        f"--config-path={tmp_path}",
        "--config-name=mine",
        f"actor_rollout_ref.model.path={chat_model}",
        f"data.train_files={tmp_path / 'train.parquet'}",
        f"data.val_files={tmp_path / 'test.parquet'}",
        f"trainer.default_local_dir={out}",
        "trainer.progress_bar=false",
    ]
    assert main(["ppo", *line]) == 0
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and "actor/pg_loss" in rows[0]
    assert json.loads((out / "config.json").read_text())["actor"]["optim"]["lr"] == 2e-5


@pytest.mark.parametrize(
    "text, message",
    [
        ("defaults:\n  - ppo_megatron_trainer\n  - actor: megatron_actor\n", "its defaults list names"),
        ("data:\n  max_prompt_length: ${data.missing}\n", "data.missing"),
        ("data: [unclosed\n", "not a configuration file refppo can read"),
    ],
)
def test_a_configuration_refppo_cannot_read_is_refused(tmp_path, text, message):
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(ValueError, match=message):
        command_settings("ppo", [f"--config-path={tmp_path}", "--config-name=bad"])
    with pytest.raises(ValueError, match="no configuration file"):
        command_settings("ppo", [f"--config-path={tmp_path}", "--config-name=absent"])
    with pytest.raises(ValueError, match="--config-path and --config-name go together"):
        command_settings("ppo", [f"--config-path={tmp_path}"])


def test_plus_on_a_setting_of_refppo_alone_sets_it():
    config, _ = command_settings("ppo", ["+trainer.seed=3"])  # trainer.seed: refppo's, not verl's
    assert config.trainer.seed == 3


def test_print_verl_yaml_is_a_configuration_verl_loads(tmp_path, capsys):
    """The YAML puts verl's own configurations on Hydra's search path and composes its
    ``ppo_trainer`` first, as a user configuration for verl's main_ppo must."""
    import yaml

    assert main(["ppo", "model.path=runs/sft/model", "actor.optim.lr=1e-5", "--print-verl-yaml"]) == 0
    text = capsys.readouterr().out
    loaded = yaml.safe_load(text)
    assert loaded["hydra"] == {"searchpath": ["pkg://verl.trainer.config"]}
    assert loaded["defaults"] == ["ppo_trainer", "_self_"]
    assert loaded["actor_rollout_ref"]["actor"]["optim"]["lr"] == 1e-5
    assert "# refppo settings verl has no counterpart for:" in text
    (tmp_path / "other.yaml").write_text("hydra:\n  searchpath: [file:///elsewhere]\n")
    with pytest.raises(ValueError, match="its hydra section may only add verl's configurations"):
        command_settings("ppo", [f"--config-path={tmp_path}", "--config-name=other"])
