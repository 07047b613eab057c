"""Run configuration: dataclasses whose dotted keys mirror verl's, dotted overrides, validation.

``Config()`` holds every section; ``refppo sft``, ``refppo rm`` and ``refppo ppo`` each read the
sections they need. Override a value with ``section.key=value`` (``algorithm.gamma=0.99``,
``actor.optim.lr=3e-6``, ``actor.clip_ratio_c=null``). Batch sizes count prompts, as in verl:
a step samples ``data.train_batch_size`` prompts and ``rollout.n`` responses for each.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field

from refppo.advantages import ADV_ESTIMATORS, needs_critic
from refppo.kl import KL_CONTROLLER_TYPES, kl_penalty_types
from refppo.losses import LOSS_AGG_MODES, POLICY_LOSSES
from refppo.prompts import TRUNCATION_MODES

TASKS = ("arithmetic", "preference", "file")
POLICY_MODES = ("decoupled", "bypass", "rollout_correction")
LR_SCHEDULERS = ("constant", "cosine")


@dataclass
class DataConfig:
    """``data.*`` (verl's ``data.*``): where prompts come from, batch size and length limits."""

    task: str = "arithmetic"  # arithmetic | preference | file (prompts from train_files)
    train_files: str | None = None  # JSONL or Parquet with a prompt column: texts or chats (verl's format)
    val_files: str | None = None  # None: the first data.val_size training prompts (seen in training, not held out)
    prompt_key: str = "prompt"
    train_batch_size: int = 64  # prompts per step
    val_size: int = 200  # prompts evaluated (arithmetic's are held out of training; preference has only 56)
    max_prompt_length: int = 16
    max_response_length: int = 8
    truncation: str = "error"


@dataclass
class ModelConfig:
    """``model.*`` (verl's ``actor_rollout_ref.model.*``): the actor's and reference's checkpoint,
    or the shape of a fresh tiny model, and LoRA."""

    path: str | None = None  # a save_pretrained folder; None builds a fresh tiny model
    arch: str = "llama"
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    lora_rank: int = 0  # > 0 trains a LoRA adapter; the reference is then the adapter-disabled actor
    lora_alpha: int = 16
    # SFT's and PPO's log-probs from the final hidden states, the LM head fused into the log-softmax
    # a chunk at a time: no (rows, response, vocab) logits (verl's name; memory for big vocabularies).
    use_fused_kernels: bool = False
    # The actor's updates (and refppo sft's, refppo rm's) keep each decoder layer's input only and
    # recompute the rest in the backward pass: far less activation memory for one more forward pass.
    enable_gradient_checkpointing: bool = False  # verl's default is true


@dataclass
class OptimConfig:
    """``actor.optim.*`` / ``critic.optim.*`` (verl's names under ``actor_rollout_ref.actor.optim``
    and ``critic.optim``): AdamW and verl's schedules (:func:`refppo.optim.make_optimizer`), a
    linear warm-up from 0, then constant, or cosine down to min_lr_ratio x lr at
    trainer.total_training_steps."""

    lr: float = 1e-5
    weight_decay: float = 0.0  # verl's default is 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    lr_warmup_steps: int = -1  # -1: lr_warmup_steps_ratio x trainer.total_training_steps
    lr_warmup_steps_ratio: float = 0.0
    lr_scheduler_type: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0  # the cosine's floor, a share of lr


@dataclass
class ActorConfig:
    """``actor.*`` (verl's ``actor_rollout_ref.actor.*``): the policy loss, KL in the loss, and how
    each batch is split into optimiser steps and forward passes."""

    # Defaults suit the tiny offline models; real checkpoints want ~1e-6 (verl's default).
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-5))
    ppo_mini_batch_size: int = 16  # prompts per optimiser step
    ppo_micro_batch_size_per_gpu: int | None = None  # rows per forward pass; None: the mini-batch
    # Micro-batches by a token budget instead (padding included), rows of similar length together;
    # also for the old-log-prob and reference passes (verl's log_prob_* keys default to these).
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
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
    # The update also computes the entropy without a coefficient (actor/entropy_loss); verl's name.
    calculate_entropy: bool = False
    grad_clip: float = 1.0
    # The log-prob passes (old, reference, update) reduce their logits with kernels made by
    # torch.compile, one per block instead of several float32 passes (verl's name). null: on with
    # CUDA, off on a CPU. The first steps compile them, once per process.
    use_torch_compile: bool | None = None


