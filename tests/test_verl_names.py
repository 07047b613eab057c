"""verl 0.9's spellings (refppo.settings.verl_names) and the map beside verl's settings (refppo.settings.verl_map),
checked against verl 0.9.0's own generated trainer config (tests/data), and verl's quickstart
command lines run as they are on a tiny model."""

import json
import math
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from _inputs import CHAT_TEMPLATES

from refppo.runs.cli import main
from refppo.settings.config import Config, apply_overrides, declarations, get_value
from refppo.settings.overrides import command_settings
from refppo.settings.validate import format_value, validate
from refppo.settings.verl_keys import ADDED, ENGINE, MISSING, MISSING_CHOICES, NAMES, RENAMED, UNREAD_BY_VERL
from refppo.settings.verl_map import OTHER_DEFAULTS, REFPPO_ONLY, key_map, verl_command
from refppo.settings.verl_names import full_path, refppo_key, translate, verl_key

# verl 0.9's config keys and defaults, and those its DAPO command lines add
VERL = json.loads((Path(__file__).parent / "data" / "verl_0_9_0_ppo_trainer_keys.json").read_text())["defaults"] | ADDED
# verl 0.9's Megatron configuration (its keys beyond the FSDP one's: Megatron's engine and optimizer)
MEGATRON = json.loads((Path(__file__).parent / "data" / "verl_0_9_0_ppo_megatron_trainer_keys.json").read_text())[
    "defaults"
]
# verl 0.9's VeOmni and TorchTitan configurations (model_engine=veomni / torchtitan), both together
OTHER_ENGINES = {
    key: value
    for engine in ("veomni", "torchtitan")
    for key, value in json.loads(
        (Path(__file__).parent / "data" / f"verl_0_9_0_ppo_{engine}_trainer_keys.json").read_text()
    )["defaults"].items()
}
# the fields of verl 0.9's config dataclasses that its generated YAMLs lack (a line adds them with "+")
DATACLASS_KEYS = {
    key: record["default"]
    for engine in ("", "megatron_", "veomni_", "torchtitan_")
    for key, record in json.loads(
        (Path(__file__).parent / "data" / f"verl_0_9_0_ppo_{engine}trainer_keys.json").read_text()
    )["dataclass_keys"].items()
}
# keys of verl's other configurations (VeOmni, MindSpeed, ...) that its own example scripts set
EXAMPLE_KEYS = {
    item.partition("=")[0].lstrip("+")
    for line in json.loads((Path(__file__).parent / "data" / "verl_0_9_0_examples.json").read_text())["lines"]
    for item in line["settings"]
}
KEYS = list(declarations(Config()))


def test_every_refppo_setting_is_a_verl_key_or_says_why_it_is_not():
    """A shared setting's verl key exists in verl 0.9's config; a refppo-only one does not, and
    has its reason; both spellings name the same setting."""
    for key in KEYS:
        assert refppo_key(verl_key(key)) == key and refppo_key(key) == key
        if key in REFPPO_ONLY:
            assert verl_key(key) not in VERL and REFPPO_ONLY[key]
        else:
            assert verl_key(key) in VERL, key
    assert set(REFPPO_ONLY) <= set(KEYS) and set(OTHER_DEFAULTS) <= set(KEYS)
    assert all(name in KEYS for name in NAMES.values()) and all(full in VERL for full in NAMES)


def _plain(value):
    """A default as a comparable value: numbers as floats, lists as tuples."""
    if isinstance(value, list | tuple):
        return tuple(map(_plain, value))
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


def _same(mine, theirs) -> bool:
    if isinstance(theirs, str) and theirs.startswith("${"):  # verl interpolates another setting
        return mine is None  # as refppo's null does: the setting it stands for
    return _plain(mine) == _plain(theirs)


def test_defaults_equal_verls_or_the_key_map_says_why():
    """Every shared setting's default is verl 0.9's, or the map records verl's default (checked
    here) and the reason refppo's differs."""
    config = Config()
    for key in KEYS:
        if key in REFPPO_ONLY:
            continue
        theirs = VERL[verl_key(key)]
        if key in OTHER_DEFAULTS:
            recorded, why = OTHER_DEFAULTS[key]
            assert _plain(recorded) == _plain(theirs), key
            assert why and not _same(get_value(config, key), theirs), f"{key}: the same default, listed as different"
        else:
            assert _same(get_value(config, key), theirs), f"{key}: {get_value(config, key)!r} against verl's {theirs!r}"


def test_engine_and_missing_settings_are_verl_keys_refppo_does_not_have():
    verl_keys = {**VERL, **MEGATRON, **OTHER_ENGINES, **DATACLASS_KEYS, **dict.fromkeys(EXAMPLE_KEYS)}
    for key in [*ENGINE, *MISSING, *UNREAD_BY_VERL]:
        if key.endswith("."):
            assert any(k.startswith(key) for k in verl_keys), key
        else:
            assert key in verl_keys, key
        assert refppo_key(key) not in KEYS, key
    for key, (off, _) in MISSING.items():  # the value that turns it off is verl's default
        if key not in {**VERL, **MEGATRON, **OTHER_ENGINES, **DATACLASS_KEYS}:  # a key of another configuration
            continue
        theirs = {**DATACLASS_KEYS, **OTHER_ENGINES, **MEGATRON, **VERL}[key]
        if isinstance(theirs, str) and theirs.startswith("${"):  # an interpolation: its fallback
            theirs = theirs.rsplit(",", 1)[1].rstrip("}")
        assert format_value(theirs).lower() == off, key
    assert not set(RENAMED) & set(KEYS)


def test_full_paths_and_short_keys_set_the_same_setting():
    full = apply_overrides(
        Config(),
        [
            "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.rollout.n=4",
            "critic.optim.lr=1e-5",
            "algorithm.rollout_correction.rollout_is=token",
            "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
            "actor_rollout_ref.actor.optim.clip_grad=0.5",
            "reward.reward_model.enable=false",
            "trainer.default_local_dir=runs/x",
            "trainer.resume_mode=auto",
            "trainer.logger=['console','tensorboard']",
        ],
    )
    short = apply_overrides(
        Config(),
        [
            "actor.optim.lr=1e-6",
            "rollout.n=4",
            "critic.optim.lr=1e-5",
            "algorithm.rollout_correction.rollout_is=token",
            "actor.policy_loss=clip",
            "actor.optim.clip_grad=0.5",
            "reward_model.enable=false",
            "trainer.output_dir=runs/x",
            "trainer.resume=true",
            "trainer.logger=console,tensorboard",
        ],
    )
    assert full == short and short.actor.optim.clip_grad == 0.5 and short.trainer.logger == ("console", "tensorboard")


def test_engine_settings_are_noted_and_change_nothing():
    items, notes = translate(
        ["actor_rollout_ref.rollout.name=vllm", "rollout.gpu_memory_utilization=0.4", "trainer.nnodes=1"]
    )
    assert items == [] and len(notes) == 3 and all("has no effect in refppo" in n for n in notes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = apply_overrides(Config(), ["actor_rollout_ref.actor.fsdp_config.param_offload=true"])
    assert config == Config() and "fsdp_config.param_offload=true is a setting of verl's engine" in str(
        caught[0].message
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.gen_batch_size=512", "refppo does not implement a generation batch other than"),
        ("algorithm.use_pf_ppo=true", "preference-feedback PPO"),
        ("trainer.resume_mode=resume_path", "refppo takes auto or disable"),
        ("actor.policy_mode=bypass", "actor.policy_mode is now algorithm.rollout_correction.bypass_mode=true"),
        ("actor.rollout_is_threshold=2", "is now algorithm.rollout_correction.rollout_is_threshold"),
        ("trainer.tensorboard=true", r"is now trainer.logger=\[console,tensorboard\]"),
        # verl's build_optimizer passes the dict to the optimizer (verl/workers/config/optimizer.py)
        ("+actor_rollout_ref.actor.optim.override_optimizer_config.eps=1e-5", "keyword arguments to the optimizer"),
    ],
)
def test_what_refppo_lacks_or_renamed_is_refused_by_name(override, message):
    with pytest.raises(ValueError, match=message):
        apply_overrides(Config(), [override])


