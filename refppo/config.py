"""Run configuration: dataclasses whose dotted keys mirror verl's, dotted overrides, validation.

``Config()`` holds every section; ``refppo sft``, ``refppo rm`` and ``refppo ppo`` each read the
sections they need. Override a value with ``section.key=value`` (``algorithm.gamma=0.99``,
``actor.optim.lr=3e-6``, ``actor.clip_ratio_c=null``). Batch sizes count prompts, as in verl:
a step samples ``data.train_batch_size`` prompts and ``rollout.n`` responses for each.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field

from refppo.advantages import ADV_ESTIMATORS
from refppo.kl import KL_CONTROLLER_TYPES, kl_penalty_types
from refppo.losses import LOSS_AGG_MODES, POLICY_LOSSES
from refppo.rollout import TRUNCATION_MODES

TASKS = ("arithmetic", "preference", "file")
POLICY_MODES = ("decoupled", "bypass", "rollout_correction")
LR_SCHEDULERS = ("constant", "cosine")


@dataclass
class DataConfig:
    task: str = "arithmetic"  # arithmetic | preference | file (prompts from train_files)
    train_files: str | None = None  # JSONL or Parquet with a prompt column
    val_files: str | None = None
    prompt_key: str = "prompt"
    train_batch_size: int = 64  # prompts per step
    val_size: int = 200  # held-out prompts evaluated
    max_prompt_length: int = 16
    max_response_length: int = 8
    truncation: str = "error"


@dataclass
class ModelConfig:
    path: str | None = None  # a save_pretrained folder; None builds a fresh tiny model
    arch: str = "llama"
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    lora_rank: int = 0  # > 0 trains a LoRA adapter; the reference is then the adapter-disabled actor
    lora_alpha: int = 16


@dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    lr_warmup_steps: int = 0
    lr_scheduler: str = "constant"  # constant | cosine (to 0 at total_training_steps)


@dataclass
class ActorConfig:
    # Defaults suit the tiny offline models; real checkpoints want ~1e-6 (verl's default).
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-5))
    ppo_mini_batch_size: int = 16  # prompts per optimiser step
    ppo_micro_batch_size_per_gpu: int | None = None  # rows per forward pass; None: the mini-batch
    ppo_epochs: int = 1
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = 3.0  # dual-clip; null turns it off
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm's divisor; None: data.max_response_length
    policy_loss: str = "clip"  # clip | penalty (PPO-penalty: a KL-to-old penalty instead of the clip)
    penalty_kl_coef: float = 0.1
    penalty_kl_type: str = "kl"
    policy_mode: str = "decoupled"  # decoupled | bypass | rollout_correction
    rollout_is_threshold: float = 2.0  # truncation of exp(old - rollout) in rollout_correction
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    grad_clip: float = 1.0


@dataclass
class RolloutConfig:
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    n: int = 1  # responses per prompt (GRPO / RLOO groups)
    ignore_eos: bool = False  # every response runs to data.max_response_length (benchmarks)
    cuda_graphs: bool = False  # CUDA only: decode over a static KV cache replayed as CUDA graphs
    log_prob_micro_batch_size_per_gpu: int | None = None


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int | None = None


@dataclass
class PathConfig:
    path: str | None = None


@dataclass
class CriticConfig:
    model: PathConfig = field(default_factory=PathConfig)  # None: the actor's checkpoint, fresh head
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    ppo_epochs: int | None = None  # None: actor.ppo_epochs (verl interpolates the same way)
    ppo_mini_batch_size: int | None = None  # prompts per optimiser step; None: actor.ppo_mini_batch_size
    ppo_micro_batch_size_per_gpu: int | None = None
    cliprange_value: float | None = 0.5
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None  # as actor.loss_scale_factor
    grad_clip: float = 1.0


@dataclass
class RewardModelConfig:
    enable: bool = False  # score with the reward model at model.path
    model: PathConfig = field(default_factory=PathConfig)
    reward_fn: str | None = None  # "package.module:function"; None: the task's own rule
    micro_batch_size_per_gpu: int | None = None
    missing_eos_penalty: float = 0.0  # subtracted from the score of a response that never ended (as TRL)


@dataclass
class KLCtrlConfig:
    type: str = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: float = 10000.0


@dataclass
class AlgorithmConfig:
    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: str = "gae"
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)


@dataclass
class TrainerConfig:
    total_training_steps: int = 1500
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    output_dir: str = "runs/ppo"  # the run folder: config, metrics.jsonl, checkpoints
    save_freq: int = -1  # steps between checkpoints; -1: only at the end
    test_freq: int = 100  # steps between held-out evaluations; -1: never
    resume: bool = False  # continue the run in output_dir from its last checkpoint
    critic_warmup: int = 5  # steps that update only the critic
    tensorboard: bool = False
    progress_bar: bool = True


@dataclass
class SFTConfig:
    steps: int = 600
    batch_size: int = 64
    lr: float = 1e-3
    n_examples: int | None = None  # training examples used; None: all
    # arithmetic: share of carry problems the teacher gets wrong (forgets the carry); 0 is perfect
    teacher_carry_error: float = 0.75


@dataclass
class RMConfig:
    steps: int = 400
    batch_size: int = 64
    lr: float = 3e-4
    n_pairs: int = 2000
    center: bool = True  # shift the head's bias so SFT samples score 0 on average


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rm: RMConfig = field(default_factory=RMConfig)


def _leaf_keys(obj, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys += _leaf_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def _parse(text: str, hint, key: str):
    """Convert override text to the field's type (bool, int, float, str, their Optional, tuples)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if text.lower() in ("null", "none"):
            return None
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    try:
        if hint is bool:
            if text.lower() not in ("true", "false"):
                raise ValueError
            return text.lower() == "true"
        if typing.get_origin(hint) is tuple:
            return tuple(_parse(part, a, key) for part, a in zip(text.strip("()[]").split(","), args, strict=True))
        return hint(text)
    except ValueError:
        raise ValueError(f"{key}={text!r}: expected {getattr(hint, '__name__', hint)}") from None