@dataclass
class RolloutConfig:
    """``rollout.*`` (verl's ``actor_rollout_ref.rollout.*``): sampling, and the micro-batch of the
    old-log-prob pass."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    n: int = 1  # responses per prompt (GRPO / RLOO groups)
    ignore_eos: bool = False  # every response runs to data.max_response_length (benchmarks)
    cuda_graphs: bool | None = None  # decode over a static KV cache replayed as CUDA graphs; null: on with CUDA
    log_prob_micro_batch_size_per_gpu: int | None = None


@dataclass
class RefConfig:
    """``ref.*`` (verl's ``actor_rollout_ref.ref.*``): the reference pass's micro-batch."""

    log_prob_micro_batch_size_per_gpu: int | None = None


@dataclass
class PathConfig:
    """A ``<section>.model.path`` setting (``reward_model.model.path``; ``critic.model`` adds one)."""

    path: str | None = None


@dataclass
class CriticModelConfig(PathConfig):
    """``critic.model.*``: where the critic starts, and activation checkpointing in its updates."""

    enable_gradient_checkpointing: bool = False  # as model.enable_gradient_checkpointing; verl's default is true


@dataclass
class CriticConfig:
    """``critic.*`` (verl's ``critic.*``): the value model, its clipped loss and update schedule."""

    model: CriticModelConfig = field(default_factory=CriticModelConfig)  # path None: the actor's checkpoint, fresh head
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    ppo_epochs: int | None = None  # None: actor.ppo_epochs (verl interpolates the same way)
    ppo_mini_batch_size: int | None = None  # prompts per optimiser step; None: actor.ppo_mini_batch_size
    ppo_micro_batch_size_per_gpu: int | None = None
    use_dynamic_bsz: bool = False  # as actor.use_dynamic_bsz, for the critic's update and values pass
    ppo_max_token_len_per_gpu: int = 32768
    cliprange_value: float | None = 0.5
    loss_agg_mode: str | None = None  # None: actor.loss_agg_mode (verl interpolates the same way)
    loss_scale_factor: float | None = None  # None: actor.loss_scale_factor (as verl 0.9)
    grad_clip: float = 1.0


@dataclass
class RewardModelConfig:
    """``reward_model.*`` (verl's ``reward_model.*``; ``reward_fn`` plays verl's
    ``custom_reward_function``): where scores come from."""

    enable: bool = False  # score with the reward model at model.path
    model: PathConfig = field(default_factory=PathConfig)
    reward_fn: str | None = None  # "package.module:function"; None: the task's own rule
    micro_batch_size_per_gpu: int | None = None
    missing_eos_penalty: float = 0.0  # subtracted from the score of a response that never ended (as TRL)


@dataclass
class KLCtrlConfig:
    """``algorithm.kl_ctrl.*`` (verl's names): the coefficient of the KL in the reward, fixed or
    adaptive."""

    type: str = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: float = 10000.0


@dataclass
class AlgorithmConfig:
    """``algorithm.*`` (verl's ``algorithm.*``): discounting, the advantage estimator and KL in the
    reward."""

    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: str = "gae"
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)


@dataclass
class TrainerConfig:
    """``trainer.*`` (verl's ``trainer.*``): steps, device, the run folder, checkpoints and evaluation."""

    total_training_steps: int = 1500
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    output_dir: str = "runs/ppo"  # the run folder: config, metrics.jsonl, checkpoints
    save_freq: int = 100  # steps between checkpoints (and one at the end); -1: only at the end
    test_freq: int = 100  # steps between evaluations (val/*); -1: never
    resume: bool = False  # continue the run in output_dir from its last checkpoint
    # Steps that update only the critic, as verl's documentation defines it; verl's trainer
    # (actor updated once critic_warmup <= global_steps, counted from 1) runs one fewer.
    critic_warmup: int = 5
    tensorboard: bool = False
    progress_bar: bool = True


@dataclass
class SFTConfig:
    """``sft.*``: ``refppo sft``'s training of the starting policy (refppo's own; verl's SFT trainer
    is a separate program)."""

    steps: int = 600
    batch_size: int = 64
    lr: float = 1e-3
    n_examples: int | None = None  # training examples used; None: all
    # arithmetic: share of carry problems the teacher gets wrong (forgets the carry); 0 is perfect
    teacher_carry_error: float = 0.75


@dataclass
class RMConfig:
    """``rm.*``: ``refppo rm``'s Bradley-Terry training of the reward model (refppo's own)."""

    steps: int = 400
    batch_size: int = 64
    lr: float = 3e-4
    n_pairs: int = 2000
    center: bool = True  # shift the head's bias so SFT samples score 0 on average


@dataclass
class Config:
    """Every section; ``refppo sft``, ``refppo rm`` and ``refppo ppo`` each read the ones they need."""

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


# The valid range of every numeric setting, in interval notation ("inf)" excludes infinity;
# NaN is in no range). A null Optional setting means "derive it" and is not checked here.
_POSITIVE, _COUNT, _NONNEG = "(0, inf)", "[1, inf)", "[0, inf)"
_OPTIM = {
    "lr": _NONNEG, "weight_decay": _NONNEG, "betas": "[0, 1)", "lr_warmup_steps": "-1 or [0, inf)",
    "lr_warmup_steps_ratio": "[0, 1]", "min_lr_ratio": "[0, 1]",
}  # fmt: skip
RANGES = {
    **{f"data.{k}": _COUNT for k in ("train_batch_size", "val_size", "max_prompt_length", "max_response_length")},
    **{f"model.{k}": _COUNT for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")},
    "model.lora_rank": _NONNEG,
    "model.lora_alpha": _POSITIVE,
    **{f"{role}.optim.{k}": v for role in ("actor", "critic") for k, v in _OPTIM.items()},
    "actor.ppo_mini_batch_size": _COUNT,
    "actor.ppo_micro_batch_size_per_gpu": _COUNT,
    "actor.ppo_max_token_len_per_gpu": _COUNT,
    "actor.ppo_epochs": _COUNT,
    "actor.clip_ratio": "[0, 1)",
    "actor.clip_ratio_low": "[0, 1)",
    "actor.clip_ratio_high": _NONNEG,
    "actor.clip_ratio_c": "(1, inf)",
    "actor.loss_scale_factor": _POSITIVE,
    "actor.penalty_kl_coef": _NONNEG,
    "actor.rollout_is_threshold": "(0, inf]",
    "actor.kl_loss_coef": _NONNEG,
    "actor.entropy_coeff": "(-inf, inf)",
    "actor.grad_clip": "(0, inf]",
    "rollout.temperature": _POSITIVE,
    "rollout.top_k": "-1 or [1, inf)",
    "rollout.top_p": "(0, 1]",
    "rollout.n": _COUNT,
    "rollout.log_prob_micro_batch_size_per_gpu": _COUNT,
    "ref.log_prob_micro_batch_size_per_gpu": _COUNT,
    "critic.ppo_epochs": _COUNT,
    "critic.ppo_mini_batch_size": _COUNT,
    "critic.ppo_micro_batch_size_per_gpu": _COUNT,
    "critic.ppo_max_token_len_per_gpu": _COUNT,
    "critic.cliprange_value": _POSITIVE,
    "critic.loss_scale_factor": _POSITIVE,
    "critic.grad_clip": "(0, inf]",
    "reward_model.micro_batch_size_per_gpu": _COUNT,
    "reward_model.missing_eos_penalty": _NONNEG,
    "algorithm.gamma": "[0, 1]",
    "algorithm.lam": "[0, 1]",
    "algorithm.kl_ctrl.kl_coef": _NONNEG,
    "algorithm.kl_ctrl.target_kl": _POSITIVE,
    "algorithm.kl_ctrl.horizon": _POSITIVE,
    "trainer.total_training_steps": _COUNT,
    "trainer.seed": _NONNEG,
    "trainer.save_freq": "-1 or [1, inf)",
    "trainer.test_freq": "-1 or [1, inf)",
    "trainer.critic_warmup": _NONNEG,
    "sft.steps": _COUNT,
    "sft.batch_size": _COUNT,
    "sft.lr": _POSITIVE,
    "sft.n_examples": _COUNT,
    "sft.teacher_carry_error": "[0, 1]",
    "rm.steps": _COUNT,
    "rm.batch_size": _COUNT,
    "rm.lr": _POSITIVE,
    "rm.n_pairs": _COUNT,
}


def in_range(value: float, spec: str) -> bool:
    """Whether ``value`` lies in ``spec``: intervals such as "[0, 1)" or "(0, inf]" and single
    numbers, joined by " or ". NaN lies in none."""
    for part in spec.split(" or "):
        if part[0] not in "[(":
            if value == float(part):
                return True
            continue
        low, high = (float(x) for x in part[1:-1].split(","))
        above = value >= low if part[0] == "[" else value > low
        below = value <= high if part[-1] == "]" else value < high
        if above and below:
            return True
    return False


def leaf_keys(obj, prefix: str = "") -> list[str]:
    """Every dotted key of a config dataclass, e.g. ``actor.optim.lr``, in declaration order."""
    keys = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys += leaf_keys(value, f"{prefix}{f.name}.")
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
    valid = leaf_keys(config)
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"override {item!r} must look like key=value")
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"unknown config key {key!r}{hint}")
        owner, name = _owner(config, key)
        setattr(owner, name, _parse(text.strip(), _hint(config, key), key))
    return config