# verl 0.9's registries, read from its core_algos.py (register_adv_est, register_policy_loss)
VERL_ESTIMATORS = (
    "gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo", "opo", "grpo_passk",
    "gpg", "rloo_vectorized", "grpo_vectorized", "optimal_token_baseline", "tir_optimal_token_baseline", "gdpo",
)  # fmt: skip
VERL_LOSSES = (
    "vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo",
    "bypass_mode",
)  # fmt: skip


@pytest.mark.parametrize(
    "key, names", [("algorithm.adv_estimator", VERL_ESTIMATORS), ("actor.policy_loss", VERL_LOSSES)]
)
def test_each_name_in_verls_registries_runs_or_is_refused_naming_what_is_missing(key, names):
    from refppo.advantages import ADV_ESTIMATORS
    from refppo.losses import POLICY_LOSSES

    registry = ADV_ESTIMATORS if key == "algorithm.adv_estimator" else POLICY_LOSSES
    for name in names:
        if (key, name) in MISSING_CHOICES:
            with pytest.raises(ValueError, match=f"{key}={name}: refppo does not implement "):
                translate([f"{key}={name}"])
        elif name == "bypass_mode":  # bypass mode's own loss: refppo's in bypass mode, and only there
            with pytest.raises(ValueError, match="give it with algorithm.rollout_correction.bypass_mode=true"):
                translate([f"{key}={name}"])
            lines, notes = translate(["algorithm.rollout_correction.bypass_mode=true", f"{key}={name}"])
            assert lines == ["algorithm.rollout_correction.bypass_mode=true"]
            assert notes == [
                f"{key}={name} is refppo's loss in bypass mode (algorithm.rollout_correction.bypass_mode=true)"
            ]
        else:
            (line,), _ = translate([f"{key}={name}"])
            assert line.partition("=")[2] in registry.names(), name
    assert len([n for k, n in MISSING_CHOICES if k == key]) <= 4, "most of verl's registry is here"


def test_a_missing_feature_at_its_off_value_is_accepted_with_a_note():
    items, notes = translate(["algorithm.use_pf_ppo=False", "trainer.val_only=False"])
    assert items == [] and ["preference-feedback PPO" in notes[0], "validation-only" in notes[1]] == [True, True]


def test_one_setting_in_two_spellings_is_given_twice(capsys, monkeypatch):
    import sys

    from refppo.runs.cli import entry

    argv = ["refppo", "ppo", "actor.optim.lr=1e-5", "actor_rollout_ref.actor.optim.lr=2e-5"]
    monkeypatch.setattr(sys, "argv", argv)
    assert entry() == 2
    assert "actor.optim.lr is given twice ('1e-5' and '2e-5')" in capsys.readouterr().err


def test_the_key_map_covers_every_setting_once():
    rows = key_map()
    assert [r[0] for r in rows] == KEYS
    verl_keys = [r[1] for r in rows if r[1] != "—"]
    assert len(verl_keys) == len(set(verl_keys)) and all(k in VERL for k in verl_keys)
    assert all(r[4] for r in rows if r[1] == "—" or r[3])  # a reason wherever refppo differs


def test_print_verl_names_every_setting_read_in_verls_spelling():
    """``--print-verl`` gives each setting refppo ppo reads by verl's key with the value refppo
    runs with (a null that stands for another setting resolved), and lists the rest; its keys
    read back into the same config."""
    config = validate(
        apply_overrides(
            Config(),
            ["model.path=/m", "actor.clip_ratio=0.1", "actor.clip_ratio_high=0.3", "critic.optim.lr=1e-4"],
        )
    )
    text = verl_command(config)
    lines = text.splitlines()
    assert lines[0] == "python3 -m verl.trainer.main_ppo \\"
    args = [ln.strip().rstrip(" \\") for ln in lines[1:] if not ln.startswith("#")]
    assert (
        "actor_rollout_ref.actor.clip_ratio_low=0.1" in args and "actor_rollout_ref.actor.clip_ratio_high=0.3" in args
    )
    assert "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla" in args and "critic.model.path=/m" in args
    assert "critic.ppo_mini_batch_size=16" in args and "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16" in args
    assert all(a.partition("=")[0] in VERL for a in args), [a for a in args if a.partition("=")[0] not in VERL]
    assert "#   data.task=arithmetic: refppo's offline tasks" in text
    back = validate(apply_overrides(Config(), [a for a in args if not a.startswith("trainer.total_epochs")]))
    assert verl_command(back) == text
    with pytest.raises(ValueError, match="refppo sft has none"):
        verl_command(config, "sft")


# verl 0.9.0's PPO quickstart (docs/start/quickstart.rst), key for key
VERL_PPO_QUICKSTART = """
    data.train_files=$HOME/data/gsm8k/train.parquet
    data.val_files=$HOME/data/gsm8k/test.parquet
    data.train_batch_size=256
    data.max_prompt_length=512
    data.max_response_length=512
    actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=64
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
    critic.optim.lr=1e-5
    critic.model.path=Qwen/Qwen2.5-0.5B-Instruct
    critic.ppo_micro_batch_size_per_gpu=4
    algorithm.kl_ctrl.kl_coef=0.001
    trainer.logger=console
    trainer.val_before_train=False
    trainer.n_gpus_per_node=1
    trainer.nnodes=1
    trainer.save_freq=10
    trainer.test_freq=10
    trainer.total_epochs=15
""".split()
# verl 0.9.0's GRPO example (docs/algo/grpo.md runs examples/grpo_trainer/run_qwen3_8b_fsdp.sh), as
# the shell passes it, with its GPU defaults filled in and the console logger alone (wandb needs an
# account and a network)
VERL_GRPO_EXAMPLE = """
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    data.train_files=['$HOME/data/gsm8k/train.parquet','$HOME/data/math/train.parquet']
    data.val_files=['$HOME/data/gsm8k/test.parquet','$HOME/data/math/test.parquet']
    data.train_batch_size=1024
    data.max_prompt_length=1024
    data.max_response_length=2048
    data.filter_overlong_prompts=True
    data.truncation=error
    actor_rollout_ref.model.path=Qwen/Qwen3-8B
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=256
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    trainer.balance_batch=True
    trainer.logger=["console"]
    trainer.project_name=verl_grpo_gsm8k_math
    trainer.experiment_name=qwen3_8b_grpo_vllm_fsdp
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=20
    trainer.test_freq=5
    trainer.total_epochs=15
""".split()


def _gsm8k_files(folder: Path, names: tuple[str, ...], rows: int) -> None:
    """Parquet files in verl's GSM8K format (examples/data_preprocess/gsm8k.py) whose questions the
    tiny models' character tokenizer can spell."""
    import pandas as pd

    for k, name in enumerate(names):
        records = [
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"what is {i} plus {k}? think step by step."}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(i + k)},
                "extra_info": {"split": name, "index": i},
            }
            for i in range(rows)
        ]
        pd.DataFrame(records).to_parquet(folder / f"{name}.parquet")