def apply_overrides(config: Config, overrides: list[str]) -> Config:
    """Set ``section.key=value`` entries on ``config`` (in place), typed by the dataclass fields.

    Args:
        config: the config to change.
        overrides: "dotted.key=value" strings.

    Returns:
        ``config``.
    """
    valid = _leaf_keys(config)
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"override {item!r} must look like key=value")
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"unknown config key {key!r}{hint}")
        *parents, name = key.split(".")
        owner = config
        for p in parents:
            owner = getattr(owner, p)
        hint = typing.get_type_hints(type(owner))[name]
        setattr(owner, name, _parse(text.strip(), hint, key))
    return config


def config_to_dict(config: Config) -> dict:
    """The config as nested plain dicts (what a run saves as config.json)."""
    return dataclasses.asdict(config)


def config_from_dict(values: dict) -> Config:
    """Rebuild a Config from :func:`config_to_dict` output (e.g. a saved config.json)."""
    flat = []

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat.append(f"{prefix}{k}={'null' if v is None else ','.join(map(str, v)) if isinstance(v, list) else v}")

    walk(values, "")
    return apply_overrides(Config(), flat)


def save_config(config: Config, path) -> None:
    """Write the resolved config as JSON."""
    with open(path, "w") as f:
        json.dump(config_to_dict(config), f, indent=2)


def critic_epochs(config: Config) -> int:
    """``critic.ppo_epochs``, or the actor's when unset."""
    c = config.critic.ppo_epochs
    return config.actor.ppo_epochs if c is None else c


