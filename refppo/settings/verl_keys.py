"""verl 0.9's configuration keys, each classed by what refppo does with it (appendix B).

- :data:`NAMES`: verl's keys that are refppo settings under another name than the short one.
- :data:`ENGINE`: settings of verl's engine (placement, sharding, serving, logging): noted.
- :data:`UNREAD_BY_VERL`: keys verl's code leaves unread, or fills itself, with the value given:
  dropped with a note.
- :data:`MISSING` (with the value that turns each off) and :data:`NOT_IMPLEMENTED` (whatever the
  value): features refppo lacks, refused by name.
- :data:`RENAMED`: refppo's old names, refused with the new one.

A key ending in "." stands for every key under it. Where verl's documentation and code disagree,
these follow its code at v0.9.0; :mod:`refppo.settings.verl_names` reads a command line with them.
"""

from __future__ import annotations

from refppo.losses import POLICY_LOSS_SETTINGS

# verl's sections under actor_rollout_ref, which refppo spells without it
SECTIONS = ("actor.", "rollout.", "ref.", "model.")
FULL = "actor_rollout_ref."
# verl's sections whose config dataclass has an engine field, and its two model sections
ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
MODELS = ("actor_rollout_ref.model", "critic.model")
# verl's name (full path) -> refppo's, where more than the actor_rollout_ref. prefix differs
NAMES = {
    "actor_rollout_ref.actor.policy_loss.loss_mode": "actor.policy_loss",
    **{f"actor_rollout_ref.actor.policy_loss.{k}": f"actor.{k}" for k in POLICY_LOSS_SETTINGS},
    "reward.reward_model.enable": "reward_model.enable",
    "reward.reward_model.model_path": "reward_model.model.path",
    "trainer.default_local_dir": "trainer.output_dir",
    "reward.reward_manager.name": "reward_model.reward_manager",
    **{
        f"reward.reward_kwargs.overlong_buffer_cfg.{k}": f"reward_model.overlong_buffer.{k}"
        for k in ("enable", "len", "penalty_factor", "log")
    },
    "reward.reward_kwargs.max_resp_len": "reward_model.max_resp_len",
    **{f"reward.custom_reward_function.{k}": f"reward_model.custom_reward_function.{k}" for k in ("path", "name")},
    # verl 0.9's older place for the custom reward function
    **{f"custom_reward_function.{k}": f"reward_model.custom_reward_function.{k}" for k in ("path", "name")},
    # verl 0.9's older place for the DAPO reward manager's keywords
    **{
        f"reward_model.reward_kwargs.overlong_buffer_cfg.{k}": f"reward_model.overlong_buffer.{k}"
        for k in ("enable", "len", "penalty_factor", "log")
    },
    "reward_model.reward_kwargs.max_resp_len": "reward_model.max_resp_len",
}
# verl keys its config file lacks, which its command lines add with "+", and their values when
# absent (DAPO's recipe config, the reward manager's keyword arguments; GDPO's, read with .get)
ADDED = {
    "algorithm.gdpo_reward_keys": None,
    "algorithm.gdpo_reward_weights": None,
    "reward.reward_kwargs.overlong_buffer_cfg.enable": False,
    "reward.reward_kwargs.overlong_buffer_cfg.len": 0,
    "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor": 0.0,
    "reward.reward_kwargs.overlong_buffer_cfg.log": False,
    "reward.reward_kwargs.max_resp_len": None,
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": False,
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": 0,
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": 0.0,
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": False,
    "reward_model.reward_kwargs.max_resp_len": None,
    # fields of verl's HFModelConfig that refppo lacks (MISSING)
    "actor_rollout_ref.model.model_type": "language_model",
    **{f"{model}.load_tokenizer": True for model in MODELS},
    "actor_rollout_ref.model.target_parameters": None,
}
# verl's settings of multi-turn rollouts (read only with multi_turn.enable=true): section -> keys
MULTI_TURN_KEYS = {
    "actor_rollout_ref.rollout.multi_turn": (
        "max_assistant_turns", "max_user_turns", "max_parallel_calls", "max_tool_response_length",
        "tool_response_truncate_side", "tool_config_path", "function_tool_path", "use_inference_chat_template",
        "tokenization_sanity_check_mode", "format", "num_repeat_rollouts",
    ),
    "data": ("tool_config_path", "function_tool_path"),
}  # fmt: skip
# Fields of verl's config dataclasses that its YAML lacks and its own code fills:
# what HFModelConfig.__post_init__ loads from the model's path,
MODEL_LOADED = (
    "local_path", "local_tokenizer_path", "tokenizer", "processor", "local_hf_config_path", "generation_config",
    "hf_config", "architectures",
)  # fmt: skip
# and the reference's batch sizes, which ActorRolloutRefWorker.init_model sets.
REF_BATCH_SIZES = (
    "ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz",
    "ppo_max_token_len_per_gpu",
)  # fmt: skip
# The reference is built from verl's ActorConfig, whose other fields its log-prob pass never reads:
# why, and the fields (one ending in "." stands for every key under it).
REF_UNREAD = {
    "the reference model computes no loss": (
        "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "entropy_coeff", "use_kl_loss",
        "kl_loss_coef", "kl_loss_type", "loss_agg_mode", "loss_scale_factor", "tau_pos", "tau_neg", "policy_loss.",
        "global_batch_info",
    ),
    "the reference model is not trained": (
        "optim.", "ppo_epochs", "shuffle", "data_loader_seed", "checkpoint.", "grad_clip", "qat", "profile",
    ),
    "verl's reference pass reads actor_rollout_ref.model's": ("use_remove_padding", "use_fused_kernels"),
    "verl's trainer reads the actor's only": ("calculate_entropy", "calculate_sum_pi_squared", "use_prefix_grouper"),
    "verl's reference pass takes its micro-batches from ref.log_prob_*": (
        "ppo_infer_max_token_len_per_gpu", "ppo_infer_micro_batch_size_per_gpu",
    ),
    "verl's reference pass never reads it": ("freeze_vision_tower", "use_rollout_log_probs"),
}  # fmt: skip
# verl keys its code does not read here: added with "+" by its example lines and never read, or
# read only with a feature refppo refuses (so unread on any line refppo accepts): dropped with a note
UNREAD_BY_VERL = {
    # verl's agent loop samples at val_kwargs.temperature whatever do_sample says; validate_config
    # reads it only to assert rollout.temperature > 0, which refppo's range holds
    "actor_rollout_ref.rollout.val_kwargs.do_sample": "verl's validation samples at val_kwargs.temperature "
    "whatever it says (0 decodes greedily)",
    # verl's _load_checkpoint reads it only with resume_mode=resume_path, which refppo refuses
    "trainer.resume_from_path": "read only with trainer.resume_mode=resume_path",
    # FSDPActorConfig.grad_clip and the critic's have no reader in verl 0.9: its engine clips at
    # optim.clip_grad (FSDPEngine.optimizer_step)
    "actor_rollout_ref.actor.grad_clip": "verl clips the gradient at actor_rollout_ref.actor.optim.clip_grad",
    "critic.grad_clip": "verl clips the gradient at critic.optim.clip_grad",
    "actor_rollout_ref.actor.policy_loss.tau_pos": "verl's SAPO loss reads actor.tau_pos",
    "actor_rollout_ref.actor.policy_loss.tau_neg": "verl's SAPO loss reads actor.tau_neg",
    **{f"algorithm.pf_ppo.{k}": "read only with algorithm.use_pf_ppo=true" for k in ("reweight_method", "weight_pow")},
    # Megatron's OptimizerParamScheduler.get_lr returns the peak lr after warm-up when the decay
    # style is constant, the only one refppo takes (verl/utils/megatron/optimizer.py passes it on)
    **{
        f"{opt}.{k}": why
        for opt in ("actor_rollout_ref.actor.optim", "critic.optim")
        for keys, why in (
            (("min_lr",), "Megatron's scheduler reads its floor only with an lr_decay_style other than constant"),
            (("lr_wsd_decay_style", "lr_wsd_decay_steps"), "read only with lr_decay_style=WSD"),
            # get_megatron_optimizer_param_scheduler passes start_wd = end_wd = weight_decay
            (
                ("weight_decay_incr_style",),
                "every style keeps the weight decay at weight_decay (verl starts and ends it there)",
            ),
            (
                ("exp_avg_dtype", "exp_avg_sq_dtype", "main_grads_dtype"),
                "read only with use_precision_aware_optimizer=true",
            ),
            (
                (
                    "use_layer_wise_distributed_optimizer",
                    "muon_momentum",
                    "muon_nesterov",
                    "muon_split_qkv",
                    "muon_scale_mode",
                    "muon_coefficient_type",
                    "muon_num_ns_steps",
                    "muon_tp_mode",
                    "muon_fp32_matmul_prec",
                    "muon_extra_scale_factor",
                    "muon_scalar_optimizer",
                    "muon_match_adamw_update_rms",
                ),
                "read only with optimizer=muon",
            ),
        )
        for k in keys
    },
    **{
        f"{section}.{k}": "read only with multi-turn rollouts (actor_rollout_ref.rollout.multi_turn.enable=true)"
        for section, keys in MULTI_TURN_KEYS.items()
        for k in keys
    },
    **{
        f"{role}.router_replay.{k}": "read only with router_replay.mode other than disabled"
        for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref")
        for k in ("record_file", "replay_file")
    },
    **{
        f"reward.reward_manager.module.{k}": "read only with reward.reward_manager.source=importlib"
        for k in ("name", "path")
    },
    **{
        f"skip.{part}.{k}": f"read only with skip.{part}.enable=true"
        for part in ("rollout", "async_rollout", "rollout_tq")
        for k in ("action", "dump_dir", "steps")
    },  # noqa: E501
    **{
        f"{s}.{k}": "read only with a sandbox's url"
        for s in ("reward.sandbox_fusion", "sandbox_fusion")
        for k in ("max_concurrent", "memory_limit_mb")
    },  # noqa: E501
    "data.return_multi_modal_inputs": "read only with image, video or audio inputs",
    "trainer.v1.sampler.sampler_kwargs": "read only with trainer.v1.sampler.custom_sampler",
    "critic.model.lora_alpha": "read only with a LoRA critic (critic.model.lora_rank > 0)",
    # Megatron-Bridge's create_peft passes only the fields of the adapter type's class
    **{
        f"actor_rollout_ref.model.lora.{k}": "read only by Megatron-Bridge's VLM LoRA (model.lora.type=vlm_lora)"
        for k in ("freeze_vision_model", "freeze_vision_projection", "freeze_language_model")
    },
    # verl's main_ppo loads the tokenizer with the actor's model (_init_tokenizer in
    # verl/trainer/ppo/v1/trainer_base.py); only its experimental trainers read data's
    "data.trust_remote_code": "the tokenizer is loaded with actor_rollout_ref.model.trust_remote_code "
    "(refppo's model.trust_remote_code)",
    # Fields of verl's config dataclasses that its YAML lacks (a line adds them with "+"); a key
    # ending in "." stands for every key under it. verl's own code fills some of them, so a value
    # given is replaced: ActorConfig.__post_init__ and CriticConfig's (engine), ppo_loss
    # (global_batch_info), ActorRolloutRefWorker.init_model (model_config, the reference's batch
    # sizes), HFModelConfig.__post_init__ (what it loads from the model's path).
    **{f"{role}.engine": "verl sets it to the role's engine settings" for role in ROLES},
    "actor_rollout_ref.actor.global_batch_info": "verl's loss fills it at every call",
    **{
        f"actor_rollout_ref.{role}.model_config.": "verl sets it to actor_rollout_ref.model's settings"
        for role in ("actor", "ref")
    },
    **{f"{model}.{k}": "verl's model config fills it from the model's path" for model in MODELS for k in MODEL_LOADED},
    "critic.model.model_type": "verl's critic worker sets it to value_model",
    "critic.model.target_parameters": "read only with a LoRA critic (critic.model.lora_rank > 0)",
    **{
        f"actor_rollout_ref.ref.{k}": "verl sets it from actor.ppo_mini_batch_size and ref.log_prob_*"
        for k in REF_BATCH_SIZES
    },
    **{f"actor_rollout_ref.ref.{k}": why for why, keys in REF_UNREAD.items() for k in keys},
    **{
        f"actor_rollout_ref.actor.{k}": "the actor's log-prob pass takes its micro-batches from rollout.log_prob_*"
        for k in ("ppo_infer_max_token_len_per_gpu", "ppo_infer_micro_batch_size_per_gpu")
    },
    "critic.ppo_infer_micro_batch_size_per_gpu": "verl 0.9 has no reader of it",
    # verl's documentation names it for bypass mode, but no code of verl 0.9 reads it
    "actor_rollout_ref.actor.use_rollout_log_probs": "verl 0.9 has no reader of it (bypass mode is "
    "algorithm.rollout_correction.bypass_mode=true)",
    "actor_rollout_ref.actor.profile": "verl 0.9 has no reader of it",
    # vLLM's server would read it, but both of verl's agent loops pass repetition_penalty=1.0
    "actor_rollout_ref.rollout.repetition_penalty": "verl's agent loops sample with a repetition penalty of 1.0",
    **{
        f"actor_rollout_ref.rollout.{k}": "verl 0.9 has no reader of it"
        for k in ("custom", "layer_name_map", "sglang_engine_mode", "server.max_start_wait_time")
    },
    "actor_rollout_ref.rollout.standalone_gpu_memory_utilization": "read only by verl's experimental "
    "fully asynchronous trainer",
    # TorchTitan's optimizer group (optim/torchtitan.yaml), read by its engine only
    **{
        f"{opt}.{k}": "read only by verl's TorchTitan engine (model_engine=torchtitan)"
        for opt in ("actor_rollout_ref.actor.optim", "critic.optim")
        for k in ("name", "eps", "decay_type", "min_lr_factor")
    },
}
# verl's worker-side copy of the rollout correction settings (PolicyLossConfig.rollout_correction),
# which only its bypass-mode loss reads (compute_policy_loss_bypass_mode), as refppo's bypass
# mode reads algorithm.rollout_correction.*
WORKER_ROLLOUT_CORRECTION = "actor_rollout_ref.actor.policy_loss.rollout_correction."
# the settings verl's bypass-mode loss reads from that copy, and the value each takes when a line
# gives some of them (compute_policy_loss_bypass_mode's .get defaults)
BYPASS_LOSS_DEFAULTS = {
    "loss_type": "ppo_clip",
    "rollout_is": "null",
    "rollout_is_threshold": "2.0",
    "rollout_is_batch_normalize": "false",
    "rollout_rs": "null",
    "rollout_rs_threshold": "null",
}
# a verl setting that is a dict whose keys a command line gives one by one
# (+data.apply_chat_template_kwargs.enable_thinking=False): its refppo setting, set whole
DICTS = {"data.apply_chat_template_kwargs": "data.apply_chat_template_kwargs"}
# apply_chat_template's own arguments, which refppo's rendering sets (refppo.rollout.prompts)
APPLY_CHAT_TEMPLATE_OWN = (
    "conversation", "add_generation_prompt", "tokenize", "return_dict", "return_tensors", "padding", "truncation",
    "max_length", "continue_final_message", "chat_template", "tools", "documents", "tokenizer_kwargs",
)  # fmt: skip
# the values that turn a feature off: a NOT_IMPLEMENTED key given one of them is accepted with a note
OFF = ("null", "false", "0", "[]", "{}", "", "disabled")
# verl features outside refppo's scope or not there yet, whatever their value: refused, naming
# what is missing (a key, or a prefix ending in ".")
NOT_IMPLEMENTED = {
    "data.image_key": "image inputs (vision-language models)",
    "data.video_key": "video inputs (vision-language models)",
    "data.image_patch_size": "image inputs (vision-language models)",
    "distillation.": "on-policy distillation",
    "hydra.": "Hydra's own settings (a search path to another package's configuration: refppo composes verl's "
    "own, with --config-path / --config-name)",
    "actor@actor_rollout_ref.actor": "Hydra's package overrides of a configuration group (give the settings)",
    "actor_rollout_ref.model.mtp.": "multi-token prediction",
    "actor_rollout_ref.model.override_config.": "overriding the model's own config",
    "actor_rollout_ref.model.exclude_modules": "LoRA on some of the linear layers (refppo adapts all of them)",
    "data.custom_cls.": "dataset classes from a file",
    "data.audio_key": "audio inputs",
    "data.mm_processor_kwargs": "image, video or audio inputs",
    "actor_rollout_ref.actor.freeze_vision_tower": "vision-language models",
    "data.tokenizer": "a tokenizer other than the model's",
    "data.seed": "a prompt order seeded apart from trainer.seed",
    "trainer.v1.sampler.custom_sampler.": "a replay-buffer sampler from a file",
    "actor_rollout_ref.rollout.multi_turn.enable": "multi-turn and tool-calling rollouts",
    **{
        f"{role}.{k}": f"{what} (null: the model's own)"
        for role in ("actor_rollout_ref.model", "critic.model")
        for k, what in (
            ("custom_chat_template", "a chat template other than the tokenizer's"),
            ("hf_config_path", "a model config from another path"),
            ("tokenizer_path", "a tokenizer from another path"),
            ("external_lib", "importing a library for the model's code"),
        )
    },
    "actor_rollout_ref.model.override_config": "overriding the model's own config",
    "critic.model.override_config": "overriding the model's own config",
    "critic.model.exclude_modules": "LoRA on some of the linear layers (refppo adapts all of them)",
    "critic.model.lora.": "Megatron's LoRA (refppo's LoRA is PEFT's, the actor's alone)",
    "critic.model.mtp.": "multi-token prediction",
    "actor_rollout_ref.rollout.mtp": "multi-token prediction",
    "actor_rollout_ref.actor.qat.": "quantisation-aware training",
    "actor_rollout_ref.rollout.qat": "quantisation-aware training",
    "actor_rollout_ref.rollout.quantization": "quantised rollouts",
    "actor_rollout_ref.rollout.quantization_config_file": "quantised rollouts",
    **{f"reward_model.reward_loop_{k}": "reward loops from a file" for k in ("class_name", "module_path", "source")},
    "critic.model.lora_rank": "a LoRA critic",
    "critic.model.lora_adapter_path": "a LoRA critic",
    "reward_model.model.external_lib": "importing a library for the reward model's code",
    "reward.sandbox_fusion.url": "rewards from running code in a sandbox",
    "sandbox_fusion.url": "rewards from running code in a sandbox",
    **{f"skip.{part}.enable": "replaying saved rollouts" for part in ("rollout", "async_rollout", "rollout_tq")},
    # verl's build_optimizer (verl/workers/config/optimizer.py) passes these to the optimizer
    **{
        f"{opt}.override_optimizer_config{k}": "keyword arguments to the optimizer beyond lr, betas and weight_decay"
        for opt in ("actor_rollout_ref.actor.optim", "critic.optim")
        for k in ("", ".")
    },
}
VALUES = {("actor.policy_loss", "vanilla"): "clip"}  # verl's name of a value -> refppo's
# the actor's router replay in each engine's copy: verl's ActorRolloutRefWorker reads the one of the
# engine the line picks, Megatron's or VeOmni's (no other engine replays): engine -> key
ACTOR_ROUTER_REPLAY = {
    "dp": "actor_rollout_ref.actor.fsdp_config.router_replay.mode",
    "megatron": "actor_rollout_ref.actor.megatron.router_replay.mode",
    "veomni": "actor_rollout_ref.actor.veomni.router_replay.mode",
    "torchtitan": "actor_rollout_ref.actor.torchtitan.router_replay.mode",
}
ROUTER_REPLAY_ENGINES = ("megatron", "veomni")
ROLLOUT_ROUTES = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
# the actor's use_remove_padding defaults to the model's (true)
REMOVE_PADDING = "actor_rollout_ref.model.use_remove_padding"
# data.truncation values verl 0.9's RL path never applies: its rollout cuts a prompt longer than
# rollout.prompt_length from the left (AgentLoopBase.apply_chat_template); RLHFDataset stores the
# setting and reads it nowhere
CUT_FROM_THE_LEFT = ("right", "middle")
# a verl setting whose values are refppo settings
KEY_VALUES = {"trainer.resume_mode": {"auto": "trainer.resume=true", "disable": "trainer.resume=false"}}
RENAMED = {
    "actor.policy_mode": "algorithm.rollout_correction.bypass_mode=true (bypass) or "
    "algorithm.rollout_correction.rollout_is=token (rollout_correction)",
    "actor.rollout_is_threshold": "algorithm.rollout_correction.rollout_is_threshold",
    "trainer.tensorboard": "trainer.logger=[console,tensorboard]",
    # verl's deprecated spelling, which OptimizerConfig.__post_init__ copies into clip_grad
    **{
        f"{opt}.grad_clip": f"{opt}.clip_grad"
        for opt in ("actor_rollout_ref.actor.optim", "actor.optim", "critic.optim")
    },
}
# verl settings of its engine: how it places, shards, serves and logs, never what it computes.
# A key ending in "." stands for every key under it.
ENGINE = (
    *(
        f"actor_rollout_ref.rollout.{k}"
        for k in (
            "name", "mode", "nnodes", "n_gpus_per_node", "tensor_model_parallel_size", "data_parallel_size",
            "expert_parallel_size", "pipeline_model_parallel_size", "gpu_memory_utilization", "enforce_eager",
            "cudagraph_capture_sizes", "free_cache_engine", "max_num_batched_tokens", "max_num_seqs",
            "enable_chunked_prefill", "enable_prefix_caching", "scheduling_policy", "load_format", "layered_summon",
            "disable_log_stats", "multi_stage_wake_up", "skip_tokenizer_init", "max_model_len",
            "checkpoint_engine.", "agent.", "trace.", "profiler.", "engine_kwargs.", "prometheus.",
        )
    ),
    *(
        f"{role}.{k}"
        for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
        for k in ("strategy", "profiler.", "ulysses_sequence_parallel_size", "rollout_n")
    ),
    "actor_rollout_ref.actor.fsdp_config.", "actor_rollout_ref.ref.fsdp_config.", "critic.fsdp.",
    "actor_rollout_ref.actor.checkpoint.", "critic.checkpoint.", "critic.forward_micro_batch_size_per_gpu",
    "critic.forward_max_token_len_per_gpu",
    *(
        f"{role}.{k}"
        for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref")
        for k in ("entropy_from_logits_with_chunking", "entropy_from_logits_chunk_size", "entropy_checkpointing")
    ),
    *(
        f"{role}.model.{k}"
        for role in ("actor_rollout_ref", "critic")
        for k in ("use_remove_padding", "use_shm", "enable_activation_offload")
    ),
    "actor_rollout_ref.actor.use_remove_padding", "actor_rollout_ref.model.use_liger", "critic.model.use_liger",
    "actor_rollout_ref.hybrid_engine", "actor_rollout_ref.nccl_timeout", "critic.nccl_timeout",
    "actor_rollout_ref.ref.use_torch_compile",
    "trainer.nnodes", "trainer.n_gpus_per_node",
    "trainer.balance_batch", "trainer.default_hdfs_dir",
    # the V1 trainer's replay buffer: its asynchronous modes' settings (trainer_mode is MISSING) and
    # its handling of rollouts that failed, which refppo's never do
    "trainer.v1.sync", "trainer.v1.colocate_async.", "trainer.v1.separate_async.",
    "trainer.v1.sampler.max_off_policy_strategy", "trainer.v1.sampler.max_off_policy_threshold",
    "trainer.v1.sampler.sync_refill_failed_groups",
    "trainer.del_local_ckpt_after_load", "trainer.ray_wait_register_center_timeout", "trainer.esi_redundant_time",
    "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep",
    "data.dataloader_num_workers", "data.use_shm", "data.return_raw_chat", "data.return_raw_input_ids",
    "data.return_full_prompt", "data.filter_overlong_prompts_workers", "data.val_batch_size",
    # refppo's log-prob passes take the actor's token budget (actor.use_dynamic_bsz)
    *(f"actor_rollout_ref.{r}.log_prob_{k}" for r in ("rollout", "ref") for k in ("use_dynamic_bsz", "max_token_len_per_gpu")),  # noqa: E501
    "reward.num_workers", "algorithm.filter_groups.max_inflight_gen_batches",  # generation batches in flight
    # the other engines verl trains with (Megatron, VeOmni, TorchTitan; model_engine itself is read
    # against the line, MODEL_ENGINES) and their settings, the rollout engine's precision, a reward
    # model's server, merging LoRA into the rollout's weights
    "actor_rollout_ref.actor.model_engine", "trainer.use_legacy_worker_impl",
    "actor_rollout_ref.rollout.moe_tensor_parallel_size",
    *(
        f"actor_rollout_ref.{r}.{engine}."
        for r in ("actor", "ref")
        for engine in ("megatron", "veomni", "mindspeed", "torchtitan")
    ),
    "actor_rollout_ref.actor.engine.", "critic.megatron.", "critic.veomni.", "critic.torchtitan.",
    # Megatron's optimizer-offload options, given through override_optimizer_config (memory only);
    # its other keys go to the optimizer itself (build_optimizer: AdamW's eps, ...): NOT_IMPLEMENTED
    *(
        f"actor_rollout_ref.actor.optim.override_optimizer_config.{k}"
        for k in (
            "optimizer_cpu_offload", "optimizer_offload_fraction", "offload_fraction",
            "overlap_cpu_optimizer_d2h_h2d", "use_precision_aware_optimizer",
        )
    ),
    "actor_rollout_ref.actor.pad_to_length", "actor_rollout_ref.ref.pad_to_length",
    # PrefixGrouper: a group's shared prompt attended once (verl/models/transformers/monkey_patch.py),
    # the same log-probs to rounding, and the groups kept together in verl's GPU balancing
    "actor_rollout_ref.actor.use_prefix_grouper",
    "actor_rollout_ref.model.tiled_mlp.", "critic.model.tiled_mlp.", "actor_rollout_ref.model.fused_kernel_options.",
    "critic.model.fused_kernel_options.", "critic.model.use_fused_kernels", "actor_rollout_ref.actor.use_fused_kernels",
    "actor_rollout_ref.rollout.moe_load_balance_metrics_interval",
    "actor_rollout_ref.rollout.disaggregation.", "actor_rollout_ref.rollout.seed",  # the engine's own sampling seed
    "reward.reward_model.enable_resource_pool", "reward.reward_model.n_gpus_per_node", "reward.reward_model.nnodes",
    "reward_model.enable_resource_pool", "reward_model.n_gpus_per_node", "reward_model.nnodes",
    "reward_model.num_workers",
    "reward_model.rollout.", "trainer.rollout_data_dir", "trainer.validation_data_dir",
    "actor_rollout_ref.rollout.dtype", "reward.reward_model.rollout.", "actor_rollout_ref.model.lora.merge",
    "actor_rollout_ref.model.lora.a2a_experimental",  # expert-parallel communication of the adapters
    "global_profiler.", "ray_kwargs.", "transfer_queue.",
    # fields of verl's config dataclasses that its YAML lacks: vLLM's sleep mode and image limit,
    # TRT-LLM's server, the weight sync's class, the critic's token budget (which the V1 trainer
    # also trains with), a Muon optimizer's buffer layout
    "actor_rollout_ref.rollout.enable_sleep_mode", "actor_rollout_ref.rollout.limit_images",
    "actor_rollout_ref.rollout.server.", "actor_rollout_ref.rollout.checkpoint_manager_class",
    "critic.ppo_infer_max_token_len_per_gpu",
    "actor_rollout_ref.actor.optim.use_layer_wise_param_layout", "critic.optim.use_layer_wise_param_layout",
)  # fmt: skip
# The rollout's lengths, which verl's engine reads and which default to data's: refppo has one
# length of each, data's (the same setting when both are given, then they must agree).
ROLLOUT_LENGTHS = {
    "actor_rollout_ref.rollout.prompt_length": "data.max_prompt_length",
    "actor_rollout_ref.rollout.response_length": "data.max_response_length",
}
# verl settings refppo does not implement: the value that turns each off (accepted, with a
# note) and what is missing.
MISSING = {
    "algorithm.use_pf_ppo": ("false", "preference-feedback PPO's reweighting"),
    "actor_rollout_ref.rollout.do_sample": ("true", "greedy rollouts"),
    "actor_rollout_ref.rollout.over_sample_rate": ("0", "over-sampling with early stopping"),
    "data.train_max_samples": ("-1", "a cap on the training records"),
    "data.val_max_samples": ("-1", "a cap on the evaluation records"),
    "data.reward_fn_key": ("data_source", "choosing the rule by another column"),
    "data.gen_batch_size": ("null", "a generation batch other than data.train_batch_size"),
    "trainer.val_only": ("false", "validation-only runs"),
    # verl's ReplayBuffer: an asynchronous mode trains on rollouts of older weights
    "trainer.v1.trainer_mode": (
        "sync",
        "the V1 trainer's asynchronous modes, whose steps train on rollouts of older weights",
    ),
    **{
        f"{opt}.lr_decay_style": ("constant", f"Megatron's schedule names (refppo's: {short}.optim.lr_scheduler_type)")
        for opt, short in (("actor_rollout_ref.actor.optim", "actor"), ("critic.optim", "critic"))
    },
    "actor_rollout_ref.model.target_modules": ("all-linear", "LoRA on some of the linear layers"),
    "actor_rollout_ref.model.lora.type": ("lora", "Megatron-Bridge's other adapters (canonical_lora, vlm_lora, dora)"),
    "actor_rollout_ref.model.lora.dropout": ("0.0", "LoRA dropout (refppo's models run without dropout)"),
    "actor_rollout_ref.model.lora.exclude_modules": (
        "[]",
        "Megatron's LoRA on all linear maps but some (model.lora.target_modules names those it adapts)",
    ),
    "actor_rollout_ref.model.lora.dtype": ("null", "LoRA weights in another dtype than the model's"),
    "actor_rollout_ref.model.lora.adapter_path": ("null", "starting from a saved Megatron LoRA adapter"),
    "critic.model.target_modules": ("all-linear", "LoRA on some of the linear layers"),
    **{
        f"{opt}.{k}": (off, what)
        for opt in ("actor_rollout_ref.actor.optim", "critic.optim")
        for k, off, what in (
            ("optimizer", "adamw", "other optimizers"),
            ("optimizer_impl", "torch.optim", "optimizers from other libraries"),
            ("num_cycles", "0.5", "cosine schedules of other cycle counts"),
            ("total_training_steps", "-1", "a schedule length other than the run's"),
            ("warmup_style", "null", "the deprecated warmup_style (lr_scheduler_type is the setting)"),
            ("zero_indexed_step", "true", "a schedule counted from step 1"),
            # VeOmni's scheduler (veomni.optim.build_lr_scheduler, as verl's VeOmni engine builds
            # it): a warm-up from lr_start, a decay over lr_decay_ratio of the run, down to lr_min
            ("lr_start", "0.0", "a warm-up from a learning rate other than 0"),
            ("lr_decay_ratio", "1.0", "VeOmni's decay over a part of the run"),
            ("lr_min", "0.0", "VeOmni's learning-rate floor"),
            # Megatron's optimizer (verl/utils/megatron/optimizer.py)
            ("lr_warmup_init", "0.0", "a warm-up from a learning rate other than 0"),
            ("lr_decay_steps", "null", "a schedule length other than the run's"),
            ("use_checkpoint_opt_param_scheduler", "false", "a schedule read back from a checkpoint over the settings"),
            ("use_precision_aware_optimizer", "false", "optimizer states below float32"),
        )
    },
    **{
        key: ("null", "the deprecated global micro-batch sizes (the *_per_gpu settings)")
        for key in (
            "actor_rollout_ref.actor.ppo_micro_batch_size",
            "actor_rollout_ref.ref.log_prob_micro_batch_size",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size",
            "critic.ppo_micro_batch_size",
            "critic.forward_micro_batch_size",
        )
    },
    "data.validation_shuffle": ("false", "a shuffled evaluation order"),
    "reward.reward_manager.source": ("register", "reward managers from a file"),
    "actor_rollout_ref.actor.router_replay.mode": ("disabled", "replaying MoE routing"),
    "actor_rollout_ref.ref.router_replay.mode": ("disabled", "replaying MoE routing"),
    # the reference's and critic's own copies in each engine (an exact key here wins over ENGINE's
    # prefixes); the actor's are read against the line (ACTOR_ROUTER_REPLAY)
    **{
        f"{section}.router_replay.mode": ("disabled", "replaying MoE routing")
        for section in (
            *(f"actor_rollout_ref.ref.{engine}" for engine in ("fsdp_config", "megatron", "veomni", "torchtitan")),
            *(f"critic.{engine}" for engine in ("fsdp", "megatron", "veomni", "torchtitan")),
        )
    },
    # quantisation-aware training in the engine's copy of the actor's and critic's settings (the
    # engine fake-quantises the linear layers' weights; the reference's copy is never read)
    **{
        f"{section}.qat.enable": ("false", "quantisation-aware training")
        for section in (
            "actor_rollout_ref.actor.fsdp_config",
            "actor_rollout_ref.actor.megatron",
            "critic.fsdp",
            "critic.megatron",
        )
    },
    # vLLM's fully deterministic sampling gives every request of a replica one seed (AsyncvLLMServer)
    "actor_rollout_ref.rollout.full_determinism": (
        "false",
        "vLLM's fully deterministic sampling (one seed for every request)",
    ),
    # the agent loop that generates (verl/experimental/agent_loop): refppo's is the single turn's
    "actor_rollout_ref.rollout.agent.default_agent_loop": (
        "single_turn_agent",
        "other agent loops (tools, several turns)",
    ),
    **{
        f"actor_rollout_ref.rollout.agent.{k}": ("null", what)
        for k, what in (
            ("agent_loop_config_path", "agent loops from a file"),
            ("agent_loop_manager_class", "an agent-loop manager from a file"),
            ("custom_async_server.name", "a rollout server from a file"),
            ("custom_async_server.path", "a rollout server from a file"),
        )
    },
    # fields of verl's HFModelConfig that its YAML lacks (ADDED): the engine class verl builds (only
    # a language model trains), loading the tokenizer (verl's V1 trainer needs it), LoRA on
    # parameters (MoE experts) rather than linear layers
    "actor_rollout_ref.model.model_type": ("language_model", "verl's other model classes"),
    **{f"{model}.load_tokenizer": ("true", "a model without its tokenizer") for model in MODELS},
    "actor_rollout_ref.model.target_parameters": ("null", "LoRA on parameters other than linear layers' weights"),
}