def _chat_model(sft_run_folder: Path, folder: Path) -> Path:
    from transformers import AutoTokenizer

    shutil.copytree(sft_run_folder / "model", folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATES["bos"]
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 4096  # rotary positions: any length runs (verl's sizes need 1024 and more)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    runs = tmp_path_factory.mktemp("verl")
    tiny = ["model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2"]
    argv = [
        "sft",
        f"trainer.output_dir={runs / 'sft'}",
        "sft.steps=2",
        "sft.batch_size=8",
        "trainer.progress_bar=false",
    ]
    assert main([*argv, *tiny, "model.num_key_value_heads=1"]) == 0
    return _chat_model(runs / "sft", runs / "chat_model")


def _changed(line: list[str], **values: str) -> list[str]:
    """verl's command line with the named keys' values replaced (model path, data files, steps)."""
    out = []
    for item in line:
        key = item.partition("=")[0]
        out.append(f"{key}={values.pop(key)}" if key in values else item)
    assert not values, f"not in the command line: {values}"
    return out


def test_verls_ppo_quickstart_runs_as_it_is(chat_model, tmp_path, capsys):
    """verl's PPO quickstart with only the model, the data files and the epochs changed: every
    engine setting is noted, the run reads the rest, scores responses by verl's GSM8K rule, and
    runs the steps one epoch of 512 prompts in batches of 256 makes."""
    _gsm8k_files(tmp_path, ("train", "test"), 512)
    line = _changed(
        VERL_PPO_QUICKSTART,
        **{
            "actor_rollout_ref.model.path": str(chat_model),
            "critic.model.path": str(chat_model),
            "data.train_files": str(tmp_path / "train.parquet"),
            "data.val_files": str(tmp_path / "test.parquet"),
            "trainer.total_epochs": "1",
        },
    )
    out = tmp_path / "run"
    assert main(["ppo", *line, f"trainer.default_local_dir={out}", "trainer.progress_bar=false"]) == 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("refppo: note: ")]
    engine = [n for n in notes if n.endswith("is a setting of verl's engine: it has no effect in refppo")]
    assert len(engine) == 5 and "actor_rollout_ref.rollout.name=vllm" in engine[0]
    # verl's quickstart sets a reference micro-batch and a KL coefficient that it never reads (no KL is on)
    unread = [n for n in notes if "(verl leaves it unread too)" in n]
    assert [n.split()[2] for n in unread] == [
        "ref.log_prob_micro_batch_size_per_gpu=4",
        "algorithm.kl_ctrl.kl_coef=0.001",
    ]
    assert notes[-1].endswith("trainer.critic_warmup=0") and len(notes) == 8, notes
    config = json.loads((out / "config.json").read_text())
    assert config["actor"]["optim"]["lr"] == 1e-6 and config["critic"]["ppo_micro_batch_size_per_gpu"] == 4
    # verl's null: the steps of trainer.total_epochs (one epoch of 512 prompts in batches of 256)
    assert config["data"]["task"] == "file" and config["trainer"]["total_training_steps"] is None
    assert config["actor"]["optim"]["weight_decay"] == 0.01 and config["model"]["enable_gradient_checkpointing"]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2], "no evaluation before training (trainer.val_before_train=False)"
    assert "val/score" in rows[-1] and all(0.0 <= r["critic/score/mean"] <= 1.0 for r in rows)


def test_verls_grpo_example_runs_as_it_is(chat_model, tmp_path, capsys):
    """verl's GRPO example (two data files each for training and evaluation), with the model,
    the files, the sizes a CPU can run and the epochs changed."""
    _gsm8k_files(tmp_path, ("train_a", "train_b", "test_a", "test_b"), 16)
    line = _changed(
        VERL_GRPO_EXAMPLE,
        **{
            "actor_rollout_ref.model.path": str(chat_model),
            "data.train_files": f"[{tmp_path / 'train_a.parquet'},{tmp_path / 'train_b.parquet'}]",
            "data.val_files": f"[{tmp_path / 'test_a.parquet'},{tmp_path / 'test_b.parquet'}]",
            "data.train_batch_size": "8",
            "actor_rollout_ref.actor.ppo_mini_batch_size": "4",
            "data.max_prompt_length": "64",
            "data.max_response_length": "4",
            "trainer.total_epochs": "1",
        },
    )
    out = tmp_path / "run"
    assert main(["ppo", *line, f"trainer.default_local_dir={out}", "trainer.progress_bar=false"]) == 0
    assert (
        "actor_rollout_ref.ref.fsdp_config.param_offload=True is a setting of verl's engine" in capsys.readouterr().err
    )
    config = json.loads((out / "config.json").read_text())
    assert config["algorithm"]["adv_estimator"] == "grpo" and config["rollout"]["n"] == 5
    assert config["trainer"]["total_training_steps"] is None  # verl's: one epoch's steps, 32 prompts in batches of 8
    assert len(config["data"]["train_files"]) == 2
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and "actor/kl_loss" in rows[1]


