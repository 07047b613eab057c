"""What the settings' declarations (:mod:`refppo.settings.config`) decide: which settings a command reads,
which ones another setting turns off, which a resumed run may change, and whether a config is
possible at all (:func:`validate`)."""

from __future__ import annotations

import dataclasses
import math

import torch

from refppo.advantages import TOKEN_BASELINES
from refppo.algorithms.rollout_correction import is_bounds, rs_thresholds
from refppo.guards.checks import in_range
from refppo.settings.conditions import critic_only_steps, critic_warmup
from refppo.settings.config import ActorConfig, Config, critic_setting, declarations, get_value, is_optional, owner_of
from refppo.settings.declare import Declaration, Site
from refppo.tasks import arithmetic


def defaults_like(config):
    """A config of the same classes as ``config`` (a section replaced by a subclass with more
    settings included), every setting at its default."""
    fresh = type(config)()
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and type(value) is not type(getattr(fresh, f.name)):
            setattr(fresh, f.name, defaults_like(value))
    return fresh


def format_value(value) -> str:
    """A setting's value as an override writes it: null, true/false, tuples as 0.9,0.999."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def choices_of(declaration: Declaration) -> tuple[str, ...] | None:
    """The names a choice setting may take (a registry's, as now registered), or None for a number."""
    valid = declaration.valid
    if callable(valid):
        return valid()
    return valid if isinstance(valid, tuple) else None


def valid_text(declaration: Declaration) -> str:
    """A setting's valid values as ``--help`` shows them: "a | b | c" or an interval."""
    names = choices_of(declaration)
    return " | ".join(names) if names is not None else declaration.valid or ""


def read_settings(command: str, config: Config) -> list[str]:
    """The dotted keys ``refppo <command>`` reads, in declaration order (some only under conditions
    on the others: :func:`ignored_settings`)."""
    return [key for key, d in declarations(config).items() if command in d.commands]


def ignored_settings(config: Config, command: str = "ppo") -> dict[str, str]:
    """The settings ``command`` reads only under a condition the other settings do not meet, each
    with that condition (the first one unmet) as an override says it.

    :func:`validate` refuses one that differs from its default, ``refppo <command>`` one given at
    all, and a resumed run may change one (its run never read it either).

    Returns:
        {dotted key: what would make it read}, e.g. ``{"algorithm.kl_ctrl.kl_coef":
        "algorithm.use_kl_in_reward=true", ...}``.
    """
    out = {}
    for key, d in declarations(config).items():
        if command not in d.commands:
            continue
        site = Site(config, owner_of(config, key)[0], key, command)
        unmet = next((text for needs in d.needs if (text := needs(site)) is not None), None)
        if unmet is not None:
            out[key] = unmet
    return out


def resumable_settings(config: Config) -> set[str]:
    """The settings a resumed run may change: those declared resumable, and those ``config``
    ignores."""
    return {key for key, d in declarations(config).items() if d.resumable} | ignored_settings(config).keys()


def ignored_message(setting: str, key: str, needs: str) -> str:
    """The refusal of an ignored setting: ``setting`` as given, its ``key``, and what would read it."""
    return f"{setting} is ignored: {key} is read only with {needs}. Set that, or drop {key}"


FLOAT32_MAX = torch.finfo(torch.float32).max  # a larger setting overflows in the tensors it enters


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_values(config: Config) -> None:
    """Every setting among its declared choices or in its declared range (null where derived)."""
    for key, d in declarations(config).items():
        value = get_value(config, key)
        if value is None and is_optional(config, key):
            continue
        names = choices_of(d)
        if names is not None:
            for item in value if isinstance(value, tuple) else (value,):
                _require(item in names, f"{key}={item!r} is not one of {', '.join(names)}")
        elif isinstance(d.valid, str):
            for item in value if isinstance(value, tuple) else (value,):
                if isinstance(item, str):
                    continue  # a number's text form (IcePop's "lower_upper") is read by its own parser
                null = " (or null)" if is_optional(config, key) else ""
                _require(in_range(item, d.valid), f"{key}={item} is outside its valid range {d.valid}{null}")
                no_bound = "; for no bound give inf" if d.valid.endswith("inf]") else ""
                _require(
                    not isinstance(item, float) or math.isinf(item) or abs(item) <= FLOAT32_MAX,
                    f"{key}={item} is above float32's largest value {FLOAT32_MAX:.4g}: it would overflow in the "
                    f"float32 tensors it enters{no_bound}",
                )


def _check_batches(config: Config) -> None:
    """Mini-batches divide the batch, micro-batches the mini-batch; a token budget replaces row
    counts and holds the longest sequence."""
    d = config.data
    a = config.actor
    r = config.rollout
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
            micro is None or rows % micro == 0,
            f"{role}.ppo_micro_batch_size_per_gpu={micro} must divide the mini-batch of {rows} rows "
            f"({role}.ppo_mini_batch_size x rollout.n)",
        )
    longest = d.max_prompt_length + d.max_response_length
    for role in ("actor", "critic"):
        cfg = getattr(config, role)
        if not cfg.use_dynamic_bsz:
            continue
        _require(
            cfg.ppo_max_token_len_per_gpu >= longest,
            f"{role}.ppo_max_token_len_per_gpu={cfg.ppo_max_token_len_per_gpu} is less than one sequence can be "
            f"(data.max_prompt_length + data.max_response_length = {longest})",
        )


