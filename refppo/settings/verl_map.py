"""refppo's settings beside verl 0.9's (ch 5): which verl key each one is, which have no verl
counterpart and why, and where refppo's default differs from verl's and why. The book's key map
(:func:`key_map`) and ``refppo ppo --print-verl`` (:func:`verl_command`) are made from these
tables, so they cannot drift from the config."""

from __future__ import annotations

from omegaconf import OmegaConf

from refppo.settings.conditions import CRITIC_FROM_ACTOR, critic_setting, critic_warmup
from refppo.settings.config import Config, declarations, get_value
from refppo.settings.validate import format_value, ignored_settings, read_settings
from refppo.settings.verl_keys import ADDED, PARALLEL_SIZES, TRANSFORMER_SETTINGS, VALUES
from refppo.settings.verl_names import verl_key

VERL_CONFIG_PACKAGE = "pkg://verl.trainer.config"  # where Hydra finds verl's own ppo_trainer
# Megatron's router-loss coefficients, refppo's actor settings of the same names
ROUTER_LOSS_SETTINGS = ("actor.moe_aux_loss_coeff", "actor.moe_z_loss_coeff")
TINY = "the shape of a fresh tiny model (model.path=null); verl always loads a checkpoint"
OWN_COMMAND = "refppo's own {} command; verl trains {} with a separate program"
# refppo settings with no verl counterpart, and why
REFPPO_ONLY = {
    "data.task": "refppo's offline tasks (arithmetic, preference); file reads data.train_files as verl does",
    "data.val_size": "how many prompts an offline task holds out for evaluation",
    "data.val_fraction": OWN_COMMAND.format("sft and rm", "SFT and reward models")
    + "; the share of a file held out when there is no data.val_files",
    "data.messages_key": OWN_COMMAND.format("sft", "SFT") + " (its data.multiturn.messages_key)",
    "data.response_key": OWN_COMMAND.format("sft", "SFT") + " (its data.response_key; TRL's completion)",
    "data.chosen_key": OWN_COMMAND.format("rm", "reward models") + " (OpenRLHF's --chosen_key)",
    "data.rejected_key": OWN_COMMAND.format("rm", "reward models") + " (OpenRLHF's --rejected_key)",
    **{f"model.{k}": TINY for k in ("arch", "hidden_size", "num_hidden_layers", "num_attention_heads")},
    "model.num_key_value_heads": TINY,
    "actor.penalty_kl_coef": "PPO-penalty (ch 2), a loss verl does not have",
    "actor.penalty_kl_type": "PPO-penalty (ch 2), a loss verl does not have",
    "rollout.cuda_graphs": "refppo's own decoder; verl samples with vLLM or SGLang",
    **{
        f"{role}.optim.decay_1d_params": "verl's engine decides: false is its Megatron engine's optimizer, true its "
        "FSDP engine's (--print-verl gives model_engine=megatron for false)"
        for role in ("actor", "critic")
    },
    "actor.router_replay": "verl's actor_rollout_ref.actor.megatron.router_replay.mode or .veomni.router_replay.mode, "
    "read in the engine the line picks (--print-verl gives the engine)",
    "model.compile_layers": "refppo's own; verl's torchtitan engine compiles each layer under use_torch_compile",
    **{
        key: f"Megatron's router loss a Megatron line turns on (its {key.removeprefix('actor.')}), refused on a "
        "mixture-of-experts actor"
        for key in ROUTER_LOSS_SETTINGS
    },
    **{
        f"model.lora.{size}": f"Megatron's parallel size the LoRA adapters are built under: verl's "
        f"actor_rollout_ref.actor.megatron.{size} on a Megatron LoRA line"
        for size in PARALLEL_SIZES
    },
    "reward_model.reward_fn": "a Python function, package.module:function (verl's reward.custom_reward_function "
    "takes a file path and a name)",
    "reward_model.micro_batch_size_per_gpu": "the reward model's forward passes; verl serves it from its engine",
    "reward_model.missing_eos_penalty": "TRL's penalty for a response that never ends",
    "trainer.seed": "one seed for the run; verl seeds its data, rollout and engines apart",
    "trainer.resume": "continue the run in trainer.output_dir (verl: trainer.resume_mode=auto, also accepted)",
    "trainer.progress_bar": "refppo's progress bar",
    **{f"sft.{k}": OWN_COMMAND.format("sft", "SFT") for k in ("steps", "batch_size", "lr", "n_examples")},
    "sft.teacher_carry_error": OWN_COMMAND.format("sft", "SFT"),
    **{
        f"rm.{k}": OWN_COMMAND.format("rm", "reward models") for k in ("steps", "batch_size", "lr", "n_pairs", "center")
    },
}
TINY_RUNS = "tiny CPU models"
# refppo settings whose default is not verl's: verl's default, and why
OTHER_DEFAULTS = {
    "data.train_files": ("~/data/rlhf/gsm8k/train.parquet", "refppo's default task is offline (data.task)"),
    "data.val_files": ("~/data/rlhf/gsm8k/test.parquet", "refppo's default task is offline (data.task)"),
    "data.train_batch_size": (1024, f"{TINY_RUNS} learn from small batches, a step in about a second"),
    "data.max_prompt_length": (512, "the arithmetic task's prompts are a few characters"),
    "data.max_response_length": (512, "the arithmetic task's answers are a few characters"),
    "model.path": ("~/models/deepseek-llm-7b-chat", "null builds a fresh tiny model"),
    "model.enable_gradient_checkpointing": (True, f"{TINY_RUNS} have memory to spare; it costs a forward pass"),
    "critic.model.enable_gradient_checkpointing": (True, f"{TINY_RUNS} have memory to spare; it costs a forward pass"),
    "critic.model.path": ("~/models/deepseek-llm-7b-chat", "null: the actor's model.path, with a fresh value head"),
    "reward_model.model.trust_remote_code": (
        None,
        "a setting refppo reads (verl 0.9 reads this legacy key nowhere: its reward model's code never runs)",
    ),
    "critic.use_dynamic_bsz": (
        "${oc.select:actor_rollout_ref.actor.use_dynamic_bsz,false}",
        "the critic's micro-batches are its own setting, not the actor's",
    ),
    "actor.optim.lr": (1e-6, f"{TINY_RUNS} trained from scratch take larger steps; checkpoints want about 1e-6"),
    "critic.optim.lr": (1e-5, "a fresh value head on a tiny model must follow the returns within a short run"),
    "actor.optim.weight_decay": (0.01, "Adam's update stays the plain formula the book derives"),
    "critic.optim.weight_decay": (0.01, "Adam's update stays the plain formula the book derives"),
    "actor.ppo_mini_batch_size": (256, "a quarter of data.train_batch_size, as verl's 256 of 1024"),
    "actor.clip_ratio_low": (0.2, "null takes actor.clip_ratio, so one setting moves both bounds"),
    "actor.clip_ratio_high": (0.2, "null takes actor.clip_ratio, so one setting moves both bounds"),
    "actor.policy_loss": ("vanilla", "the same loss, named clip for chapter 3 (vanilla is accepted)"),
    "actor.use_torch_compile": (True, "null: on with CUDA, off on a CPU, where compiling costs more than it saves"),
    "trainer.total_training_steps": (None, f"{TINY_RUNS} are bounded in steps (null: trainer.total_epochs' steps)"),
    "trainer.total_epochs": (30, "a step count bounds refppo's runs; epochs bound them too when set"),
    "trainer.device": ("cuda", "CUDA when there is one, else the CPU"),
    "trainer.output_dir": ("checkpoints/${trainer.project_name}/${trainer.experiment_name}", "runs/<command>"),
    "trainer.save_freq": (-1, "a run never loses work: a checkpoint every 100 steps"),
    "trainer.test_freq": (-1, "the book plots held-out scores through a run"),
    "trainer.critic_warmup": (0, "a fresh critic needs a few steps to follow the returns (null: 6 with a critic)"),
    "actor.shuffle": (
        False,
        "textbook PPO (the PPO paper's minibatch SGD, CleanRL) draws each epoch's mini-batches afresh",
    ),
    "trainer.logger": (["console", "wandb"], "metrics.jsonl is always written; the others are optional packages"),
    "trainer.project_name": ("verl_examples", "refppo's runs"),
    "trainer.experiment_name": ("gsm8k", "null names the wandb or MLflow run after its run folder"),
}