def _owner(config: Config, key: str):
    """The dataclass holding a dotted key, and the field's name."""
    *parents, name = key.split(".")
    owner = config
    for p in parents:
        owner = getattr(owner, p)
    return owner, name


def _hint(config: Config, key: str):
    owner, name = _owner(config, key)
    return typing.get_type_hints(type(owner))[name]


def _optional(config: Config, key: str) -> bool:
    return type(None) in typing.get_args(_hint(config, key))


def get_value(config: Config, key: str):
    """The value of a dotted key, e.g. ``get_value(config, "actor.optim.lr")``."""
    owner, name = _owner(config, key)
    return getattr(owner, name)


def config_to_dict(config: Config) -> dict:
    """The config as nested plain dicts (what a run saves as config.json)."""
    return dataclasses.asdict(config)


def config_from_dict(values: dict) -> Config:
    """Rebuild a Config from :func:`config_to_dict` output (e.g. a saved config.json)."""
    flat = flatten(values)
    text = lambda v: "null" if v is None else ",".join(map(str, v)) if isinstance(v, list) else v  # noqa: E731
    return apply_overrides(Config(), [f"{k}={text(v)}" for k, v in flat.items()])


def flatten(values: dict, prefix: str = "") -> dict:
    """Nested dicts as one dict with dotted keys: {"actor": {"ppo_epochs": 1}} -> {"actor.ppo_epochs": 1}."""
    out = {}
    for k, v in values.items():
        out |= flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v}
    return out