# Configuration groups from outside verl that its example lines compose, and the one value each
# takes here. Megatron Lite's package (verl_mlite, in Megatron-LM's experimental/lite/examples/verl)
# makes its mlite_actor of verl's actor.yaml, Megatron's optimizer (optim/megatron.yaml) and its
# own engine's settings, as verl's megatron_actor.yaml makes Megatron's: the same settings as a
# Megatron line's, on another training engine.
ENGINE_GROUPS = {
    ("hydra.searchpath", "[pkg://verl_mlite.config]"): "Megatron Lite's configuration package, verl_mlite",
    ("actor@actor_rollout_ref.actor", "mlite_actor"): "Megatron Lite's actor: verl's actor settings with "
    "Megatron's optimizer, trained by Megatron Lite's engine",
}

# Keys noted whatever their value, each with its own note: verl 0.9's two trainers (main_ppo's
# trainer.use_v1), which compute a default line's step alike but where appendix B.6 lists (refppo's
# step is one of them in each of those places), and where Megatron's LoRA drops out.
OWN_NOTES = {
    "trainer.use_v1": "verl 0.9's V1 trainer (true, its default) and its RayPPOTrainer (false) compute a step alike "
    "but for a few readings; refppo follows one of them in each (appendix B.6 lists them)",
    "actor_rollout_ref.model.lora.dropout_position": "where Megatron's adapters drop out, which changes nothing "
    "without LoRA dropout (model.lora.dropout > 0, which refppo refuses)",
}