# The settings whose default refppo chose for its tiny CPU models (and the textbook's mini-batch
# order). A verl command line means verl's config, so it starts from verl's defaults for these
# (those it reads; :func:`verl_line_defaults`).
FOR_TINY_MODELS = (
    "data.train_batch_size", "data.max_prompt_length", "data.max_response_length",
    "model.enable_gradient_checkpointing", "critic.model.enable_gradient_checkpointing", "actor.optim.lr",
    "critic.optim.lr", "actor.optim.weight_decay", "critic.optim.weight_decay", "actor.ppo_mini_batch_size",
    "actor.shuffle", "trainer.total_training_steps",
    "trainer.save_freq", "trainer.test_freq", "trainer.critic_warmup", "trainer.total_epochs",
)  # fmt: skip


def verl_line_defaults(config: Config, given: list[str], command: str = "ppo") -> list[str]:
    """verl 0.9's defaults, as overrides, for the :data:`FOR_TINY_MODELS` settings that ``refppo
    <command>`` reads in ``config`` and ``given`` (refppo-spelled overrides) does not set."""
    keys = {item.partition("=")[0].strip() for item in given}
    ignored = ignored_settings(config, command)
    read = [k for k in FOR_TINY_MODELS if k in read_settings(command, config) and k not in keys | ignored.keys()]
    return [f"{key}={format_value(OTHER_DEFAULTS[key][0])}" for key in read]