# The critic settings that are the actor's when unset (verl's config interpolates them).
CRITIC_FROM_ACTOR = ("ppo_epochs", "ppo_mini_batch_size", "loss_agg_mode", "loss_scale_factor")


def critic_setting(config: Config, name: str):
    """``critic.<name>``, or ``actor.<name>`` when unset, for a name in ``CRITIC_FROM_ACTOR``:
    ``ppo_epochs``, ``ppo_mini_batch_size`` (prompts), ``loss_agg_mode``, ``loss_scale_factor``
    (still None when both are: the trainer then divides by ``data.max_response_length``)."""
    value = getattr(config.critic, name)
    return getattr(config.actor, name) if value is None else value


# The policy loss's and the advantage estimator's own settings: read only by the functions that
# declare them (a registered function declares the ones it reads).
_LOSS_SETTINGS = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "penalty_kl_coef", "penalty_kl_type")
_ESTIMATOR_SETTINGS = ("gamma", "lam", "norm_adv_by_std_in_grpo")


def ignored_settings(config: Config) -> dict[str, str]:
    """The settings that another setting of ``config`` turns off, each with what would read it.

    :func:`validate` refuses one that differs from its default, ``refppo ppo`` one given at all,
    and a resumed run may change one (its run never read it either).

    Args:
        config: the settings.

    Returns:
        {dotted key: the condition under which it is read}, e.g.
        ``{"algorithm.kl_ctrl.kl_coef": "algorithm.use_kl_in_reward=true", ...}``.
    """
    d, m, a, alg, rm = config.data, config.model, config.actor, config.algorithm, config.reward_model
    out: dict[str, str] = {}

    def unless(read: bool, keys, needs: str) -> None:
        if not read:
            for key in [keys] if isinstance(keys, str) else keys:
                out.setdefault(key, needs)  # the first reason found is the one given

    def takers(registry, key: str, input_name: str) -> str:
        return f"{key}={' or '.join(n for n in registry.names() if registry.takes(n, input_name))}"

    unless(needs_critic(alg.adv_estimator), [k for k in leaf_keys(config) if k.startswith("critic.")],
           takers(ADV_ESTIMATORS, "algorithm.adv_estimator", "values") + " (an estimator with a critic)")  # fmt: skip
    for name in _ESTIMATOR_SETTINGS:
        unless(ADV_ESTIMATORS.takes(alg.adv_estimator, name), f"algorithm.{name}", takers(ADV_ESTIMATORS, "algorithm.adv_estimator", name))
    for name in _LOSS_SETTINGS:
        unless(POLICY_LOSSES.takes(a.policy_loss, name), f"actor.{name}", takers(POLICY_LOSSES, "actor.policy_loss", name))
    unless(a.clip_ratio_low is None or a.clip_ratio_high is None, "actor.clip_ratio",
           "actor.clip_ratio_low or actor.clip_ratio_high null (both are set)")  # fmt: skip
    unless(a.policy_mode == "rollout_correction", "actor.rollout_is_threshold", "actor.policy_mode=rollout_correction")
    unless(a.policy_mode != "bypass", "rollout.log_prob_micro_batch_size_per_gpu",
           "an actor.policy_mode other than bypass (bypass reuses the sampler's log-probs)")  # fmt: skip
    unless(a.use_kl_loss, ["actor.kl_loss_coef", "actor.kl_loss_type"], "actor.use_kl_loss=true")
    unless(alg.use_kl_in_reward, ["algorithm.kl_penalty", *(f"algorithm.kl_ctrl.{f.name}" for f in dataclasses.fields(KLCtrlConfig))],
           "algorithm.use_kl_in_reward=true")  # fmt: skip
    unless(alg.kl_ctrl.type != "fixed", "algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.type=adaptive or ppo_paper")
    unless(alg.kl_ctrl.type == "adaptive", "algorithm.kl_ctrl.horizon", "algorithm.kl_ctrl.type=adaptive")
    unless(alg.use_kl_in_reward or a.use_kl_loss, "ref.log_prob_micro_batch_size_per_gpu",
           "algorithm.use_kl_in_reward=true or actor.use_kl_loss=true (the reference pass)")  # fmt: skip
    norm = "seq-mean-token-sum-norm"
    critic_norm = needs_critic(alg.adv_estimator) and critic_setting(config, "loss_agg_mode") == norm
    unless(a.loss_agg_mode == norm or (critic_norm and config.critic.loss_scale_factor is None), "actor.loss_scale_factor",
           f"actor.loss_agg_mode={norm}, or a critic whose loss mode is that with critic.loss_scale_factor null")  # fmt: skip
    unless(critic_norm, "critic.loss_scale_factor", f"critic.loss_agg_mode={norm} (null: actor.loss_agg_mode)")
    unless(a.entropy_coeff == 0, "actor.calculate_entropy", "actor.entropy_coeff=0 (a coefficient computes the entropy anyway)")
    for role in ("actor", "critic"):
        r = getattr(config, role)
        unless(r.use_dynamic_bsz, f"{role}.ppo_max_token_len_per_gpu", f"{role}.use_dynamic_bsz=true")
        unless(r.optim.lr_warmup_steps == -1, f"{role}.optim.lr_warmup_steps_ratio", f"{role}.optim.lr_warmup_steps=-1")
        unless(r.optim.lr_scheduler_type == "cosine", f"{role}.optim.min_lr_ratio", f"{role}.optim.lr_scheduler_type=cosine")
    unless(rm.enable, ["reward_model.model.path", "reward_model.micro_batch_size_per_gpu"], "reward_model.enable=true")
    unless(m.lora_rank > 0, "model.lora_alpha", "model.lora_rank > 0")
    unless(d.task == "file", ["data.train_files", "data.val_files", "data.prompt_key"], "data.task=file")
    unless(d.task != "file" or d.val_files is None, "data.val_size", "data.val_files=null (data.val_files holds the evaluation prompts)")
    return out