# verl's main_ppo runs on the accelerator it detects, whatever trainer.device names
# (auto_set_device in verl/utils/device.py): a line written for Ascend NPUs runs on a CUDA GPU.
# refppo's auto is that choice (CUDA when there is one, else the CPU).
DETECTED_DEVICES = ("npu",)

# verl's model_engine picks the actor's, reference's and critic's configuration groups
# (actor/<engine>_actor.yaml, ...; ppo_megatron_trainer is ppo_trainer with megatron), and with
# them defaults of settings refppo takes where they differ from FSDP's (dp): engine -> {key: default}.
# VeOmni's optimizer group (optim/veomni.yaml) decays the learning rate on a cosine with VeOmni's
# scheduler, which at its other defaults (no warm-up, lr_min 0, lr_decay_ratio 1) is verl's FSDP cosine.
MODEL_ENGINES = {
    "dp": {},
    "megatron": {},
    "mindspeed": {},
    "veomni": {
        "actor_rollout_ref.actor.optim.lr_scheduler_type": "cosine",
        "critic.optim.lr_scheduler_type": "cosine",
    },
}
# TorchTitan's engine: what refppo lacks (its schedule has no constant style, optim/torchtitan.yaml)
TORCHTITAN = "TorchTitan's learning-rate schedule (a linear decay over the run by default, optim.decay_type)"
# VeOmni's scheduler warms up for lr_warmup_steps_ratio of the run (verl's VeOmni engine passes only that)
VEOMNI_UNREAD = ("actor_rollout_ref.actor.optim.lr_warmup_steps", "critic.optim.lr_warmup_steps")
# verl's engines built on Megatron-Core (MindSpeed's subclasses Megatron's). Megatron's optimizer
# (megatron.core.optimizer's parameter groups, which verl builds without a no_weight_decay_cond)
# takes no weight decay on biases and other 1-D parameters (norms' weights): on such a line,
# refppo's optim.decay_1d_params=false (verl's FSDP optimizer decays every parameter). Their LoRA is
# Megatron-Bridge's, model.lora.* (get_peft_cls in verl/workers/config/megatron_peft.py); the other
# engines' is PEFT's, model.lora_rank and model.lora_alpha.
MEGATRON_ENGINES = ("megatron", "mindspeed")
# Megatron's transformer settings in each Megatron engine's actor configuration, where a line sets the
# router losses (verl's MindSpeed engine passes mcore_kwargs to Megatron as arguments); Megatron-Bridge's
# provider turns the load-balancing loss off (verl's provider_overrides in MegatronEngine._build_tf_config)
# unless a line turns it back on, the deprecated mbridge (vanilla_mbridge, MindSpeed's only path) keeps
# the model's own loss and coefficient
TRANSFORMER_SETTINGS = {
    "megatron": "actor_rollout_ref.actor.megatron.override_transformer_config.",
    "mindspeed": "actor_rollout_ref.actor.mindspeed.mcore_kwargs.",
}
# verl's keys of the two LoRAs: Megatron's adapter rank, and PEFT's settings
MEGATRON_LORA_RANK = "actor_rollout_ref.model.lora.rank"
PEFT_LORA = ("actor_rollout_ref.model.lora_rank", "actor_rollout_ref.model.lora_alpha")
# Megatron's parallel sizes in the actor's engine settings, which Megatron-Bridge 0.5 builds the LoRA
# adapters under (refppo's model.lora.<size>): verl key -> refppo's size
PARALLEL_SIZES = ("tensor_model_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size")
LORA_PARALLEL_SIZES = {
    f"actor_rollout_ref.actor.{engine}.{size}": size for engine in MEGATRON_ENGINES for size in PARALLEL_SIZES
}
# Every engine but FSDP's takes the critic's data_loader_seed from the actor's unless given
# (critic/<engine>_critic.yaml: ${oc.select:actor_rollout_ref.actor.data_loader_seed,null}).
CRITIC_SEED_FROM_ACTOR = ("megatron", "mindspeed", "veomni", "torchtitan")
# values of verl 0.9's registries that refppo does not implement: what each is missing
MISSING_CHOICES = {
    ("algorithm.adv_estimator", "rloo_vectorized"): "verl's vectorised RLOO, which gives a group of one 0 "
    "(algorithm.adv_estimator=rloo keeps its score, as verl's rloo)",
}

# verl's token budget per micro-batch is max_token_len_per_gpu times the sequence-parallel size its
# engine assigns (prepare_micro_batches in verl/workers/engine/utils.py; sp_size: FSDP's Ulysses
# size, Megatron's and MindSpeed's context-parallel size, VeOmni's Ulysses size): the ranks of a
# group share each sequence. refppo gives each sequence one process, so its budget is the product.
# refppo's key -> model_engine -> the verl keys that give the size
SEQUENCE_PARALLEL = {
    f"{refppo_role}.ppo_max_token_len_per_gpu": {
        "dp": (f"{role}.{fsdp}.ulysses_sequence_parallel_size", f"{role}.ulysses_sequence_parallel_size"),
        "megatron": (f"{role}.megatron.context_parallel_size",),
        "mindspeed": (f"{role}.mindspeed.context_parallel_size",),
        "veomni": (f"{role}.veomni.ulysses_parallel_size",),
    }
    for refppo_role, role, fsdp in (
        ("actor", "actor_rollout_ref.actor", "fsdp_config"),
        ("critic", "critic", "fsdp"),
    )
}