def key_map(config: Config | None = None) -> list[tuple[str, str, str, str, str]]:
    """Every refppo setting beside verl's: (refppo key, verl key or "—", refppo's default,
    verl's default where it differs or "", why it differs or why refppo alone has it)."""
    config = config or Config()
    rows = []
    for key in declarations(config):
        default = format_value(get_value(config, key))
        if key in REFPPO_ONLY:
            rows.append((key, "—", default, "", REFPPO_ONLY[key]))
        elif key in OTHER_DEFAULTS:
            theirs, why = OTHER_DEFAULTS[key]
            rows.append((key, verl_key(key), default, format_value(theirs), why))
        else:
            rows.append((key, verl_key(key), default, "", ""))
    return rows


def effective_value(config: Config, key: str):
    """The value refppo runs ``key`` with, where a null setting stands for another's (verl would
    read the null as it is): a micro-batch's rows, the critic's fallbacks to the actor's, the
    clip bounds, the critic's model and DAPO's response length.

    Args:
        config: the settings.
        key: a refppo setting (``actor.clip_ratio_low``).
    """
    section, _, name = key.rpartition(".")
    value = get_value(config, key)
    n = config.rollout.n
    if name.endswith("micro_batch_size_per_gpu") and value is None:  # null: the whole (mini-)batch's rows
        if section == "actor":
            return config.actor.ppo_mini_batch_size * n
        if section == "critic":
            return critic_setting(config, "ppo_mini_batch_size") * n
        return config.data.train_batch_size * n
    if section == "critic" and name in CRITIC_FROM_ACTOR:
        return critic_setting(config, name)
    if key == "critic.model.path":
        return config.critic.model.path or config.model.path
    if key in ("actor.clip_ratio_low", "actor.clip_ratio_high"):
        return config.actor.clip_ratio if value is None else value
    if key == "trainer.critic_warmup":
        return critic_warmup(config)
    if key == "reward_model.max_resp_len" and value is None:  # verl's DAPO manager needs it given
        return config.data.max_response_length
    return value