def test_a_record_without_a_rule_is_named_when_nothing_else_scores(chat_model, tmp_path):
    import pandas as pd

    pd.DataFrame(
        [{"prompt": "a", "data_source": "lighteval/MATH", "reward_model": {"ground_truth": "1"}}] * 64
    ).to_parquet(tmp_path / "math.parquet")
    with pytest.raises(ValueError, match="data_source 'lighteval/MATH' has no rule in refppo"):
        main(
            [
                "ppo",
                f"model.path={chat_model}",
                f"data.train_files={tmp_path / 'math.parquet'}",
                f"trainer.output_dir={tmp_path / 'r'}",
            ]
        )
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("so the answer is #### 72", "72", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("#### 5 then #### 6", "6", 1.0),  # the last one
        ("#### 5 then #### 6", "5", 0.0),
        ("the answer is 72", "72", 0.0),  # strict: no ####
        ("####72", "72", 0.0),
        ("#### -3", "-3", 1.0),
        ("#### 72" + " x" * 200, "72", 0.0),  # beyond the last 300 characters
        ("x" * 400 + " #### 72", "72", 1.0),
        ("#### 72.0", "72", 0.0),  # compared as text, as verl does
    ],
)
def test_gsm8k_rule_is_verls(response, truth, score):
    from refppo.tasks.rules import gsm8k_score, rule_reward

    assert gsm8k_score(response, truth) == score
    record = {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": truth}}
    assert rule_reward([""], [response], [record]) == [score]


def test_full_path_adds_verls_prefix_only_to_its_sections():
    assert full_path("actor.optim.lr") == "actor_rollout_ref.actor.optim.lr"
    assert (
        full_path("critic.optim.lr") == "critic.optim.lr" and full_path("model.path") == "actor_rollout_ref.model.path"
    )


def test_micro_batch_rows_beside_token_budgets_are_dropped_from_a_verl_line_with_a_note():
    """verl 0.9 reads ``ppo_micro_batch_size_per_gpu`` and the ``log_prob_micro_batch_size_per_gpu``
    keys only without ``use_dynamic_bsz`` (``verl/workers/actor/dp_actor.py``,
    ``DataParallelPPOActor.update_policy`` and ``compute_log_prob`` split by tokens when it is on),
    and its example scripts set both: a verl line drops them with a note, a refppo line refuses them."""
    line = [
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    ]
    config, notes = command_settings("ppo", line)
    unread = [n.split()[0] for n in notes if "(verl leaves it unread too)" in n]
    assert unread == ["actor.ppo_micro_batch_size_per_gpu=2", "rollout.log_prob_micro_batch_size_per_gpu=4"]
    assert config.actor.ppo_micro_batch_size_per_gpu is None and config.actor.use_dynamic_bsz
    assert config.rollout.log_prob_micro_batch_size_per_gpu is None
    with pytest.raises(ValueError, match="read only with actor.use_dynamic_bsz=false"):
        command_settings("ppo", ["actor.use_dynamic_bsz=true", "actor.ppo_micro_batch_size_per_gpu=2"])


def test_the_rollouts_lengths_are_datas_lengths():
    """verl 0.9's ``actor_rollout_ref.rollout.prompt_length`` / ``response_length`` default to
    ``data.max_prompt_length`` / ``max_response_length`` (``verl/trainer/config/rollout/rollout.yaml``)
    and cap what the engine generates: refppo has one length of each, so they set data's, must
    agree with it when both are given, and ``max_model_len`` is the engine's."""
    config, notes = command_settings(
        "ppo",
        [
            "actor_rollout_ref.rollout.prompt_length=16",
            "actor_rollout_ref.rollout.response_length=12",
            "actor_rollout_ref.rollout.max_model_len=4096",
            "data.max_prompt_length=16",
        ],
    )
    assert (config.data.max_prompt_length, config.data.max_response_length) == (16, 12)
    assert "actor_rollout_ref.rollout.response_length=12 is refppo's data.max_response_length" in notes
    assert any(
        n.startswith("actor_rollout_ref.rollout.max_model_len=4096 is a setting of verl's engine") for n in notes
    )
    with pytest.raises(ValueError, match="rollout.response_length=12 and data.max_response_length=8: .* one length"):
        command_settings("ppo", ["rollout.response_length=12", "data.max_response_length=8"])


def test_a_verl_line_with_bypass_rejection_keeps_its_rejection_and_weights():
    """verl 0.9's ``compute_policy_loss_bypass_mode`` (``verl/trainer/ppo/core_algos.py``) applies
    ``rollout_rs``'s rejection mask and ``rollout_is``'s weights inside the loss, as in
    ``examples/rollout_correction/run_qwen2_5_7b_fsdp_multi_rs.sh``: the line keeps both (dropping
    them as unread would lose what the line exists to show), with REINFORCE when it asks."""
    line = [
        "algorithm.rollout_correction.bypass_mode=true",
        "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_threshold=2.0",
        "algorithm.rollout_correction.loss_type=reinforce",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
    ]
    config, notes = command_settings("ppo", line)
    rc = config.algorithm.rollout_correction
    assert (rc.bypass_mode, rc.rollout_rs, rc.rollout_rs_threshold) == (True, "token_k1", "0.5_2.0")
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.loss_type) == ("token", 2.0, "reinforce")
    assert not any("rollout_correction" in note for note in notes)


def test_token_budgets_take_the_sequence_parallel_size():
    """verl 0.9's ``prepare_micro_batches`` (``verl/workers/engine/utils.py``) fills a micro-batch
    up to ``max_token_len_per_gpu * sp_size`` tokens; refppo, one process per sequence, takes the
    product as its budget (examples/grpo_trainer/run_qwen3_next_80b_a3b_fsdp.sh: 2816 x 8)."""
    line = [
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2816",
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=8",
        "critic.use_dynamic_bsz=true",
        "critic.ppo_max_token_len_per_gpu=2000",
    ]
    config, notes = command_settings("ppo", line)
    assert config.actor.ppo_max_token_len_per_gpu == 2816 * 8
    assert config.critic.ppo_max_token_len_per_gpu == 2000, "the critic's own size, 1, is not the actor's"
    assert any("size of 8 in verl's dp engine: verl's micro-batches hold 22528 tokens" in n for n in notes)
    config, _ = command_settings("ppo", [*line, "critic.ulysses_sequence_parallel_size=2"])
    assert config.critic.ppo_max_token_len_per_gpu == 4000


def test_each_engine_multiplies_the_token_budget_by_its_own_sequence_parallel_size():
    """The ``sp_size`` each verl 0.9 engine gives ``prepare_micro_batches``: VeOmni's Ulysses size
    (``VeOmniEngine``, ``verl/workers/engine/veomni/transformer_impl.py``), Megatron's context-parallel
    size (``MegatronEngine``, ``verl/workers/engine/megatron/transformer_impl.py``); another engine's
    size on the line is not read (examples/grpo_trainer/run_deepseek_v4_veomni.sh: 2560 x 4, one
    sequence of 2048 + 8192 tokens)."""
    budget = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2560"]
    sizes = {
        "veomni": "actor_rollout_ref.actor.veomni.ulysses_parallel_size=4",
        "megatron": "actor_rollout_ref.actor.megatron.context_parallel_size=4",
        "dp": "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=4",
    }
    for engine, size in sizes.items():
        config, _ = command_settings("ppo", [f"model_engine={engine}", *budget, size])
        assert config.actor.ppo_max_token_len_per_gpu == 2560 * 4, engine
        for other in set(sizes.values()) - {size}:
            config, _ = command_settings("ppo", [f"model_engine={engine}", *budget, other])
            assert config.actor.ppo_max_token_len_per_gpu == 2560, (engine, other)


def test_critic_enable_must_agree_with_the_estimator():
    """verl 0.9's ``need_critic`` (``verl/trainer/ppo/utils.py``): ``critic.enable`` when it is set,
    else a critic exactly with GAE; refppo has the second rule alone."""
    config, notes = command_settings("ppo", ["algorithm.adv_estimator=grpo", "rollout.n=2", "critic.enable=False"])
    assert config.algorithm.adv_estimator == "grpo"
    assert "critic.enable=False is refppo's behaviour already with algorithm.adv_estimator=grpo" in notes
    command_settings("ppo", ["critic.enable=true"])
    command_settings("ppo", ["critic.enable=null"])
    for line in (["critic.enable=false"], ["algorithm.adv_estimator=rloo", "rollout.n=2", "critic.enable=true"]):
        with pytest.raises(ValueError, match="refppo trains a critic exactly when the estimator reads one"):
            command_settings("ppo", line)


def test_keys_verl_adds_but_never_reads_are_dropped_with_a_note():
    """verl's SAPO example adds ``+actor_rollout_ref.actor.policy_loss.tau_pos``; its
    ``compute_policy_loss_sapo`` reads ``config.tau_pos`` (``actor.tau_pos``), never the added key."""
    config, notes = command_settings(
        "ppo",
        [
            "actor_rollout_ref.actor.policy_loss.loss_mode=sapo",
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
            "+actor_rollout_ref.actor.policy_loss.tau_pos=3",
        ],
    )
    assert config.actor.tau_pos == 1.0
    assert any(n.endswith("verl's SAPO loss reads actor.tau_pos (verl leaves it unread too)") for n in notes), notes


def _megatron_lr(num_steps: int, lr: float, min_lr: float, warmup: int, style: str) -> float:
    """Megatron-Core's ``OptimizerParamScheduler.get_lr`` as verl 0.9 builds it
    (``get_megatron_optimizer_param_scheduler`` in ``verl/utils/megatron/optimizer.py``: init_lr =
    lr_warmup_init = 0, max_lr = lr), written plainly: a linear warm-up, then the peak for the
    constant style; the floor ``min_lr`` enters only the decaying styles (here: linear)."""
    if warmup > 0 and num_steps <= warmup:
        return lr * num_steps / warmup
    if style == "constant":
        return lr
    return min_lr + (lr - min_lr) * (1 - num_steps / 100)