def critic_mini_batch_size(config: Config) -> int:
    """``critic.ppo_mini_batch_size`` (prompts), or the actor's when unset."""
    c = config.critic.ppo_mini_batch_size
    return config.actor.ppo_mini_batch_size if c is None else c


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def validate(config: Config) -> Config:
    """Raise ValueError naming the first impossible setting; returns ``config``."""
    d, a, r, alg, t = config.data, config.actor, config.rollout, config.algorithm, config.trainer
    choices = [
        ("data.task", d.task, TASKS),
        ("data.truncation", d.truncation, TRUNCATION_MODES),
        ("actor.loss_agg_mode", a.loss_agg_mode, LOSS_AGG_MODES),
        ("critic.loss_agg_mode", config.critic.loss_agg_mode, LOSS_AGG_MODES),
        ("actor.policy_loss", a.policy_loss, POLICY_LOSSES.names()),
        ("actor.policy_mode", a.policy_mode, POLICY_MODES),
        ("actor.kl_loss_type", a.kl_loss_type, kl_penalty_types()),
        ("actor.penalty_kl_type", a.penalty_kl_type, kl_penalty_types()),
        ("algorithm.kl_penalty", alg.kl_penalty, kl_penalty_types()),
        ("algorithm.kl_ctrl.type", alg.kl_ctrl.type, KL_CONTROLLER_TYPES),
        ("actor.optim.lr_scheduler", a.optim.lr_scheduler, LR_SCHEDULERS),
        ("critic.optim.lr_scheduler", config.critic.optim.lr_scheduler, LR_SCHEDULERS),
        ("trainer.device", t.device, ("auto", "cpu", "cuda")),
    ]
    for key, value, valid in choices:
        _require(value in valid, f"{key}={value!r} is not one of {', '.join(valid)}")
    ADV_ESTIMATORS.get(alg.adv_estimator)  # raises on an unknown estimator
    for key, value in [
        ("data.train_batch_size", d.train_batch_size),
        ("data.max_prompt_length", d.max_prompt_length),
        ("data.max_response_length", d.max_response_length),
        ("actor.ppo_mini_batch_size", a.ppo_mini_batch_size),
        ("actor.ppo_epochs", a.ppo_epochs),
        ("critic.ppo_mini_batch_size", critic_mini_batch_size(config)),
        ("critic.ppo_epochs", critic_epochs(config)),
        ("rollout.n", r.n),
        ("trainer.total_training_steps", t.total_training_steps),
    ]:
        _require(value >= 1, f"{key} must be >= 1, got {value}")
    for role, mini, micro in [
        ("actor", a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu),
        ("critic", critic_mini_batch_size(config), config.critic.ppo_micro_batch_size_per_gpu),
    ]:
        _require(
            d.train_batch_size % mini == 0,
            f"{role}.ppo_mini_batch_size={mini} must divide data.train_batch_size={d.train_batch_size}",
        )
        rows = mini * r.n
        _require(
            micro is None or (micro >= 1 and rows % micro == 0),
            f"{role}.ppo_micro_batch_size_per_gpu={micro} must divide the mini-batch of {rows} rows "
            f"({role}.ppo_mini_batch_size x rollout.n)",
        )
    penalty = config.reward_model.missing_eos_penalty
    _require(penalty >= 0, f"reward_model.missing_eos_penalty must be >= 0, got {penalty}")
    carry_error = config.sft.teacher_carry_error
    _require(0 <= carry_error <= 1, f"sft.teacher_carry_error must be in [0, 1], got {carry_error}")
    _require(a.clip_ratio_c is None or a.clip_ratio_c > 1, f"actor.clip_ratio_c must be > 1 (or null), got {a.clip_ratio_c}")
    _require(0 <= a.clip_ratio < 1, f"actor.clip_ratio must be in [0, 1), got {a.clip_ratio}")
    _require(r.temperature > 0, f"rollout.temperature must be > 0, got {r.temperature}")
    _require(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1], got {r.top_p}")
    for role, factor in (("actor", a.loss_scale_factor), ("critic", config.critic.loss_scale_factor)):
        _require(factor is None or factor > 0, f"{role}.loss_scale_factor must be > 0 (or null), got {factor}")
    _require(not (r.cuda_graphs and t.device == "cpu"), "rollout.cuda_graphs=true needs a CUDA device, not trainer.device=cpu")
    _require(0 <= alg.gamma <= 1 and 0 <= alg.lam <= 1, "algorithm.gamma and algorithm.lam must be in [0, 1]")
    _require(a.rollout_is_threshold > 0, "actor.rollout_is_threshold must be > 0")
    _require(
        a.policy_mode != "rollout_correction" or POLICY_LOSSES.takes(a.policy_loss, "rollout_is_weights"),
        f"actor.policy_mode=rollout_correction weights each token's loss, but actor.policy_loss={a.policy_loss} takes no weights",
    )
    _require(
        not ADV_ESTIMATORS.takes(alg.adv_estimator, "index") or r.n >= 2,
        f"algorithm.adv_estimator={alg.adv_estimator} compares responses to the same prompt: set rollout.n >= 2",
    )
    _require(
        not (config.reward_model.enable and config.reward_model.model.path is None),
        "reward_model.enable=true needs reward_model.model.path",
    )
    _require(
        not (d.task == "file" and d.train_files is None), "data.task=file needs data.train_files (JSONL or Parquet)"
    )
    return config
