"""Run configuration: dataclasses whose dotted keys mirror verl's, each setting declared once.

``Config()`` holds every section; ``refppo sft``, ``refppo rm`` and ``refppo ppo`` each read the
settings they need. Override a value with ``section.key=value`` (``algorithm.gamma=0.99``,
``actor.optim.lr=3e-6``, ``actor.clip_ratio_c=null``). Batch sizes count prompts, as in verl:
a step samples ``data.train_batch_size`` prompts and ``rollout.n`` responses for each.

A setting's field is its whole declaration (:func:`refppo.settings.declare.setting`): its default, its valid values (an
interval for a number, the names for a choice), the commands that read it, the conditions on
other settings under which they do, and whether a resumed run may change it. Validation, the
refusal of ignored settings, ``--help`` and the resume check all read these declarations
(:mod:`refppo.settings.validate`), so a new setting is one field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from refppo.advantages import ADV_ESTIMATORS
from refppo.algorithms.bypass import BYPASS_LOSS_TYPES
from refppo.guards.checks import TEMPERATURES
from refppo.kl import KL_CONTROLLER_TYPES, kl_penalty_types
from refppo.losses import LOSS_AGG_MODES, POLICY_LOSSES
from refppo.settings.conditions import (
    ACTOR_NORM,
    ACTOR_ROWS,
    ARITHMETIC,
    BYPASSING,
    CONTINUOUS_TOKEN,
    COSINE,
    CRITIC_NORM,
    CRITIC_ROWS,
    DAPO_MANAGER,
    DECAYING,
    DYNAMIC_BSZ,
    ENDS_AT_EOS,
    ESTIMATOR_TAKES,
    EVALUATING,
    EVALUATION_PROMPTS,
    FILE_TASK,
    FILTERING,
    HAS_CRITIC,
    HELD_OUT_SHARE,
    IS_WEIGHTS,
    KL_CTRL_ADAPTIVE,
    KL_CTRL_TARGET,
    KL_IN_REWARD,
    KL_LOSS,
    LORA,
    LOSS_TAKES,
    MEGATRON_LORA,
    MODEL_FOLDER,
    NO_ENTROPY_BONUS,
    NO_SAVED_ADAPTER,
    NOT_BYPASSING,
    OLD_LOG_PROB_PASS,
    ONE_CLIP_BOUND_UNSET,
    OVERLONG,
    PREFERENCE,
    REFERENCE,
    REJECTING,
    REWARD_FILE,
    REWARD_MODEL,
    RM_FILE,
    RULE_SCORES,
    SHUFFLED,
    TINY_MODEL,
    VAL_SAMPLING,
    WARMUP_BY_RATIO,
    critic_setting,
)
from refppo.settings.declare import (
    apply_overrides,
    declarations,
    flatten,
    get_value,
    is_optional,
    leaf_keys,
    owner_of,
    section,
    setting,
)

# Reading and setting settings by their dotted keys (refppo.settings.declare), with the settings themselves.
__all__ = [
    "Config", "apply_overrides", "config_from_dict", "config_to_dict", "critic_setting", "declarations", "flatten",
    "get_value", "is_optional", "leaf_keys", "owner_of",
]  # fmt: skip

TASKS = ("arithmetic", "preference", "file")
# how refppo.rollout.prompts can cut a prompt longer than its limit (verl's postprocess_data)
TRUNCATION_MODES = ("error", "left", "right", "middle")
# what a prompt longer than data.max_prompt_length gets in a run: refused, or cut from the left, as
# verl 0.9's rollout cuts it whatever its data.truncation says (AgentLoopBase.apply_chat_template)
RUN_TRUNCATIONS = ("error", "left")
ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")
# what a sampled token's recorded log-prob is (vLLM's logprobs_mode, verl's rollout.logprobs_mode;
# refppo.rollout.generation.sample_next_token)
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
# Megatron's names of the linear maps its LoRA adapts (refppo.rollout.megatron_lora), and
# Megatron-Bridge's initialisations of an adapter's A and B
MEGATRON_LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
MEGATRON_LORA_INITS = ("xavier", "kaiming", "normal", "zero")
# verl's continuous-token builder families (verl/utils/tokenizer/continuous_token_wiring.py); "auto"
# picks one from the model's name
CONTINUOUS_TOKEN_FAMILIES = (
    "auto", "default", "qwen", "qwen25", "qwen3", "qwen35", "minimax", "minimaxm2", "minimaxm25", "minimaxm27",
    "glm47", "glm5", "gemma4", "gptoss", "deepseekv4",
)  # fmt: skip
ROLLOUT_IS_LEVELS = ("token", "sequence")
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
LR_SCHEDULERS = ("constant", "cosine")
DEVICES = ("auto", "cpu", "cuda")
LOGGERS = ("console", "file", "tensorboard", "wandb", "mlflow")
COMMANDS = ("sft", "rm", "ppo")
# Numeric ranges in interval notation ("inf)" excludes infinity; NaN is in no range).
POSITIVE = "(0, inf)"
COUNT = "[1, inf)"


def chosen_policy_losses() -> tuple[str, ...]:
    """The names ``actor.policy_loss`` takes: every registered policy loss but bypass mode's own,
    which ``algorithm.rollout_correction.bypass_mode=true`` chooses."""
    return tuple(name for name in POLICY_LOSSES.names() if name != "bypass_mode")


NONNEG = "[0, inf)"
SEED = "[0, 4294967295]"
# Adam's step, up to lr / (1 - beta1) with beta1 < 1 in float64 (a factor below 1e16), must stay a float32
RATE = "[0, 1e10]"
POSITIVE_RATE = "(0, 1e10]"


# ---- the settings ------------------------------------------------------------------------
@dataclass
class ContinuousTokenConfig:
    """``data.continuous_token.*`` (verl's): chat prompts rendered as verl's continuous-token
    rollouts render them. On refppo's single-turn rollout that changes only how a chat becomes
    text: DeepSeek-V4's own encoding for the ``deepseekv4`` family, the tokenizer's chat template
    for every other (:func:`refppo.rollout.prompts.chat_encoding_for`)."""

    enable: bool = setting(False)
    # "auto": DeepSeek-V4's encoding when the model's name says DeepSeek-V4 (deepseek-v4, dsv4), as verl infers it
    model_family: str = setting("auto", CONTINUOUS_TOKEN_FAMILIES, needs=CONTINUOUS_TOKEN)


@dataclass
class DataConfig:
    """``data.*`` (verl's ``data.*``): where prompts come from, batch size and length limits."""

    # file: data.train_files (ppo: prompts; sft: demonstrations; rm: comparisons; refppo.training.user_data)
    task: str = setting("arithmetic", TASKS, commands=COMMANDS)
    # JSONL or Parquet: one file, or several ([a,b]); ppo's prompts are texts or chats (verl's format)
    train_files: tuple[str, ...] | None = setting(None, commands=COMMANDS, needs=FILE_TASK)
    # held-out records; None: ppo evaluates the first data.val_size training prompts, sft and rm
    # hold out data.val_fraction of the training records
    val_files: tuple[str, ...] | None = setting(None, commands=COMMANDS, needs=FILE_TASK)
    val_fraction: float = setting(0.1, "[0, 1)", commands=("sft", "rm"), needs=(FILE_TASK, HELD_OUT_SHARE))
    prompt_key: str = setting("prompt", commands=COMMANDS, needs=FILE_TASK)  # a text or a chat
    # sft: a record is a chat under messages_key, or a prompt and a response (TRL's prompt / completion)
    messages_key: str = setting("messages", commands=("sft",), needs=FILE_TASK)
    response_key: str = setting("completion", commands=("sft",), needs=FILE_TASK)
    # rm: the preferred and the other response of a comparison (texts or chats)
    chosen_key: str = setting("chosen", commands=("rm",), needs=FILE_TASK)
    rejected_key: str = setting("rejected", commands=("rm",), needs=FILE_TASK)
    train_batch_size: int = setting(64, COUNT)  # prompts per step
    # each epoch's prompts in a seeded random order; false: in the files' order (verl's
    # SequentialSampler, create_rl_sampler in verl/trainer/ppo/utils.py)
    shuffle: bool = setting(True)
    # prompts evaluated (arithmetic's are held out of training; preference has only 56); SFT scores
    # one greedy response to each, within the two length limits
    val_size: int = setting(200, COUNT, commands=("sft", "ppo"), needs=EVALUATION_PROMPTS)
    max_prompt_length: int = setting(16, COUNT, commands=COMMANDS, needs=RM_FILE)
    max_response_length: int = setting(8, COUNT, commands=COMMANDS, needs=RM_FILE)
    truncation: str = setting("error", RUN_TRUNCATIONS)
    # drop the prompts longer than data.max_prompt_length instead (verl's; before any truncation);
    # sft and rm: the records whose prompt or responses are longer than the two limits
    filter_overlong_prompts: bool = setting(False, commands=COMMANDS, needs=FILE_TASK)
    # keyword arguments to the tokenizer's chat template wherever a chat prompt is rendered, as
    # verl's (e.g. enable_thinking=false); given one by one: data.apply_chat_template_kwargs.<name>=<value>
    apply_chat_template_kwargs: dict[str, object] = setting(commands=COMMANDS, needs=FILE_TASK, factory=dict)
    # verl's rollouts read it; sft and rm render chats with the chat template
    continuous_token: ContinuousTokenConfig = section(ContinuousTokenConfig, commands=("ppo",), needs=FILE_TASK)


@dataclass
class MegatronLoraConfig:
    """``model.lora.*`` (verl's ``actor_rollout_ref.model.lora.*``, its Megatron engine's LoRA):
    Megatron-Bridge's adapters on the actor, one per fused linear map of Megatron-Core (q, k and v
    together, gate and up together, all of a layer's experts together;
    :mod:`refppo.rollout.megatron_lora`); the reference is the adapter-disabled actor."""

    rank: int = setting(0, NONNEG)  # > 0 trains the adapters
    alpha: int = setting(32, POSITIVE, needs=MEGATRON_LORA)  # each adapter's output is alpha / rank x B A x
    target_modules: tuple[str, ...] = setting(MEGATRON_LORA_TARGETS, MEGATRON_LORA_TARGETS, needs=MEGATRON_LORA)
    lora_A_init_method: str = setting("xavier", MEGATRON_LORA_INITS, needs=MEGATRON_LORA)
    lora_B_init_method: str = setting("zero", MEGATRON_LORA_INITS, needs=MEGATRON_LORA)
    # Megatron's parallel sizes the adapters are built under (verl's actor.megatron.*): Megatron-Bridge
    # 0.5, verl 0.9's, gives each expert-parallel rank its own adapter of its experts, and initialises
    # each tensor-parallel shard of A and B on its own (null expert size: the dense one)
    tensor_model_parallel_size: int = setting(1, COUNT, needs=MEGATRON_LORA)
    expert_model_parallel_size: int = setting(1, COUNT, needs=MEGATRON_LORA)
    expert_tensor_parallel_size: int | None = setting(None, COUNT, needs=MEGATRON_LORA)


@dataclass
class ModelConfig:
    """``model.*`` (verl's ``actor_rollout_ref.model.*``): the actor's and reference's checkpoint,
    or the shape of a fresh tiny model, and LoRA."""

    path: str | None = setting(None, commands=COMMANDS)  # a save_pretrained folder; None: a fresh tiny model
    # run the Python code model.path ships (config.json's auto_map) to build its model and tokenizer;
    # false refuses such a folder. Only for code you trust: it runs as you.
    trust_remote_code: bool = setting(False, commands=COMMANDS, needs=MODEL_FOLDER)
    arch: str = setting("llama", **TINY_MODEL)
    hidden_size: int = setting(128, COUNT, **TINY_MODEL)
    num_hidden_layers: int = setting(2, COUNT, **TINY_MODEL)
    num_attention_heads: int = setting(4, COUNT, **TINY_MODEL)
    num_key_value_heads: int = setting(2, COUNT, **TINY_MODEL)
    # > 0 trains a LoRA adapter; the reference is then the adapter-disabled actor
    lora_rank: int = setting(0, NONNEG, needs=NO_SAVED_ADAPTER, unread_because="it trains every weight")
    lora_alpha: int = setting(16, POSITIVE, needs=(LORA, NO_SAVED_ADAPTER), unread_because="it trains every weight")
    # a saved peft LoRA adapter of model.path to start from (its rank and scale are its own); the
    # reference is still the adapter-disabled actor, model.path itself (verl's ref_in_actor)
    lora_adapter_path: str | None = setting(None, commands=("ppo",))
    # Megatron's LoRA instead of PEFT's (verl's Megatron engine reads these, its FSDP engine lora_rank)
    lora: MegatronLoraConfig = section(MegatronLoraConfig, commands=("ppo",))
    # SFT's and PPO's log-probs from the final hidden states, the LM head fused into the log-softmax
    # a block at a time: no (rows, response, vocab) logits (verl's name; memory for big vocabularies).
    use_fused_kernels: bool = setting(
        False, commands=("sft", "ppo"), resumable=True, unread_because="it trains a scalar head, with no vocabulary"
    )
    # The updates keep each decoder layer's input only and recompute the rest in the backward pass:
    # far less activation memory for one more forward pass. verl's default is true.
    enable_gradient_checkpointing: bool = setting(False, commands=COMMANDS, resumable=True)
    # Each decoder layer of every model in a ppo run compiled by torch.compile, the elementwise work
    # between the matrix products fused (refppo.accel.compiled_layers). null: on with CUDA.
    compile_layers: bool | None = setting(
        None, commands=("ppo",), resumable=True, unread_because="sft and rm keep the eager layers"
    )


@dataclass
class OptimConfig:
    """``actor.optim.*`` / ``critic.optim.*`` (verl's names under ``actor_rollout_ref.actor.optim``
    and ``critic.optim``): AdamW and verl's schedules (:func:`refppo.training.optim.make_optimizer`), a
    linear warm-up from 0, then constant, or cosine down to min_lr_ratio x lr at
    trainer.total_training_steps; weight decay on every parameter (verl's FSDP engine) or on those
    of two or more dimensions (its Megatron engine)."""

    lr: float = setting(1e-5, RATE)
    # at most 1: the decoupled decay multiplies the weights by 1 - lr x weight_decay
    weight_decay: float = setting(0.0, "[0, 1]")  # verl's default is 0.01
    betas: tuple[float, float] = setting((0.9, 0.999), "[0, 1)")
    clip_grad: float = setting(1.0, "(0, inf]")  # the gradient's norm is clipped to this before each step
    lr_warmup_steps: int = setting(-1, "(-inf, inf)")  # <= 0: lr_warmup_steps_ratio x trainer.total_training_steps
    lr_warmup_steps_ratio: float = setting(0.0, "[0, 1]", needs=WARMUP_BY_RATIO)
    lr_scheduler_type: str = setting("constant", LR_SCHEDULERS)
    min_lr_ratio: float = setting(0.0, "[0, 1]", needs=COSINE)  # the cosine's floor, a share of lr
    # false: no weight decay on 1-D parameters (biases, norms' weights), as Megatron-Core's default
    # parameter groups spare them in verl's Megatron engine; true: every parameter, as verl's FSDP engine
    decay_1d_params: bool = setting(True, needs=DECAYING)


@dataclass
class ActorConfig:
    """``actor.*`` (verl's ``actor_rollout_ref.actor.*``): the policy loss, KL in the loss, and how
    each batch is split into optimiser steps and forward passes."""

    # Defaults suit the tiny offline models; real checkpoints want ~1e-6 (verl's default).
    optim: OptimConfig = section(lambda: OptimConfig(lr=5e-5))
    ppo_mini_batch_size: int = setting(16, COUNT)  # prompts per optimiser step
    # rows per forward pass; None: the mini-batch
    ppo_micro_batch_size_per_gpu: int | None = setting(None, COUNT, needs=ACTOR_ROWS, resumable=True)
    # Micro-batches by a token budget instead (padding included), rows of similar length together;
    # also for the old-log-prob and reference passes (verl's log_prob_* keys default to these).
    use_dynamic_bsz: bool = setting(False, resumable=True)
    ppo_max_token_len_per_gpu: int = setting(16384, COUNT, needs=DYNAMIC_BSZ, resumable=True)
    ppo_epochs: int = setting(1, COUNT)
    # each epoch's mini-batches drawn afresh from a seeded order, as textbook PPO does; false: the
    # batch's own order every epoch (verl's default, which keeps GRPO's groups together)
    shuffle: bool = setting(True)
    # the mini-batch order's seed, drawn afresh at every update (verl's make_iterator)
    data_loader_seed: int = setting(42, SEED, needs=SHUFFLED)
    clip_ratio: float = setting(0.2, "[0, 1)", needs=(LOSS_TAKES, ONE_CLIP_BOUND_UNSET))
    # >= 1: no lower bound on the ratio (CISPO's recipe sets 10), as verl accepts
    clip_ratio_low: float | None = setting(None, NONNEG, needs=LOSS_TAKES)
    clip_ratio_high: float | None = setting(None, NONNEG, needs=LOSS_TAKES)
    clip_ratio_c: float | None = setting(3.0, "(1, inf)", needs=LOSS_TAKES)  # dual-clip; null turns it off
    loss_agg_mode: str = setting("token-mean", LOSS_AGG_MODES)
    # seq-mean-token-sum-norm's divisor; None: data.max_response_length
    loss_scale_factor: float | None = setting(None, POSITIVE, needs=ACTOR_NORM)
    # clip (verl's vanilla) | penalty (PPO-penalty: a KL-to-old penalty) | verl's gspo, sapo, cispo,
    # geo_mean, gpg, clip_cov, kl_cov, dro, dppo_tv, dppo_kl
    policy_loss: str = setting("clip", chosen_policy_losses, needs=NOT_BYPASSING)
    penalty_kl_coef: float = setting(0.1, NONNEG, needs=LOSS_TAKES)
    penalty_kl_type: str = setting("kl", kl_penalty_types, needs=LOSS_TAKES)
    tau_pos: float = setting(1.0, POSITIVE, needs=LOSS_TAKES)  # SAPO's gate temperatures (A > 0, A <= 0)
    tau_neg: float = setting(1.05, POSITIVE, needs=LOSS_TAKES)
    # Clip-Cov and KL-Cov (verl's actor.policy_loss.*): the share of tokens cut or penalised, the
    # covariance window of the cut ones, KL-Cov's coefficient
    clip_cov_ratio: float = setting(0.0002, "(0, 1]", needs=LOSS_TAKES)
    clip_cov_lb: float = setting(1.0, "(-inf, inf)", needs=LOSS_TAKES)
    clip_cov_ub: float = setting(5.0, "(-inf, inf)", needs=LOSS_TAKES)
    kl_cov_ratio: float = setting(0.0002, "(0, 1]", needs=LOSS_TAKES)
    ppo_kl_coef: float = setting(0.1, NONNEG, needs=LOSS_TAKES)
    dro_beta: float | None = setting(None, POSITIVE, needs=LOSS_TAKES)  # DRO's penalty on the squared log-ratio
    use_kl_loss: bool = setting(False)
    kl_loss_coef: float = setting(0.001, NONNEG, needs=KL_LOSS)
    kl_loss_type: str = setting("low_var_kl", kl_penalty_types, needs=KL_LOSS)
    entropy_coeff: float = setting(0.0, "(-inf, inf)")
    # The update also computes the entropy without a coefficient (actor/entropy_loss); verl's name.
    calculate_entropy: bool = setting(False, needs=NO_ENTROPY_BONUS)
    # each response token's sum_v pi_v^2 from the old-log-prob pass, which the optimal token
    # baselines read (verl's name)
    calculate_sum_pi_squared: bool = setting(False, needs=OLD_LOG_PROB_PASS)
    # a mixture-of-experts actor's top-k experts fixed through the update (refppo.rollout.router_replay):
    # R2 as the old-log-prob pass routed, R3 as the rollout did (verl's <engine>.router_replay.mode)
    router_replay: str = setting("disabled", ROUTER_REPLAY_MODES)
    # Megatron's router losses, which verl's Megatron engines add on a mixture-of-experts actor where
    # a line turns them on: the load-balancing loss's coefficient (null: the model's own) and the
    # z-loss's. refppo implements neither: a mixture-of-experts actor refuses any but 0; a dense
    # model has no router, and no such loss.
    moe_aux_loss_coeff: float | None = setting(0.0, NONNEG)
    moe_z_loss_coeff: float = setting(0.0, NONNEG)
    # The log-prob passes (old, reference, update) reduce their logits with kernels made by
    # torch.compile, one per block instead of several float32 passes (verl's name). null: on with
    # CUDA, off on a CPU. The first steps compile them, once per process.
    use_torch_compile: bool | None = setting(None, resumable=True)


@dataclass
class ValKwargsConfig:
    """``rollout.val_kwargs.*`` (verl's): the validation pass that verl's ``val-core/*`` metrics
    score: ``n`` responses to each held-out prompt, sampled at this temperature, top_k and top_p,
    or greedy at temperature 0, verl's default (:mod:`refppo.training.validation`). verl's agent
    loop reads them whatever ``val_kwargs.do_sample`` says (``AgentLoopWorkerTQ.generate_sequences``
    in ``verl/trainer/ppo/v1/agent_loop_tq.py``), so refppo has no ``do_sample``."""

    top_k: int = setting(-1, "-1 or [1, inf)", needs=VAL_SAMPLING, resumable=True)
    top_p: float = setting(1.0, "(0, 1]", needs=VAL_SAMPLING, resumable=True)
    # 0: greedy, as verl's engine decodes at temperature 0 (n equal responses to each prompt)
    temperature: float = setting(0.0, f"0 or {TEMPERATURES}", resumable=True)
    n: int = setting(1, COUNT, resumable=True)


@dataclass
class RolloutConfig:
    """``rollout.*`` (verl's ``actor_rollout_ref.rollout.*``): sampling, and the micro-batch of the
    old-log-prob pass."""

    temperature: float = setting(1.0, TEMPERATURES)
    top_k: int = setting(-1, "-1 or [1, inf)")
    top_p: float = setting(1.0, "(0, 1]")
    n: int = setting(1, COUNT)  # responses per prompt (GRPO / RLOO groups)
    ignore_eos: bool = setting(False)  # every response runs to data.max_response_length (benchmarks)
    # the sampled token's recorded log-prob: of the top-k / top-p distribution it was drawn from
    # (verl's default, vLLM's), or of the full one (raw_logprobs); the same without top-k and top-p
    logprobs_mode: str = setting("processed_logprobs", LOGPROBS_MODES)
    # decode over a static KV cache replayed as CUDA graphs; null: on with CUDA
    cuda_graphs: bool | None = setting(None, resumable=True)
    log_prob_micro_batch_size_per_gpu: int | None = setting(
        None, COUNT, needs=(OLD_LOG_PROB_PASS, ACTOR_ROWS), resumable=True
    )
    val_kwargs: ValKwargsConfig = section(ValKwargsConfig, needs=EVALUATING)


@dataclass
class RefConfig:
    """``ref.*`` (verl's ``actor_rollout_ref.ref.*``): the reference pass's micro-batch."""

    log_prob_micro_batch_size_per_gpu: int | None = setting(None, COUNT, needs=(REFERENCE, ACTOR_ROWS), resumable=True)


@dataclass
class PathConfig:
    """A ``<section>.model.path`` setting (``reward_model.model.path``; ``critic.model`` adds one)."""

    path: str | None = setting(None)
    # as model.trust_remote_code, for this folder (the critic's: model.path's when its path is null)
    trust_remote_code: bool = setting(False)


@dataclass
class CriticModelConfig(PathConfig):
    """``critic.model.*``: where the critic starts, and activation checkpointing in its updates."""

    # as model.enable_gradient_checkpointing; verl's default is true
    enable_gradient_checkpointing: bool = setting(False, resumable=True)


@dataclass
class CriticConfig:
    """``critic.*`` (verl's ``critic.*``): the value model, its clipped loss and update schedule.
    Read only with an advantage estimator that reads values."""

    model: CriticModelConfig = section(CriticModelConfig)  # path None: the actor's checkpoint, fresh head
    optim: OptimConfig = section(lambda: OptimConfig(lr=1e-3))
    ppo_epochs: int | None = setting(None, COUNT)  # None: actor.ppo_epochs (verl interpolates the same way)
    ppo_mini_batch_size: int | None = setting(None, COUNT)  # prompts per step; None: actor.ppo_mini_batch_size
    shuffle: bool | None = setting(None)  # None: actor.shuffle (as verl interpolates)
    data_loader_seed: int = setting(42, SEED, needs=SHUFFLED)  # verl's critic has its own, 42 too
    ppo_micro_batch_size_per_gpu: int | None = setting(None, COUNT, needs=CRITIC_ROWS, resumable=True)
    use_dynamic_bsz: bool = setting(False, resumable=True)  # as actor.use_dynamic_bsz, for the update and values
    ppo_max_token_len_per_gpu: int = setting(32768, COUNT, needs=DYNAMIC_BSZ, resumable=True)
    cliprange_value: float | None = setting(0.5, NONNEG)  # verl's: 0 is valid; null is refppo's (no clip)
    loss_agg_mode: str | None = setting(None, LOSS_AGG_MODES)  # None: actor.loss_agg_mode (as verl interpolates)
    loss_scale_factor: float | None = setting(None, POSITIVE, needs=CRITIC_NORM)  # None: actor.loss_scale_factor


@dataclass
class OverlongBufferConfig:
    """``reward_model.overlong_buffer.*`` (verl's ``reward.reward_kwargs.overlong_buffer_cfg.*``):
    DAPO's soft overlong punishment (:func:`refppo.algorithms.overlong.overlong_penalty`)."""

    enable: bool = setting(False)
    len: int = setting(0, NONNEG, needs=OVERLONG)  # the last len tokens of data.max_response_length
    penalty_factor: float = setting(0.0, NONNEG, needs=OVERLONG)  # the penalty at the limit
    log: bool = setting(False, needs=OVERLONG, resumable=True)  # report it (reward/overlong_reward/mean, ...)


@dataclass
class CustomRewardFunctionConfig:
    """``reward_model.custom_reward_function.*`` (verl's ``reward.custom_reward_function.*``): a
    reward function in a Python file, called for each response as verl's reward managers call it,
    ``name(data_source=..., solution_str=..., ground_truth=..., extra_info=...)``
    (:func:`refppo.training.reward_fns.load_verl_reward_fn`)."""

    path: str | None = setting(None, needs=RULE_SCORES)  # a .py file; null: none
    name: str = setting("compute_score", needs=REWARD_FILE)  # the function in it


@dataclass
class RewardModelConfig:
    """``reward_model.*`` (verl's ``reward_model.*``; ``reward_fn`` plays verl's
    ``custom_reward_function``): where scores come from."""

    enable: bool = setting(False)  # score with the reward model at model.path
    model: PathConfig = section(PathConfig, needs=REWARD_MODEL)
    reward_fn: str | None = setting(None)  # "package.module:function"; None: the task's own rule
    custom_reward_function: CustomRewardFunctionConfig = section(CustomRewardFunctionConfig)  # verl's: from a file
    micro_batch_size_per_gpu: int | None = setting(None, COUNT, needs=REWARD_MODEL, resumable=True)
    # subtracted from the score of a response that never ended (as TRL); with rollout.ignore_eos
    # every response runs to the limit, and the penalty would shift every score alike
    missing_eos_penalty: float = setting(0.0, NONNEG, needs=ENDS_AT_EOS)
    # verl's reward manager: dapo adds the overlong shaping to a rule's (or reward_fn's) score
    # gdpo: naive's, whose dict results' other values GDPO reads (as every manager here keeps them)
    reward_manager: str = setting("naive", ("naive", "dapo", "gdpo"), needs=RULE_SCORES)
    overlong_buffer: OverlongBufferConfig = section(OverlongBufferConfig, needs=DAPO_MANAGER)
    max_resp_len: int | None = setting(None, COUNT, needs=(DAPO_MANAGER, OVERLONG))  # null: data.max_response_length


@dataclass
class KLCtrlConfig:
    """``algorithm.kl_ctrl.*`` (verl's names): the coefficient of the KL in the reward, fixed or
    adaptive."""

    type: str = setting("fixed", KL_CONTROLLER_TYPES)
    kl_coef: float = setting(0.001, NONNEG)
    target_kl: float = setting(0.1, POSITIVE, needs=KL_CTRL_TARGET)
    horizon: float = setting(10000.0, POSITIVE, needs=KL_CTRL_ADAPTIVE)


@dataclass
class RolloutCorrectionConfig:
    """``algorithm.rollout_correction.*`` (verl's names, ch 6.5): the sampler's log-probs against the
    trainer's. ``bypass_mode`` takes the sampler's as pi_old and runs no old-log-prob pass;
    otherwise ``rollout_is`` weights each token's policy loss by the truncated importance weight
    pi_old / pi_rollout, of the token or of the whole sequence
    (:func:`refppo.algorithms.rollout_correction.compute_rollout_is_weights`)."""

    # null: no weights. In bypass mode the loss computes them and the rejection below against the
    # policy being updated, in each micro-batch (refppo.algorithms.bypass), as verl 0.9 does.
    rollout_is: str | None = setting(None, ROLLOUT_IS_LEVELS)
    # the weights' truncation C, or "lower_upper": IcePop's bounds outside which a weight is 0
    rollout_is_threshold: float | str = setting(2.0, "(0, inf]", needs=IS_WEIGHTS)
    rollout_is_batch_normalize: bool = setting(False, needs=IS_WEIGHTS)  # divide by their batch mean
    # rejection sampling: comma-separated criteria (refppo.algorithms.rollout_correction.RS_OPTIONS) and their
    # bounds, one for all or one each ("0.5_2.0" bounds a k1 ratio; the others take an upper bound)
    rollout_rs: str | None = setting(None)
    rollout_rs_threshold: str | None = setting(None, needs=REJECTING)
    bypass_mode: bool = setting(False)
    # bypass mode's loss: PPO's clip (the ratio to pi_rollout, weights only logged) or REINFORCE
    # with the weights in the loss (refppo.algorithms.bypass.compute_policy_loss_reinforce)
    loss_type: str = setting("ppo_clip", BYPASS_LOSS_TYPES, needs=BYPASSING)


@dataclass
class FilterGroupsConfig:
    """``algorithm.filter_groups.*`` (verl's): DAPO's dynamic sampling
    (:class:`refppo.training.dynamic_sampling.DynamicSampling`)."""

    enable: bool = setting(False)
    # the score the group must vary in: acc, score and seq_reward are each response's score here;
    # seq_final_reward the same without KL in the reward (which needs passes that run after filtering)
    metric: str | None = setting(None, FILTER_METRICS, needs=FILTERING)
    max_num_gen_batches: int = setting(0, NONNEG, needs=FILTERING, resumable=True)  # 0: no limit


@dataclass
class AlgorithmConfig:
    """``algorithm.*`` (verl's ``algorithm.*``): discounting, the advantage estimator and KL in the
    reward."""

    gamma: float = setting(1.0, "[0, 1]", needs=ESTIMATOR_TAKES)
    lam: float = setting(1.0, "[0, 1]", needs=ESTIMATOR_TAKES)
    adv_estimator: str = setting("gae", ADV_ESTIMATORS.names)
    norm_adv_by_std_in_grpo: bool = setting(True, needs=ESTIMATOR_TAKES)
    # GDPO: the reward function's components it normalises one by one (the keys of its dict
    # results), and their weights in the sum (null: 1 each)
    gdpo_reward_keys: tuple[str, ...] | None = setting(None, needs=ESTIMATOR_TAKES)
    gdpo_reward_weights: tuple[float, ...] | None = setting(None, "(-inf, inf)", needs=ESTIMATOR_TAKES)
    use_kl_in_reward: bool = setting(False)
    kl_penalty: str = setting("kl", kl_penalty_types, needs=KL_IN_REWARD)
    kl_ctrl: KLCtrlConfig = section(KLCtrlConfig, needs=KL_IN_REWARD)
    rollout_correction: RolloutCorrectionConfig = section(RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = section(FilterGroupsConfig)


@dataclass
class TrainerConfig:
    """``trainer.*`` (verl's ``trainer.*``): steps, device, the run folder, checkpoints and evaluation."""

    # the run's length and the learning-rate schedules'; null (verl's default): the steps that
    # trainer.total_epochs passes over the prompts make
    total_training_steps: int | None = setting(1500, COUNT, resumable=True)
    # below 2**32 as numpy's seeds: refppo derives further seeds from it by adding offsets
    seed: int = setting(0, SEED, commands=COMMANDS)
    device: str = setting("auto", DEVICES, commands=COMMANDS, resumable=True)
    output_dir: str = setting("runs/ppo", commands=COMMANDS, resumable=True)  # the run folder
    # steps between checkpoints (and one at the end); -1: only at the end
    save_freq: int = setting(100, "-1 or [1, inf)", resumable=True)
    test_freq: int = setting(100, "-1 or [1, inf)", resumable=True)  # steps between evaluations (val/*); -1: never
    # an evaluation at step 0, the SFT level, whatever test_freq says (verl's fit)
    val_before_train: bool = setting(True, resumable=True)
    # validation responses written to val_generations.jsonl at each validation, chosen as verl does
    log_val_generations: int = setting(0, NONNEG, needs=EVALUATING, resumable=True)
    # continue the run in output_dir from its last checkpoint
    resume: bool = setting(False, resumable=True, unread_because="it saves no checkpoints")
    # verl's count: the actor is updated from step critic_warmup on (steps counted from 1), so
    # critic_warmup - 1 steps update only the critic (critic_only_steps); 0 and 1 warm up nothing.
    # As in verl, it delays the actor without a critic too. null: refppo's default, 6 with a critic
    # (this book's fresh value heads need them) and 0 without (conditions.critic_warmup)
    critic_warmup: int | None = setting(None, NONNEG)
    # verl's: the run also ends after this many passes over the training prompts (whole batches,
    # as verl's loader drops the last partial one); null: trainer.total_training_steps alone
    total_epochs: int | None = setting(None, COUNT, resumable=True)
    # verl's: console (the progress, always), file (metrics.jsonl, always), and in the run folder,
    # offline: tensorboard, wandb, mlflow (refppo.runs.loggers)
    logger: tuple[str, ...] = setting(("console",), LOGGERS, commands=COMMANDS, resumable=True)
    project_name: str = setting("refppo", commands=COMMANDS, resumable=True)  # wandb's project, MLflow's experiment
    experiment_name: str | None = setting(None, commands=COMMANDS, resumable=True)  # null: the run folder's name
    progress_bar: bool = setting(True, commands=COMMANDS, resumable=True)


@dataclass
class SFTConfig:
    """``sft.*``: ``refppo sft``'s training of the starting policy (refppo's own; verl's SFT trainer
    is a separate program)."""

    steps: int = setting(600, COUNT)
    batch_size: int = setting(64, COUNT)
    lr: float = setting(1e-3, POSITIVE_RATE)
    n_examples: int | None = setting(None, COUNT)  # training examples used; None: all
    # arithmetic: share of carry problems the teacher gets wrong (forgets the carry); 0 is perfect
    teacher_carry_error: float = setting(0.75, "[0, 1]", needs=ARITHMETIC)


@dataclass
class RMConfig:
    """``rm.*``: ``refppo rm``'s Bradley-Terry training of the reward model (refppo's own)."""

    steps: int = setting(400, COUNT)
    batch_size: int = setting(64, COUNT)
    lr: float = setting(3e-4, POSITIVE_RATE)
    n_pairs: int = setting(2000, COUNT, needs=PREFERENCE)  # synthetic comparisons
    # shift the head's bias so that SFT samples (data.task=preference) or the training pairs'
    # responses (data.task=file) score 0 on average
    center: bool = setting(True)


@dataclass
class Config:
    """Every section; ``refppo sft``, ``refppo rm`` and ``refppo ppo`` each read the ones they need."""

    data: DataConfig = section(DataConfig)
    model: ModelConfig = section(ModelConfig)
    actor: ActorConfig = section(ActorConfig)
    rollout: RolloutConfig = section(RolloutConfig)
    ref: RefConfig = section(RefConfig)
    critic: CriticConfig = section(CriticConfig, needs=HAS_CRITIC)
    reward_model: RewardModelConfig = section(RewardModelConfig)
    algorithm: AlgorithmConfig = section(AlgorithmConfig)
    trainer: TrainerConfig = section(TrainerConfig)
    sft: SFTConfig = section(SFTConfig, commands=("sft",))
    rm: RMConfig = section(RMConfig, commands=("rm",))


def config_to_dict(config: Config) -> dict:
    """The config as nested plain dicts (what a run saves as config.json)."""
    return dataclasses.asdict(config)


def config_from_dict(values: dict) -> Config:
    """Rebuild a Config from :func:`config_to_dict` output (e.g. a saved config.json)."""
    flat = flatten(values)
    text = lambda v: "null" if v is None else ",".join(map(str, v)) if isinstance(v, list | tuple) else v  # noqa: E731
    return apply_overrides(Config(), [f"{k}={text(v)}" for k, v in flat.items()])