def test_megatrons_learning_rate_floor_is_unread_with_its_constant_schedule():
    """verl's Megatron line (``examples/grpo_trainer/run_hy_v3_megatron.sh``) sets ``optim.min_lr``
    with the default ``lr_decay_style=constant``: Megatron's scheduler never reads the floor then,
    so the line trains with refppo's constant schedule, which equals Megatron's step for step (a
    floor the reference would show: min_lr moves its linear style). A decaying style is refused."""
    from refppo.training.optim import make_optimizer

    config, notes = command_settings(
        "ppo",
        [
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.optim.lr_warmup_steps=4",
            "actor_rollout_ref.actor.optim.min_lr=1e-4",
            "critic.optim.min_lr=0",
        ],
    )
    assert sum("min_lr=" in n and "(verl leaves it unread too)" in n for n in notes) == 2, notes
    optimizer, scheduler = make_optimizer([torch.nn.Parameter(torch.zeros(1))], config.actor.optim, total_steps=10)
    for step in range(10):
        expected = _megatron_lr(step, lr=1e-3, min_lr=1e-4, warmup=4, style="constant")
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-15, abs=0), step
        optimizer.step()
        scheduler.step()
    assert _megatron_lr(6, lr=1e-3, min_lr=1e-4, warmup=4, style="linear") != _megatron_lr(
        6, lr=1e-3, min_lr=0.0, warmup=4, style="linear"
    )
    with pytest.raises(ValueError, match="lr_decay_style=linear: refppo does not implement Megatron's schedule"):
        command_settings("ppo", ["critic.optim.lr_decay_style=linear"])
    with pytest.raises(ValueError, match="lr_warmup_init=1e-5: refppo does not implement a warm-up from"):
        command_settings("ppo", ["actor_rollout_ref.actor.optim.lr_warmup_init=1e-5"])
    command_settings("ppo", ["actor_rollout_ref.actor.optim.lr_warmup_init=0"])  # 0 is verl's 0.0


def test_a_line_for_ascend_npus_runs_on_the_accelerator_found_as_verls_does():
    """verl's ``main_ppo`` calls ``auto_set_device`` (``verl/utils/device.py``) first: when the
    platform it detects is an accelerator other than ``trainer.device`` names, it runs there with a
    warning. So verl's Ascend lines (``trainer.device=npu``) run on a CUDA GPU; refppo's
    ``trainer.device=auto`` is that choice, with a note."""
    config, notes = command_settings("ppo", ["trainer.device=npu", "algorithm.adv_estimator=grpo"])
    assert config.trainer.device == "auto"
    assert any(n.startswith("trainer.device=npu: verl runs on the accelerator it detects") for n in notes), notes
    with pytest.raises(ValueError, match="trainer.device"):
        command_settings("ppo", ["trainer.device=tpu"])


def test_megatron_lites_configuration_group_is_an_engine_choice():
    """Two verl example lines compose Megatron Lite's actor from its own package
    (``hydra.searchpath=[pkg://verl_mlite.config]``, ``actor@actor_rollout_ref.actor=mlite_actor``):
    its ``mlite_actor.yaml`` (Megatron-LM's ``experimental/lite/examples/verl``) is verl's
    ``actor.yaml`` with Megatron's optimizer and Megatron Lite's engine settings, as verl's own
    ``megatron_actor.yaml`` is with Megatron's engine. The two are noted as engine settings; any
    other search path or group is still refused."""
    line = ["hydra.searchpath=[pkg://verl_mlite.config]", "actor@actor_rollout_ref.actor=mlite_actor"]
    config, notes = command_settings("ppo", [*line, "actor_rollout_ref.actor.optim.lr_decay_style=constant"])
    plain, _ = command_settings("ppo", ["actor_rollout_ref.actor.optim.lr_decay_style=constant"])
    assert config == plain
    assert [n for n in notes if "Megatron Lite" in n] == [
        f"{item} is a setting of verl's engine (Megatron Lite's {what}): it has no effect in refppo"
        for item, what in zip(
            line,
            [
                "configuration package, verl_mlite",
                "actor: verl's actor settings with Megatron's optimizer, trained by Megatron Lite's engine",
            ],
        )
    ]
    with pytest.raises(ValueError, match="refppo does not implement Hydra's own settings"):
        command_settings("ppo", ["hydra.searchpath=[pkg://another.config]"])
    with pytest.raises(ValueError, match="refppo does not implement Hydra's package overrides"):
        command_settings("ppo", ["actor@actor_rollout_ref.actor=another_actor"])


def test_verls_v1_trainer_settings_are_classed_by_what_they_change():
    """verl 0.9's ``main_ppo`` runs its V1 trainer by default (``trainer.use_v1``), whose mode
    (``get_trainer_cls(config.trainer.v1.trainer_mode)``) is synchronous unless set: its
    asynchronous modes train on rollouts of older weights, refused; its ``ReplayBuffer``
    (``verl/trainer/ppo/v1/replay_buffer.py``) says ``max_off_policy_strategy`` does nothing in the
    synchronous mode, noted; a sampler class from a file is refused unless null. The trainer choice
    itself is noted with where the two trainers differ (appendix B.6)."""
    _, notes = command_settings("ppo", ["trainer.use_v1=false"])
    assert notes[0].startswith("trainer.use_v1=false: verl 0.9's V1 trainer (true, its default) and its RayPPOTrainer")
    assert "appendix B.6" in notes[0]
    _, notes = command_settings(
        "ppo",
        [
            "trainer.v1.trainer_mode=sync",
            "trainer.v1.sampler.custom_sampler.name=null",
            "trainer.v1.sampler.max_off_policy_strategy=wait",
        ],
    )
    assert "trainer.v1.trainer_mode=sync is refppo's behaviour already" in notes[0]
    assert "max_off_policy_strategy=wait is a setting of verl's engine" in notes[2]
    with pytest.raises(ValueError, match="does not implement the V1 trainer's asynchronous modes"):
        command_settings("ppo", ["trainer.v1.trainer_mode=separate_async"])
    with pytest.raises(ValueError, match="does not implement a replay-buffer sampler from a file"):
        command_settings("ppo", ["trainer.v1.sampler.custom_sampler.path=my_sampler.py"])


def test_every_key_of_verls_configuration_has_a_class():
    """Each key of verl 0.9's configurations for its four engines (FSDP's, Megatron's, VeOmni's and
    TorchTitan's generated YAMLs, tests/data), and each field of the config dataclasses they build
    that they lack (given with "+"), at its default, is taken, noted as an engine setting, dropped as
    unread, accepted at its off value, or refused naming what refppo lacks: never "unknown config
    key", which is for keys verl lacks too."""
    unknown = []
    for key, value in (OTHER_ENGINES | MEGATRON | VERL).items():
        literal = not isinstance(value, (list, dict)) and not (isinstance(value, str) and value.startswith("${"))
        text = format_value(value) if literal else "null"
        try:
            command_settings("ppo", [f"{key}={text}"])
        except ValueError as error:
            if str(error).startswith("unknown config key"):
                unknown.append(key)
    assert not unknown, unknown
    for key, value in DATACLASS_KEYS.items():
        try:
            command_settings("ppo", [f"+{key}={format_value(value)}"])
        except ValueError as error:
            if str(error).startswith("unknown config key"):
                unknown.append(key)
    assert len(DATACLASS_KEYS) > 450 and not unknown, unknown
    with pytest.raises(ValueError, match="unknown config key 'actor.optim.lrr'; did you mean actor.optim.lr"):
        command_settings("ppo", ["actor_rollout_ref.actor.optim.lrr=1e-6"])  # a typo is still one