def verl_settings(config: Config, command: str = "ppo") -> tuple[list[str], list[str]]:
    """The verl 0.9 settings that run ``config`` as ``refppo ppo`` does: every setting it reads that
    verl shares, as ``key=value`` by verl's full key (a null that stands for another setting is
    given that one's value; ``+`` before a key verl's configuration lacks; ``model_engine=<engine>``
    first where the run needs Megatron's or VeOmni's engine, :func:`_printed_engine`), and a line for each
    setting verl has no counterpart for.

    Raises:
        ValueError: for a command other than ppo (verl's SFT trainer is a separate program).
    """
    if command != "ppo":
        raise ValueError(f"verl's main_ppo runs refppo ppo's settings: refppo {command} has none")
    ignored = ignored_settings(config, command)
    read = [key for key in read_settings(command, config) if key not in ignored]
    engine = _printed_engine(config, read)
    lines = [f"model_engine={engine}"] if engine else []
    alone = []
    for key in read:
        value = effective_value(config, key)
        decided = _engine_items(key, value, engine)
        if decided is not None:
            lines += decided[0]
            alone += decided[1]
            continue
        if (key, value) in (("data.task", "file"), ("trainer.device", "auto")):
            continue  # what verl does: prompts from files, CUDA
        if key == "actor.clip_ratio" and "actor.clip_ratio_low" in read:
            continue  # both bounds are given
        if key == "trainer.resume":  # verl's resume_mode, whose default is auto
            lines.append(f"trainer.resume_mode={'auto' if value else 'disable'}")
            continue
        if key in REFPPO_ONLY or (key.endswith("model.path") and value is None):
            alone.append(f"{key}={format_value(value)}: {REFPPO_ONLY.get(key, TINY)}")
            continue
        if isinstance(value, dict):  # verl's config holds {}: each keyword is added with "+"
            lines += [f"+{verl_key(key)}.{name}={format_value(item)}" for name, item in value.items()]
            continue
        if key == "trainer.total_epochs" and value is None:
            value = 10**6  # refppo counts steps; verl's run would end after its default 30 epochs
        if value is not None or key != "actor.use_torch_compile":
            text = f"[{','.join(map(str, value))}]" if isinstance(value, tuple) else format_value(value)
            text = {v: k[1] for k, v in VALUES.items() if k[0] == key}.get(text, text)  # verl's name of the value
            plus = "+" if verl_key(key) in ADDED else ""  # a key verl's config file lacks
            lines.append(f"{plus}{verl_key(key)}={text}")
    return lines, alone


# settings a printed engine line leaves to the engine's configuration: Megatron's constant
# schedule (lr_decay_style), VeOmni's warm-up by ratio alone and its cosine's floor of 0
ENGINE_DEFAULTS_TAKEN = {
    "megatron": (".optim.lr_scheduler_type",),
    "veomni": (".optim.lr_warmup_steps", ".optim.min_lr_ratio"),
}


def _printed_engine(config: Config, read: list[str]) -> str | None:
    """The verl engine a printed line picks: Megatron's where the optimizers are Megatron's
    (:func:`_megatron_optimizers`), the actor trains Megatron's LoRA (``model.lora.rank > 0``) or
    Megatron's router losses are on, which only verl's Megatron engines read; VeOmni's where the
    actor replays its routing and VeOmni's optimizers run the settings (every parameter decayed, a
    warm-up by ratio alone, a cosine down to 0); None (FSDP's) otherwise; ``read``: the settings the
    run reads."""
    router_losses = config.actor.moe_aux_loss_coeff != 0 or config.actor.moe_z_loss_coeff > 0
    if _megatron_optimizers(config, read) or config.model.lora.rank > 0 or router_losses:
        return "megatron"
    if config.actor.router_replay == "disabled":
        return None
    optims = [config.actor.optim] + ([config.critic.optim] if "critic.optim.lr" in read else [])
    veomni = all(
        optim.decay_1d_params
        and optim.lr_warmup_steps == -1
        and (optim.lr_scheduler_type == "constant" or optim.min_lr_ratio == 0)
        for optim in optims
    )
    return "veomni" if veomni else None