def _check_task_size(d) -> None:
    """The arithmetic task has (MAX_OPERAND + 1)^2 problems: the held-out ones leave a batch to train on."""
    if d.task != "arithmetic":
        return
    problems = (arithmetic.MAX_OPERAND + 1) ** 2
    _require(
        d.val_size <= problems - d.train_batch_size,
        f"data.val_size={d.val_size} holds out too many of the arithmetic task's {problems} problems: "
        f"data.train_batch_size={d.train_batch_size} must remain to train on",
    )


def _check_tiny_model(m) -> None:
    """The shape of a fresh tiny model (``model.path`` unset) as transformers can build it: whole
    heads, key-value heads shared by equal groups of query heads, an even head size for RoPE."""
    if m.path is not None:
        return
    _require(
        m.hidden_size % m.num_attention_heads == 0,
        f"model.hidden_size={m.hidden_size} must be a multiple of model.num_attention_heads={m.num_attention_heads}",
    )
    _require(
        m.num_attention_heads % m.num_key_value_heads == 0,
        f"model.num_key_value_heads={m.num_key_value_heads} must divide "
        f"model.num_attention_heads={m.num_attention_heads} (each shared by a group of query heads)",
    )
    head = m.hidden_size // m.num_attention_heads
    _require(
        head % 2 == 0,
        f"model.hidden_size / model.num_attention_heads = {head} must be even (rotary embeddings rotate pairs)",
    )


def _check_dapo_and_validation(config: Config) -> None:
    """DAPO's settings (dynamic sampling, overlong shaping), rejection sampling and validation sampling."""
    d = config.data
    alg = config.algorithm
    rm = config.reward_model
    fg = alg.filter_groups
    buffer = rm.overlong_buffer
    _require(
        not fg.enable or fg.metric is not None,
        "algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric (acc, score, seq_reward or "
        "seq_final_reward: the score its groups must vary in)",
    )
    _require(
        not (fg.enable and fg.metric == "seq_final_reward" and alg.use_kl_in_reward),
        "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: the KL penalty needs "
        "the log-prob passes, which run after the filtering; filter on seq_reward (the score)",
    )
    longest = rm.max_resp_len or d.max_response_length
    _require(
        not (rm.reward_manager == "dapo" and buffer.enable) or 0 < buffer.len <= longest,
        f"reward_model.overlong_buffer.len={buffer.len} must be in (0, {longest}] (reward_model.max_resp_len, "
        "null: data.max_response_length): the penalty slopes over the last len tokens",
    )
    if alg.rollout_correction.rollout_is is not None:
        try:
            is_bounds(alg.rollout_correction.rollout_is_threshold)
        except ValueError as error:
            raise ValueError(f"algorithm.rollout_correction.rollout_is_{error}") from None
    if alg.rollout_correction.rollout_rs is not None:
        try:
            rs_thresholds(alg.rollout_correction.rollout_rs, alg.rollout_correction.rollout_rs_threshold)
        except ValueError as error:
            raise ValueError(f"algorithm.rollout_correction.{error}") from None