def ignored_message(setting: str, key: str, needs: str) -> str:
    """The refusal of an ignored setting: ``setting`` as given, its ``key``, and what would read it."""
    return f"{setting} is ignored: {key} is read only with {needs}. Set that, or drop {key}"


def format_value(value) -> str:
    """A setting's value as an override writes it: null, true/false, tuples as 0.9,0.999."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def choices() -> dict[str, tuple[str, ...]]:
    """The valid values of every setting that names one option; the registries' names included,
    so an estimator, policy loss or KL estimator is valid once its module is imported."""
    kl, lr = kl_penalty_types(), LR_SCHEDULERS
    return {
        "data.task": TASKS, "data.truncation": TRUNCATION_MODES, "actor.loss_agg_mode": LOSS_AGG_MODES,
        "critic.loss_agg_mode": LOSS_AGG_MODES, "actor.policy_loss": POLICY_LOSSES.names(),
        "actor.policy_mode": POLICY_MODES, "actor.kl_loss_type": kl, "actor.penalty_kl_type": kl,
        "algorithm.kl_penalty": kl, "algorithm.kl_ctrl.type": KL_CONTROLLER_TYPES,
        "algorithm.adv_estimator": ADV_ESTIMATORS.names(), "actor.optim.lr_scheduler_type": lr,
        "critic.optim.lr_scheduler_type": lr, "trainer.device": ("auto", "cpu", "cuda"),
    }  # fmt: skip


def validate(config: Config) -> Config:
    """Raise ValueError naming the first impossible setting; returns ``config``."""
    d, a, r, alg, t = config.data, config.actor, config.rollout, config.algorithm, config.trainer
    for key, valid in choices().items():
        value = get_value(config, key)
        null = value is None and _optional(config, key)  # derived from another setting
        _require(null or value in valid, f"{key}={value!r} is not one of {', '.join(valid)}")
    for key, spec in RANGES.items():
        value = get_value(config, key)
        for item in value if isinstance(value, tuple) else (value,):
            if item is not None and not in_range(item, spec):
                null = " (or null)" if _optional(config, key) else ""
                raise ValueError(f"{key}={item} is outside its valid range {spec}{null}")
    _require(
        t.critic_warmup < t.total_training_steps,
        f"trainer.critic_warmup={t.critic_warmup} must be < trainer.total_training_steps={t.total_training_steps}: "
        "the actor is updated only after the warm-up",
    )
    for role, mini, micro in [
        ("actor", a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu),
        ("critic", critic_setting(config, "ppo_mini_batch_size"), config.critic.ppo_micro_batch_size_per_gpu),
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
    longest = d.max_prompt_length + d.max_response_length
    for role, cfg, row_keys in [
        ("actor", a, ["actor.ppo_micro_batch_size_per_gpu", "rollout.log_prob_micro_batch_size_per_gpu", "ref.log_prob_micro_batch_size_per_gpu"]),
        ("critic", config.critic, ["critic.ppo_micro_batch_size_per_gpu"]),
    ]:
        if not cfg.use_dynamic_bsz:
            continue
        for key in row_keys:
            _require(
                get_value(config, key) is None,
                f"{role}.use_dynamic_bsz=true sizes micro-batches by {role}.ppo_max_token_len_per_gpu, so {key} would be "
                f"ignored: drop {key} or set {role}.use_dynamic_bsz=false",
            )
        _require(
            cfg.ppo_max_token_len_per_gpu >= longest,
            f"{role}.ppo_max_token_len_per_gpu={cfg.ppo_max_token_len_per_gpu} is less than one sequence can be "
            f"(data.max_prompt_length + data.max_response_length = {longest})",
        )
    _require(not (r.cuda_graphs and t.device == "cpu"), "rollout.cuda_graphs=true needs a CUDA device, not trainer.device=cpu")
    _require(
        a.policy_mode != "rollout_correction" or POLICY_LOSSES.takes(a.policy_loss, "rollout_is_weights"),
        f"actor.policy_mode=rollout_correction weights each token's loss, but actor.policy_loss={a.policy_loss} takes no weights",
    )
    _require(
        alg.adv_estimator != "gae" or d.train_batch_size * r.n >= 2,
        "algorithm.adv_estimator=gae whitens the advantages over the batch's response tokens, and a batch of one "
        "response (data.train_batch_size x rollout.n = 1) holds one token whenever it is only EOS: use >= 2 responses",
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
    _require(
        not (config.reward_model.enable and config.reward_model.reward_fn),
        "reward_model.enable=true and reward_model.reward_fn both give the training score: drop one "
        "(with the reward model, the task's own rule is reported as reward/gold, never trained on)",
    )
    # An option that another one makes meaningless is an error, never silently ignored.
    default = Config()
    for key, needs in ignored_settings(config).items():
        value = get_value(config, key)
        _require(value == get_value(default, key), ignored_message(f"{key}={format_value(value)}", key, needs))
    return config