def _engine_items(key: str, value, engine: str | None) -> tuple[list[str], list[str]] | None:
    """How a printed line gives a setting its ``engine`` decides (:func:`_printed_engine`): (verl
    settings, comments), or None for a setting printed as any other."""
    if key.endswith(".optim.decay_1d_params"):
        if value and engine == "megatron":
            return [], [f"{key}=true: verl's Megatron engine spares 1-D parameters the weight decay"]
        if value or engine == "megatron":  # true: verl's FSDP and VeOmni optimizers
            return [], []
        return [], [f"{key}=false: verl's Megatron engine spares 1-D parameters for every model it trains"]
    if key == "actor.router_replay":
        if value == "disabled":
            return [], []
        if engine is None:
            return [], [f"{key}={value}: verl replays routing in its Megatron and VeOmni engines, whose optimizers "
                        "differ from these settings"]  # fmt: skip
        routes = ["actor_rollout_ref.rollout.enable_rollout_routing_replay=true"] if value == "R3" else []
        return [f"actor_rollout_ref.actor.{engine}.router_replay.mode={value}", *routes], []
    if key in ROUTER_LOSS_SETTINGS:
        return _router_loss_items(key, value), []
    section, _, size = key.rpartition(".")
    if section == "model.lora" and size in PARALLEL_SIZES:  # Megatron's, which builds the adapters
        return [f"actor_rollout_ref.actor.megatron.{size}={format_value(value)}"], []
    if engine is not None and key.endswith(ENGINE_DEFAULTS_TAKEN[engine]):
        return [], []
    return None


def _router_loss_items(key: str, value) -> list[str]:
    """The verl settings of a Megatron router loss (``actor.moe_aux_loss_coeff``, ``actor.moe_z_loss_coeff``):
    Megatron-Bridge's path, which turns the load-balancing loss off unless its type is given; none for 0."""
    section = f"+{TRANSFORMER_SETTINGS['megatron']}"  # a key verl's configuration lacks
    if value == 0:
        return []
    if key == "actor.moe_z_loss_coeff":
        return [f"{section}moe_z_loss_coeff={format_value(value)}"]
    coefficient = [] if value is None else [f"{section}moe_aux_loss_coeff={format_value(value)}"]
    return [f"{section}moe_router_load_balancing_type=aux_loss", *coefficient]


def _megatron_optimizers(config: Config, read: list[str]) -> bool:
    """Whether ``config``'s optimizers are verl's Megatron engine's: every model that takes weight
    decay spares its 1-D parameters (``optim.decay_1d_params=false``), at a constant schedule (the
    one of Megatron's that refppo has); ``read``: the settings the run reads."""
    sparing = [get_value(config, key) for key in read if key.endswith(".optim.decay_1d_params")]
    schedules = [get_value(config, key) for key in read if key.endswith(".optim.lr_scheduler_type")]
    return bool(sparing) and not any(sparing) and all(schedule == "constant" for schedule in schedules)


def verl_command(config: Config, command: str = "ppo") -> str:
    """The verl 0.9 command line that runs ``config`` as ``refppo ppo`` does (:func:`verl_settings`),
    then, as comments, the settings verl has no counterpart for."""
    lines, alone = verl_settings(config, command)
    head = " \\\n".join(["python3 -m verl.trainer.main_ppo", *(f"    {line}" for line in lines)])
    comments = "".join(f"\n#   {line}" for line in alone)
    return head + ("\n# refppo settings verl has no counterpart for:" + comments if alone else "")


def verl_yaml(config: Config, command: str = "ppo") -> str:
    """A YAML configuration verl 0.9's ``main_ppo`` loads (``--config-path=DIR --config-name=NAME``)
    and runs as ``refppo ppo`` runs ``config``: verl's ``ppo_trainer`` (found through Hydra's search path
    in the installed verl), with ``override model_engine: <engine>`` where the run needs another
    engine (:func:`_printed_engine`), then :func:`verl_settings`; the settings verl has no
    counterpart for follow as comments."""
    lines, alone = verl_settings(config, command)
    # model_engine is a choice of ppo_trainer's defaults list, made there (Hydra's override syntax)
    engines = [line.partition("=")[2] for line in lines if line.startswith("model_engine=")]
    choice = f"- override model_engine: {engines[0]}\n" if engines else ""
    settings = OmegaConf.from_dotlist([line.lstrip("+") for line in lines if not line.startswith("model_engine=")])
    head = f"hydra:\n  searchpath:\n  - {VERL_CONFIG_PACKAGE}\ndefaults:\n- ppo_trainer\n{choice}- _self_\n"
    comments = "".join(f"\n#   {line}" for line in alone)
    return (
        head
        + OmegaConf.to_yaml(settings)
        + ("# refppo settings verl has no counterpart for:" + comments if alone else "")
    )