def _check_policy_loss(a: ActorConfig) -> None:
    """A policy loss's own settings, which it cannot work without."""
    _require(
        a.policy_loss != "dro" or a.dro_beta is not None,
        "actor.policy_loss=dro needs actor.dro_beta (verl's actor.policy_loss.dro_beta), a number > 0",
    )
    _require(
        a.policy_loss != "clip_cov" or a.clip_cov_lb < a.clip_cov_ub,
        f"actor.clip_cov_lb={a.clip_cov_lb} must be below actor.clip_cov_ub={a.clip_cov_ub}",
    )


def _check_estimator_inputs(config: Config) -> None:
    """What verl 0.9's ``compute_advantage`` (``verl/trainer/ppo/ray_trainer.py``) asserts an
    estimator finds in the batch: the optimal token baselines each token's sum of squared
    probabilities, GDPO the reward components it names."""
    alg = config.algorithm
    a = config.actor
    _require(
        alg.adv_estimator not in TOKEN_BASELINES or a.calculate_sum_pi_squared,
        f"algorithm.adv_estimator={alg.adv_estimator} reads each token's sum of squared probabilities: set "
        "actor.calculate_sum_pi_squared=true (verl asserts it too)",
    )
    _require(
        not (a.calculate_sum_pi_squared and config.model.use_fused_kernels),
        "actor.calculate_sum_pi_squared=true with model.use_fused_kernels=true: the fused kernels never form the "
        "logits it sums over (verl refuses it too)",
    )
    if alg.adv_estimator != "gdpo":
        return
    _require(
        bool(alg.gdpo_reward_keys),
        "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys, the components of the reward function's dict "
        "results it normalises one by one (e.g. [accuracy_reward,format_reward])",
    )
    weights = alg.gdpo_reward_weights
    _require(
        weights is None or len(weights) == len(alg.gdpo_reward_keys),
        f"algorithm.gdpo_reward_weights has {len(weights or ())} weights for {len(alg.gdpo_reward_keys)} "
        "algorithm.gdpo_reward_keys: give one each",
    )
    _require(
        not config.reward_model.enable,
        "algorithm.adv_estimator=gdpo reads the components of a reward function's dict results; a reward model "
        "gives one score: set reward_model.enable=false",
    )


def _check_router_replay(config: Config) -> None:
    """What ``actor.router_replay`` needs: R2 an old-log-prob pass to record in; both routers that
    run in Python (no compiled layers, and for R3 no CUDA-graph decoding)."""
    mode = config.actor.router_replay
    if mode == "disabled":
        return
    _require(
        not (mode == "R2" and config.algorithm.rollout_correction.bypass_mode),
        "actor.router_replay=R2 records the routing in the old-log-prob pass, which "
        "algorithm.rollout_correction.bypass_mode=true skips: use R3 (the rollout's routing) or no bypass mode",
    )
    _require(not config.model.compile_layers, f"actor.router_replay={mode} needs model.compile_layers off (or null)")
    if mode == "R3":
        _require(not config.rollout.cuda_graphs, "actor.router_replay=R3 needs rollout.cuda_graphs off (or null)")


def _check_megatron_lora(config: Config) -> None:
    """What Megatron's LoRA (``model.lora.rank > 0``) needs: no PEFT LoRA beside it (the actor
    trains one), and layers that run in Python (its experts' adapters run transformers' eager
    experts loop, whose shapes follow the routing): no compiled layers, no CUDA-graph decoding."""
    m = config.model
    if m.lora.rank == 0:
        return
    _require(
        m.lora_rank == 0 and m.lora_adapter_path is None,
        f"model.lora.rank={m.lora.rank} (Megatron's LoRA) with PEFT's (model.lora_rank={m.lora_rank}, "
        f"model.lora_adapter_path={m.lora_adapter_path}): the actor trains one LoRA; set model.lora.rank=0 or drop "
        "PEFT's",
    )
    _require(not m.compile_layers, f"model.lora.rank={m.lora.rank} needs model.compile_layers off (or null)")
    _require(not config.rollout.cuda_graphs, f"model.lora.rank={m.lora.rank} needs rollout.cuda_graphs off (or null)")