VERL_REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Scores as verl's example reward functions do: 1 for the right answer, a dict with extras."""
    seen.append((data_source, extra_info))
    extra_info["touched"] = True  # the record's own extra_info must not change
    return {"score": float(solution_str.strip() == ground_truth), "acc": 1.0}


def plain(data_source, solution_str, ground_truth, extra_info=None):
    return 0.5


def turns(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(extra_info["num_turns"]), "tool_scores": float(len(extra_info["rollout_reward_scores"]))}


seen = []
'''


def test_a_custom_reward_function_file_is_called_as_verls_reward_manager_calls_it(tmp_path):
    """verl 0.9's ``get_custom_reward_fn`` (``verl/trainer/ppo/reward.py``) loads ``name`` from
    ``path``; its naive reward manager calls it with data_source, solution_str, ground_truth and
    extra_info, and takes a dict's "score", keeping its other values by name (reward_extra_info)."""
    from refppo.training.reward_fns import load_verl_reward_fn

    file = tmp_path / "my_reward.py"
    file.write_text(VERL_REWARD_FILE)
    records = [
        {"data_source": "mine", "reward_model": {"ground_truth": "4"}, "extra_info": {"index": i}} for i in range(3)
    ]
    reward = load_verl_reward_fn(str(file), "compute_score")
    assert reward(["p"] * 3, ["4", " 4 ", "5"], records) == {"score": [1.0, 1.0, 0.0], "acc": [1.0, 1.0, 1.0]}
    assert records[0]["extra_info"] == {"index": 0}, "a copy of extra_info is passed"
    assert load_verl_reward_fn(str(file), "plain")(["p"], ["x"], records[:1]) == [0.5]
    # verl's naive manager adds the agent loop's turns (2 in its single-turn loop: the user's, the
    # assistant's) and the tools' reward scores (none) to extra_info
    assert load_verl_reward_fn(str(file), "turns")(["p"], ["x"], records[:1]) == {"score": [2.0], "tool_scores": [0.0]}
    with pytest.raises(ValueError, match="no Python file there"):
        load_verl_reward_fn(str(tmp_path / "absent.py"), "compute_score")
    with pytest.raises(ValueError, match="has no function 'nothing'"):
        load_verl_reward_fn(str(file), "nothing")
    file.write_text("def compute_score(text):\n    return 1.0\n")
    with pytest.raises(ValueError, match=r"cannot be called as fn\(data_source=..."):
        load_verl_reward_fn(str(file), "compute_score")


def test_a_verl_line_with_a_custom_reward_function_trains_on_it(chat_model, tmp_path):
    _gsm8k_files(tmp_path, ("train", "test"), 16)
    file = tmp_path / "my_reward.py"
    file.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.25\n")
    out = tmp_path / "run"
    line = [
        f"actor_rollout_ref.model.path={chat_model}",
        f"data.train_files={tmp_path / 'train.parquet'}",
        f"data.val_files={tmp_path / 'test.parquet'}",
        f"reward.custom_reward_function.path={file}",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "data.max_prompt_length=64",
        "data.max_response_length=4",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        f"trainer.default_local_dir={out}",
        "trainer.progress_bar=false",
    ]
    assert main(["ppo", *line]) == 0
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["critic/score/mean"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="both give the training score"):
        command_settings("ppo", [*line, "reward_model.reward_fn=my.module:fn"])


def test_the_gradient_clip_is_verls_optim_clip_grad():
    """verl 0.9 clips at ``optim.clip_grad`` (``FSDPEngine.optimizer_step`` in
    ``verl/workers/engine/fsdp/transformer_impl.py``); ``FSDPActorConfig.grad_clip`` and the
    critic's have no reader, and ``optim.grad_clip`` is a deprecated spelling that
    ``OptimizerConfig.__post_init__`` copies into ``clip_grad``."""
    config, notes = command_settings(
        "ppo", ["actor_rollout_ref.actor.grad_clip=0.5", "critic.grad_clip=0.25", "critic.optim.clip_grad=2"]
    )
    assert (config.actor.optim.clip_grad, config.critic.optim.clip_grad) == (1.0, 2.0)
    assert sum(n.endswith("optim.clip_grad (verl leaves it unread too)") for n in notes) == 2, notes
    with pytest.raises(
        ValueError, match="actor_rollout_ref.actor.optim.grad_clip is now actor_rollout_ref.actor.optim.clip_grad"
    ):
        command_settings("ppo", ["actor_rollout_ref.actor.optim.grad_clip=0.5"])


def test_the_fields_verls_yaml_lacks_are_classed_by_what_verl_does_with_them():
    """What verl 0.9's code does with a field its YAML lacks: fills it itself (``ActorConfig.__post_init__``
    sets ``engine``; ``ActorRolloutRefWorker.init_model`` in ``verl/workers/engine_workers.py`` sets the
    actor's and reference's ``model_config`` and the reference's batch sizes; ``HFModelConfig.__post_init__``
    what it loads from the model's path), never reads it (the reference's loss settings: its worker
    computes no loss; ``repetition_penalty``: both agent loops sample with 1.0), reads it for its
    engine only (vLLM's sleep mode), or reads it for the numbers refppo lacks (``model_type`` picks the
    engine class in ``EngineRegistry.new``)."""
    line = [
        "+actor_rollout_ref.actor.engine={}",
        "+actor_rollout_ref.actor.model_config.lora_rank=8",
        "+actor_rollout_ref.ref.ppo_micro_batch_size_per_gpu=2",
        "+actor_rollout_ref.model.hf_config=null",
        "+actor_rollout_ref.ref.clip_ratio=0.3",
        "+actor_rollout_ref.ref.policy_loss.loss_mode=gspo",
        "+actor_rollout_ref.rollout.repetition_penalty=1.3",
        "+actor_rollout_ref.rollout.enable_sleep_mode=true",
        "+actor_rollout_ref.model.model_type=language_model",
    ]
    base = ["actor_rollout_ref.actor.optim.lr=1e-6"]
    config, notes = command_settings("ppo", [*base, *line])
    assert config == command_settings("ppo", base)[0]
    said = {}
    for item in line:
        setting = item.lstrip("+")
        said[setting.partition("=")[0]] = next(note for note in notes if note.startswith(setting))
    assert "verl sets it to the role's engine settings" in said["actor_rollout_ref.actor.engine"]
    model_config = said["actor_rollout_ref.actor.model_config.lora_rank"]
    assert "verl sets it to actor_rollout_ref.model's settings" in model_config
    assert "verl sets it from actor.ppo_mini_batch_size" in said["actor_rollout_ref.ref.ppo_micro_batch_size_per_gpu"]
    assert "verl's model config fills it from the model's path" in said["actor_rollout_ref.model.hf_config"]
    assert "the reference model computes no loss" in said["actor_rollout_ref.ref.clip_ratio"]
    assert "the reference model computes no loss" in said["actor_rollout_ref.ref.policy_loss.loss_mode"]
    assert "sample with a repetition penalty of 1.0" in said["actor_rollout_ref.rollout.repetition_penalty"]
    assert "is a setting of verl's engine" in said["actor_rollout_ref.rollout.enable_sleep_mode"]
    assert "it does not implement verl's other model classes" in said["actor_rollout_ref.model.model_type"]
    with pytest.raises(ValueError, match="does not implement verl's other model classes"):
        command_settings("ppo", ["+actor_rollout_ref.model.model_type=value_model"])
    with pytest.raises(ValueError, match="unknown config key 'ref.clip_ratioo'"):
        command_settings("ppo", ["+actor_rollout_ref.ref.clip_ratioo=0.3"])  # a typo under ref. is still one


def _veomni_cosine(step: int, warmup: int, total: int, lr_decay_ratio: float = 1.0, min_ratio: float = 0.0) -> float:
    """VeOmni's ``get_cosine_schedule_with_warmup`` factor (``veomni/optim/lr_scheduler.py``), with
    ``lr_start`` 0, transcribed: verl's VeOmni engine builds it with ``train_steps`` the run's steps and
    ``lr_warmup_ratio`` its ``optim.lr_warmup_steps_ratio``."""
    decay_steps = int(total * lr_decay_ratio)
    if step < warmup:
        return step / max(1, warmup)
    if step > decay_steps:
        return min_ratio
    progress = (step - warmup) / max(1, decay_steps - warmup)
    factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
    return max(0.0, factor * (1 - min_ratio) + min_ratio)


def test_model_engine_takes_its_configurations_defaults():
    """verl 0.9's ``model_engine`` picks the actor's, reference's and critic's configuration groups
    (``defaults`` in ``verl/trainer/config/ppo_trainer.yaml``; ``ppo_megatron_trainer.yaml`` is it with
    ``override model_engine: megatron``). Where an engine's generated configuration (tests/data) gives
    a setting refppo takes another default than FSDP's, :data:`MODEL_ENGINES` has it: VeOmni's
    learning rates decay on a cosine (``optim/veomni.yaml``), which at VeOmni's other defaults is
    refppo's cosine step for step; and every engine but FSDP's seeds the critic's mini-batches with
    the actor's seed unless given (``critic/<engine>_critic.yaml``). VeOmni's scheduler warms up for
    ``lr_warmup_steps_ratio`` only (``VeOmniEngine._build_lr_scheduler``); TorchTitan's engine, whose
    schedule decays linearly, is refused."""
    from refppo.settings.verl_keys import CRITIC_SEED_FROM_ACTOR, MODEL_ENGINES
    from refppo.training.optim import make_optimizer

    data = Path(__file__).parent / "data"
    for engine in ("megatron", "veomni", "torchtitan"):
        theirs = json.loads((data / f"verl_0_9_0_ppo_{engine}_trainer_keys.json").read_text())["defaults"]
        differ = {
            verl_key(key): theirs[verl_key(key)]
            for key in KEYS
            if key not in REFPPO_ONLY and verl_key(key) in theirs and theirs[verl_key(key)] != VERL[verl_key(key)]
        }
        seed = differ.pop("critic.data_loader_seed")
        assert seed == "${oc.select:actor_rollout_ref.actor.data_loader_seed,null}" and engine in CRITIC_SEED_FROM_ACTOR
        assert differ == MODEL_ENGINES.get(engine, differ), engine
    line = ["model_engine=veomni", "actor_rollout_ref.actor.data_loader_seed=7", "actor_rollout_ref.actor.shuffle=true"]
    config, notes = command_settings("ppo", [*line, "actor_rollout_ref.actor.optim.lr_warmup_steps=3"])
    assert (config.actor.optim.lr_scheduler_type, config.critic.optim.lr_scheduler_type) == ("cosine", "cosine")
    assert config.actor.optim.lr_warmup_steps == -1 and config.critic.data_loader_seed == 7
    assert any("lr_warmup_steps=3 is not read: verl's VeOmni engine warms up for" in n for n in notes)
    grpo, _ = command_settings("ppo", [*line, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"])
    assert grpo.actor.optim.lr_scheduler_type == "cosine", "the critic's default is left where there is no critic"
    megatron, notes = command_settings("ppo", ["model_engine=megatron", *line[1:]])
    assert megatron.actor.optim.lr_scheduler_type == "constant" and megatron.critic.data_loader_seed == 7
    assert (megatron.actor.optim.decay_1d_params, megatron.critic.optim.decay_1d_params) == (False, False)
    assert any("actor.optim.decay_1d_params=false, as verl's megatron optimizer" in n for n in notes)
    fsdp, _ = command_settings("ppo", line[1:])
    assert fsdp.critic.data_loader_seed == 42 and fsdp.actor.optim.decay_1d_params
    for total, ratio in ((10, 0.0), (10, 0.3), (7, 0.5)):
        optim = apply_overrides(config, [f"actor.optim.lr_warmup_steps_ratio={ratio}"]).actor.optim
        _, scheduler = make_optimizer([torch.nn.Parameter(torch.zeros(1))], optim, total)
        factor = scheduler.lr_lambdas[0]
        for step in range(total + 1):
            assert factor(step) == pytest.approx(_veomni_cosine(step, int(total * ratio), total), abs=1e-15), step
    with pytest.raises(ValueError, match="does not implement TorchTitan's learning-rate schedule"):
        command_settings("ppo", ["model_engine=torchtitan"])
    with pytest.raises(ValueError, match="does not implement VeOmni's decay over a part of the run"):
        command_settings("ppo", [*line, "actor_rollout_ref.actor.optim.lr_decay_ratio=0.5"])
    replaying, _ = command_settings("ppo", [*line, "actor_rollout_ref.actor.veomni.router_replay.mode=R2"])
    assert replaying.actor.router_replay == "R2", "VeOmni's engine reads its own copy"


def test_engine_keys_that_change_what_verl_computes_are_refused():
    """Keys under verl's engine sections that change what its engines compute, from a read of verl
    0.9's code: the engines' quantisation-aware training (``qat.enable``: the FSDP and Megatron
    engines fake-quantise the linear layers, ``verl/workers/engine/fsdp/transformer_impl.py``),
    vLLM's fully deterministic sampling (``full_determinism``: one seed for every request), an agent
    loop other than the single turn's (``rollout.agent.default_agent_loop``), and, beside a rollout
    correction, ``rollout.calculate_log_probs=false``, without which verl's trainer skips the
    correction (``RayPPOTrainer.fit`` runs ``compute_rollout_correction_and_add_to_batch`` only with
    ``rollout_log_probs`` in the batch). Each is accepted at the value that turns it off."""
    for key, on, off in (
        ("actor_rollout_ref.actor.fsdp_config.qat.enable", "true", "false"),
        ("critic.megatron.qat.enable", "true", "false"),
        ("actor_rollout_ref.rollout.full_determinism", "true", "false"),
        ("actor_rollout_ref.rollout.agent.default_agent_loop", "tool_agent", "single_turn_agent"),
        ("actor_rollout_ref.rollout.agent.agent_loop_config_path", "loops.yaml", "null"),
    ):
        with pytest.raises(ValueError, match=f"{re.escape(key)}={on}: refppo does not implement"):
            command_settings("ppo", [f"{key}={on}"])
        _, notes = command_settings("ppo", [f"{key}={off}"])
        assert notes[0].startswith(f"{key}={off} is refppo's behaviour already")
    correction = "algorithm.rollout_correction.rollout_is=token"
    with pytest.raises(ValueError, match="verl corrects for the sampler only with its log-probs"):
        command_settings("ppo", ["actor_rollout_ref.rollout.calculate_log_probs=false", correction])
    for line in (
        ["actor_rollout_ref.rollout.calculate_log_probs=false"],
        ["actor_rollout_ref.rollout.calculate_log_probs=true", correction],
    ):
        _, notes = command_settings("ppo", line)
        assert "calculate_log_probs" in notes[0] and "setting of verl's engine" in notes[0]


def test_a_long_prompt_is_cut_from_the_left_as_verls_rollout_cuts_it():
    """verl 0.9's ``RLHFDataset`` (``verl/utils/dataset/rl_dataset.py``) stores ``data.truncation``
    and reads it nowhere; ``AgentLoopBase.apply_chat_template``
    (``verl/experimental/agent_loop/agent_loop.py``) cuts a text prompt longer than
    ``rollout.prompt_length`` from the left. A line's right or middle cut is that left cut, with a
    note (examples/grpo_trainer/run_qwen3_5_122b_a10b_megatron.sh); a run takes error or left."""
    for value in ("right", "middle"):
        config, notes = command_settings("ppo", [f"data.truncation={value}"])
        assert config.data.truncation == "left", value
        assert any(f"data.truncation={value}: verl 0.9's rollout cuts a prompt" in note for note in notes), notes
    for value in ("error", "left"):
        assert command_settings("ppo", [f"data.truncation={value}"])[0].data.truncation == value
    config = Config()
    config.data.truncation = "right"
    with pytest.raises(ValueError, match="data.truncation='right' is not one of error, left"):
        validate(config, "ppo")


def test_megatrons_optimizers_print_as_a_megatron_line():
    """``--print-verl`` of a run whose optimizers spare 1-D parameters the weight decay (verl's
    Megatron engine, ``get_megatron_optimizer`` in ``verl/utils/megatron/optimizer.py``) is a
    Megatron line, and its YAML overrides ``model_engine`` as verl's ``ppo_megatron_trainer.yaml``
    does; both read back as the run. One
    model alone sparing them, or a cosine schedule (Megatron's refppo lacks), has no verl line: the
    setting is printed as a comment."""
    from refppo.settings.verl_map import verl_command, verl_yaml

    config, _ = command_settings("ppo", ["model_engine=megatron", "actor_rollout_ref.actor.optim.lr=1e-6"])
    printed = verl_command(config)
    assert "    model_engine=megatron" in printed and "lr_scheduler_type" not in printed
    again, _ = command_settings("ppo", _printed(printed))
    assert (again.actor.optim.decay_1d_params, again.critic.optim.decay_1d_params) == (False, False)
    assert "- ppo_trainer\n- override model_engine: megatron\n- _self_\n" in verl_yaml(config)
    decays = ["actor.optim.weight_decay=0.1", "critic.optim.weight_decay=0.1"]
    assert "model_engine=megatron" in verl_command(
        validate(apply_overrides(Config(), decays[:1] + ["actor.optim.decay_1d_params=false"]), "ppo")
    ), "the critic takes no decay: Megatron's optimizer equals it"
    alone = apply_overrides(Config(), [*decays, "actor.optim.decay_1d_params=false"])
    printed = verl_command(validate(alone, "ppo"))
    assert "model_engine" not in printed
    assert "#   actor.optim.decay_1d_params=false: verl's Megatron engine spares 1-D parameters" in printed
    cosine = apply_overrides(config, ["actor.optim.lr_scheduler_type=cosine"])
    assert "model_engine" not in verl_command(validate(cosine, "ppo"))


def _printed(command: str) -> list[str]:
    """The settings of a printed verl command line (its comments left out)."""
    line = command.split("\n# refppo settings")[0]
    return [item.strip().rstrip("\\").strip() for item in line.splitlines()[1:] if item.strip()]


def test_a_context_shorter_than_prompt_and_response_is_refused():
    """verl 0.9's ``vLLMHttpServer.generate`` (``verl/workers/rollout/vllm_rollout/vllm_async_server.py``)
    caps a response at ``max_model_len`` minus its prompt's tokens; ``SGLangHttpServer.generate``
    (``verl/workers/rollout/sglang_rollout/async_sglang_server.py``) at one token fewer. Below the two
    lengths' sum (plus one for SGLang) a long prompt's response is cut short, which refppo does not do."""
    lengths = ["data.max_prompt_length=100", "data.max_response_length=50"]
    for line, limit in (([], 150), (["actor_rollout_ref.rollout.name=sglang"], 151)):
        command_settings("ppo", [*lengths, *line, f"actor_rollout_ref.rollout.max_model_len={limit}"])
        command_settings("ppo", [*lengths, *line, "actor_rollout_ref.rollout.max_model_len=null"])
        with pytest.raises(ValueError, match=f"max_model_len={limit - 1}: refppo does not implement a context shorter"):
            command_settings("ppo", [*lengths, *line, f"actor_rollout_ref.rollout.max_model_len={limit - 1}"])
    with pytest.raises(ValueError, match="shorter than 1024 tokens"):  # verl's default lengths, 512 and 512
        command_settings("ppo", ["actor_rollout_ref.rollout.max_model_len=1000"])


def test_the_actors_router_replay_is_read_in_its_strategys_engine():
    """verl 0.9's ``ActorRolloutRefWorker.__init__`` (``verl/workers/engine_workers.py``) reads the
    actor's ``router_replay.mode`` in the copy of its strategy, Megatron's or VeOmni's (any other
    strategy replays nothing); R3 replays the rollout's routing, which the rollout returns only with
    ``rollout.enable_rollout_routing_replay``, and ``RayPPOTrainer.fit`` refuses that with R2;
    ``VeOmniActorConfig`` refuses replay without ``use_remove_padding`` (the model's by default)."""
    routes = "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"
    megatron_r3 = "actor_rollout_ref.actor.megatron.router_replay.mode=R3"
    taken = {
        ("model_engine=veomni", "actor_rollout_ref.actor.veomni.router_replay.mode=R2"): "R2",
        ("model_engine=megatron", megatron_r3, routes): "R3",
        ("actor_rollout_ref.actor.strategy=megatron", megatron_r3, routes): "R3",
        (megatron_r3,): "disabled",  # FSDP's strategy
        ("model_engine=veomni", "actor_rollout_ref.actor.megatron.router_replay.mode=R2"): "disabled",
    }
    for line, mode in taken.items():
        config, notes = command_settings("ppo", list(line))
        assert config.actor.router_replay == mode, line
        if mode == "disabled":
            assert any("router_replay.mode" in note and "is not read" in note for note in notes), notes
    with pytest.raises(ValueError, match="R3 replays the rollout's routing, which its rollout returns only with"):
        command_settings("ppo", ["model_engine=megatron", "actor_rollout_ref.actor.megatron.router_replay.mode=R3"])
    with pytest.raises(ValueError, match="verl's trainer refuses the two together"):
        command_settings("ppo", ["model_engine=veomni", "actor_rollout_ref.actor.veomni.router_replay.mode=R2", routes])
    _, notes = command_settings("ppo", [routes])
    assert any("has no effect: no R3 router replay" in note for note in notes)
    veomni_r2 = ["model_engine=veomni", "actor_rollout_ref.actor.veomni.router_replay.mode=R2"]
    for padded in (
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.actor.use_remove_padding=false",
    ):
        with pytest.raises(ValueError, match="verl's VeOmni actor refuses router replay on padded sequences"):
            command_settings("ppo", [*veomni_r2, padded])
    with pytest.raises(ValueError, match="does not implement replaying MoE routing"):
        command_settings("ppo", ["actor_rollout_ref.ref.megatron.router_replay.mode=R2"])