def _check_combinations(config: Config) -> None:
    """Settings each valid alone that cannot work together."""
    _check_tiny_model(config.model)
    _check_router_replay(config)
    _check_megatron_lora(config)
    _check_task_size(config.data)
    _check_dapo_and_validation(config)
    _check_policy_loss(config.actor)
    _check_estimator_inputs(config)
    d = config.data
    r = config.rollout
    alg = config.algorithm
    t = config.trainer
    rm = config.reward_model
    _require(
        t.total_training_steps is not None or t.total_epochs is not None,
        "trainer.total_training_steps=null needs trainer.total_epochs: null counts the steps of its passes",
    )
    warmup = critic_warmup(config)
    _require(
        t.total_training_steps is None or critic_only_steps(warmup) < t.total_training_steps,
        f"trainer.critic_warmup={warmup} must be <= trainer.total_training_steps={t.total_training_steps}: "
        "the actor is first updated at step critic_warmup",
    )
    _require(
        not (r.cuda_graphs and t.device == "cpu"),
        "rollout.cuda_graphs=true needs a CUDA device, not trainer.device=cpu",
    )
    _check_compiled_layers(config)
    _require(
        alg.adv_estimator not in ("gae", "reinforce_plus_plus") or d.train_batch_size * r.n >= 2,
        f"algorithm.adv_estimator={alg.adv_estimator} whitens the advantages over the batch's response tokens, and a "
        "batch of one response (data.train_batch_size x rollout.n = 1) holds one token whenever it is only EOS: "
        "use >= 2 responses",
    )
    _require(
        alg.adv_estimator != "grpo_passk" or r.n >= 2,
        "algorithm.adv_estimator=grpo_passk compares each group's best response with its second: set rollout.n >= 2",
    )
    _require(not (rm.enable and rm.model.path is None), "reward_model.enable=true needs reward_model.model.path")
    _require(
        "console" in t.logger,
        f"trainer.logger={','.join(t.logger)}: refppo always reports on the console (trainer.progress_bar=false "
        "hides the bar); keep console in the list",
    )
    _require(
        not (d.task == "file" and d.train_files is None), "data.task=file needs data.train_files (JSONL or Parquet)"
    )
    _require(
        not (rm.enable and rm.reward_fn),
        "reward_model.enable=true and reward_model.reward_fn both give the training score: drop one "
        "(with the reward model, the task's own rule is reported as reward/gold, never trained on)",
    )
    _require(
        not (rm.reward_fn and rm.custom_reward_function.path),
        "reward_model.reward_fn and reward_model.custom_reward_function.path (verl's "
        "reward.custom_reward_function.path) both give the training score: give one",
    )


def _check_compiled_layers(config: Config) -> None:
    """torch.compile does not take transformers' checkpointed layers."""
    checkpointed = [f"{k}=true" for k, on in _checkpointing_settings(config).items() if on]
    _require(
        not (config.model.compile_layers and checkpointed),
        f"model.compile_layers=true cannot compile the layers that {' and '.join(checkpointed)} checkpoints "
        "(torch.compile does not take transformers' checkpointed layers): set one of them off",
    )


def _checkpointing_settings(config) -> dict[str, bool]:
    """The activation-checkpointing settings of the trained models, by key."""
    return {
        "model.enable_gradient_checkpointing": config.model.enable_gradient_checkpointing,
        "critic.model.enable_gradient_checkpointing": config.critic.model.enable_gradient_checkpointing,
    }


def validate(config: Config, command: str = "ppo") -> Config:
    """Raise ValueError naming the first impossible setting; returns ``config``.

    Each setting must be among its declared choices or in its range, the batch sizes must fit
    together, and a setting that another one turns off for ``command`` must keep its default
    (an option is refused, never silently ignored).
    """
    _check_values(config)
    _require(
        command != "rm" or config.data.task != "arithmetic",
        "refppo rm trains on comparisons: data.task=preference (synthetic ones) or data.task=file with "
        "data.train_files (your own: chosen and rejected responses)",
    )
    _check_combinations(config)
    _check_batches(config)
    default = defaults_like(config)
    for key, needs in ignored_settings(config, command).items():
        value = get_value(config, key)
        _require(value == get_value(default, key), ignored_message(f"{key}={format_value(value)}", key, needs))
    return config
