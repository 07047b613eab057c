"""The ``refppo`` command: ``refppo sft|rm|ppo [section.key=value ...]``, ``refppo plot`` and
``refppo doctor``.

Each command writes a run folder (``trainer.output_dir``) with ``config.json``,
``metrics.jsonl`` and its model(s) saved with ``save_pretrained`` (the tokenizer beside them), so
the next stage takes ``model.path=<run>/model`` (a PPO run's ``<run>/actor``; with LoRA that is
the merged model, and ``<run>/actor_adapter`` holds the adapter alone). Examples (the offline arithmetic pipeline)::

    refppo sft trainer.output_dir=runs/sft
    refppo ppo model.path=runs/sft/model trainer.output_dir=runs/ppo
    refppo plot runs/ppo runs/grpo -m val/score -m response_length/mean -o curves.png
    refppo doctor runs/ppo
    refppo ppo model.path=runs/sft/model --print-verl   # the same run as a verl command line
    refppo ppo model.path=runs/sft/model --print-verl-yaml > run.yaml   # ... as a verl YAML

Settings take refppo's short keys or verl 0.9's full ones (``actor_rollout_ref.actor.optim.lr``);
a setting of verl's engine is noted and has no effect (:mod:`refppo.settings.verl_names`).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path

import torch

from refppo.advantages import needs_critic
from refppo.distributed import World, broadcast, check_world, full_state_dict, launched_world, shard, start, stop
from refppo.guards.memory import SYNTHETIC_RECORD_BYTES
from refppo.guards.model_folder import (
    check_lora_adapter,
    check_lora_rank,
    check_model_folder,
    check_remote_code,
    check_same_tokenizer,
    check_vocabulary,
)
from refppo.rollout.device import resolve_device
from refppo.rollout.prompts import tokenize_prompts, tokenize_records
from refppo.runs.folder import RunFolder, check_free, check_resume, check_unlocked, check_writable, summary
from refppo.runs.loggers import check_installed, run_name
from refppo.runs.sizes import (
    check_batch_fits,
    check_fits,
    check_generation_fits,
    check_rollouts_fit,
    check_tiny_model_fits,
)
from refppo.settings.config import COMMANDS, Config, declarations, get_value
from refppo.settings.declare import check_once
from refppo.settings.hydra_line import hydra_settings, split_config_options
from refppo.settings.overrides import command_settings
from refppo.settings.validate import format_value, ignored_settings, read_settings, valid_text, validate
from refppo.settings.verl_map import verl_command, verl_yaml
from refppo.settings.verl_names import translate
from refppo.tasks import preference
from refppo.training.data import preference_sft_examples, sft_examples, task_data

# flags that print the run in verl's form instead of running it
PRINTS = ("--print-verl", "--print-verl-yaml")


def settings_help(command: str, config: Config | None = None) -> str:
    """``refppo <command> --help``: every setting the command reads with its defaults (those of
    ``config``, by default ``Config()``: for sft the arithmetic task and a fresh tiny model), as
    ``key=default`` with the valid values, and for a setting the defaults turn off, what turns it on."""
    if config is None:
        config = Config()
        config.trainer.output_dir = f"runs/{command}"
    declared = declarations(config)
    ignored = ignored_settings(config, command)
    rows = []
    for key in read_settings(command, config):
        note = f"(read only with {ignored[key]})" if key in ignored else ""
        rows.append(
            (
                f"{key}={format_value(get_value(config, key))}",
                "  ".join(filter(None, [valid_text(declared[key]), note])),
            )
        )
    width = max(len(setting) for setting, _ in rows) + 2
    usage = f"usage: refppo {command} [key=value ...]" + (
        " [--print-verl | --print-verl-yaml]" if command == "ppo" else ""
    )
    lines = [usage, "", "settings (key=default, then the valid values; verl 0.9's full keys are accepted too):"]
    return "\n".join(lines + [f"  {setting.ljust(width)}{valid}".rstrip() for setting, valid in rows])


def load_tokenizer(path: str | None, trust_remote_code: bool = False):
    """The tokenizer saved beside a model (its own code run only with ``trust_remote_code``), or
    the offline tasks' character tokenizer."""
    # transformers is imported here and in the commands, not with this module: help and the
    # settings' refusals then answer without its import time
    if path is not None and os.path.exists(os.path.join(path, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        from refppo.rollout.models import prepare_tokenizer

        return prepare_tokenizer(AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code))
    from refppo.tasks.tokenizer import build_tokenizer

    return build_tokenizer()


def _model_folders(config: Config, command: str) -> list[tuple[str, str]]:
    """(setting, folder) of each model ``command`` loads, the actor's (``model.path``) first."""
    folders = [("model.path", config.model.path)]
    if command == "ppo" and needs_critic(config.algorithm.adv_estimator) and config.critic.model.path:
        folders.append(("critic.model.path", config.critic.model.path))
    if command == "ppo" and config.reward_model.enable:
        folders.append(("reward_model.model.path", config.reward_model.model.path))
    return [(key, path) for key, path in folders if path is not None]


SCALAR_HEAD = "AutoModelForTokenClassification"


def _remote_code_loads(config: Config, command: str) -> list[tuple[str, str, str, bool, str]]:
    """(setting, folder, its trust_remote_code setting, that setting's value, the Auto class
    built) of each model ``command`` builds; the critic without a path of its own is model.path's
    folder under critic.model.trust_remote_code, as verl's critic.model.path defaults to the actor's."""
    m = config.model
    model_class = SCALAR_HEAD if command == "rm" else "AutoModelForCausalLM"  # rm trains a scalar head
    loads = [("model.path", m.path, "model.trust_remote_code", m.trust_remote_code, model_class)]
    if command == "ppo" and needs_critic(config.algorithm.adv_estimator):
        critic = config.critic.model
        key = "critic.model.path" if critic.path else "model.path"
        trust_key = "critic.model.trust_remote_code"
        loads.append((key, critic.path or m.path, trust_key, critic.trust_remote_code, SCALAR_HEAD))
    if command == "ppo" and config.reward_model.enable:
        rm = config.reward_model.model
        trust_key = "reward_model.model.trust_remote_code"
        loads.append(("reward_model.model.path", rm.path, trust_key, rm.trust_remote_code, SCALAR_HEAD))
    return [load for load in loads if load[1] is not None]


def checked_tokenizer(config: Config, command: str):
    """Check every model folder ``command`` loads (:func:`refppo.guards.model_folder.check_model_folder`)
    and return the tokenizer of ``model.path`` (the offline tasks' one without it), refusing one
    with tokens the models have no embedding for, a critic or reward model whose own tokenizer
    differs from it, and a LoRA rank above the actor's hidden size."""
    folders = _model_folders(config, command)
    positions = config.data.max_prompt_length + config.data.max_response_length
    specs = {
        key: check_model_folder(path, key, head=False if key == "model.path" else None, positions=positions)
        for key, path in folders
    }
    for key, path, trust_key, trusted, auto_class in _remote_code_loads(config, command):
        check_remote_code(specs[key], key, path, trust_key, trusted, auto_class)
    if command == "ppo" and config.model.path is not None:
        check_lora_rank(config.model.lora_rank, specs["model.path"], config.model.path)
        check_lora_rank(config.model.lora.rank, specs["model.path"], config.model.path, setting="model.lora.rank")
        if config.model.lora_adapter_path is not None:
            check_lora_adapter(config.model.lora_adapter_path, specs["model.path"], config.model.path)
    tokenizer = _tokenizer(config.model.path, "model.path", "model.trust_remote_code", config.model.trust_remote_code)
    trust = {"critic.model.path": config.critic.model, "reward_model.model.path": config.reward_model.model}
    for key, path in folders:
        if isinstance(specs[key].get("vocab_size"), int):
            check_vocabulary(tokenizer, specs[key]["vocab_size"], key, path)
        if key != "model.path" and os.path.exists(os.path.join(path, "tokenizer_config.json")):
            trust_key = key.removesuffix("path") + "trust_remote_code"
            other = _tokenizer(path, key, trust_key, trust[key].trust_remote_code)
            check_same_tokenizer(tokenizer, other, key, path)
    return tokenizer


def _tokenizer(path: str | None, key: str, trust_key: str, trusted: bool):
    """:func:`load_tokenizer`, with transformers' refusal of a tokenizer's own code (its
    tokenizer_config.json's auto_map) naming the setting that allows it."""
    try:
        return load_tokenizer(path, trusted)
    except ValueError as error:
        if trusted or "trust_remote_code" not in str(error):
            raise
        raise ValueError(
            f"{key}={path}: its tokenizer is built by the folder's own Python code (tokenizer_config.json's "
            f"auto_map), which runs only with {trust_key}=true; set it if you trust that code"
        ) from None


def _save_model(model, tokenizer, folder: Path, world: World, *, progress_bar: bool) -> None:
    """``save_pretrained`` of a model and its tokenizer; with several processes the model's shards
    are gathered first and the first process writes. transformers' own bar ("Writing model
    shards") shows only with ``trainer.progress_bar``, as refppo's do."""
    state = full_state_dict(model, world)
    if world.main:
        with _transformers_bars(shown=progress_bar):
            model.save_pretrained(folder, state_dict=state)
        tokenizer.save_pretrained(folder)


@contextlib.contextmanager
def _transformers_bars(shown: bool):
    """transformers' progress bars off inside unless ``shown``; as they were after."""
    from transformers.utils import logging as hf_logging  # not at the top: --help answers without it

    enabled = hf_logging.is_progress_bar_enabled()
    if not shown:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def run_sft(config: Config, make_run, world: World, device: torch.device) -> None:
    """``refppo sft``: train the policy on demonstrations, the task's or a file's
    (:mod:`refppo.training.user_data`), from a tiny model of ``model.arch`` and its sizes or from
    ``model.path``; ``make_run()`` creates the run folder, called only after every check has
    passed; ``world`` and ``device``: the processes and this one's device."""
    from refppo.accel import select
    from refppo.training.sft import held_out_loss, held_out_score, train_sft

    tokenizer = checked_tokenizer(config, "sft")
    model = _sft_model(config, tokenizer, world, device)
    s = config.sft
    if config.data.task == "file":
        examples, held, score_held = _file_demonstrations(config, tokenizer, model.config, world, device)
    else:
        if config.data.task == "preference":  # each synthetic demonstration is built in memory first
            n = preference_sft_examples(config)
            check_fits(n * SYNTHETIC_RECORD_BYTES, torch.device("cpu"), f"sft.n_examples={n}")
        examples = sft_examples(config)
        held = []
        _, records, reward_fn = task_data(config, tokenizer)
        scored = "data.val_size (scored after training)"
        check_generation_fits(config, model.config, config.data.val_size, scored, world, device)
        score_held = lambda model: held_out_score(model, tokenizer, records, reward_fn, config.data, world)
    check_batch_fits(s.batch_size, len(examples), "sft.batch_size", "training demonstrations (sft.n_examples)")
    run = make_run()
    log_probs_fn = select(config, device, world.distributed).actor.log_probs
    train_sft(
        model,
        tokenizer,
        examples,
        s.steps,
        s.batch_size,
        s.lr,
        config.trainer.seed,
        run.log,
        config.trainer.progress_bar,
        log_probs_fn=log_probs_fn,
        world=world,
        chat_template_kwargs=config.data.apply_chat_template_kwargs,
    )
    _save_model(model, tokenizer, run.path / "model", world, progress_bar=config.trainer.progress_bar)
    held_out = {}
    if held:
        kwargs = config.data.apply_chat_template_kwargs
        held_out["val/loss"] = held_out_loss(
            model, tokenizer, held, log_probs_fn=log_probs_fn, chat_template_kwargs=kwargs
        )
    if score_held is not None:
        held_out["val/accuracy" if config.data.task == "file" else "val/score"] = score_held(model)
    if held_out:
        run.log(s.steps, held_out)


def _sft_model(config: Config, tokenizer, world: World, device: torch.device):
    """The model SFT trains: ``model.path``, or a fresh tiny model of ``model.arch`` and its sizes
    (checked to fit first), with the speed options it asks for, sharded over the processes."""
    from refppo.accel.checkpointing import enable_gradient_checkpointing
    from refppo.accel.logprobs import check_fused_kernels
    from refppo.rollout.models import load_causal_lm, tiny_config

    m = config.model
    if m.path is None:
        check_tiny_model_fits(config, len(tokenizer), device)
    source = m.path or tiny_config(
        tokenizer, m.arch, m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads
    )
    torch.manual_seed(config.trainer.seed)
    model = load_causal_lm(source, tokenizer, device, trust_remote_code=m.trust_remote_code)
    if m.use_fused_kernels:
        check_fused_kernels(model, "SFT model")
    if m.enable_gradient_checkpointing:
        enable_gradient_checkpointing(model)
    shard(model, world)
    return model


def _file_demonstrations(config: Config, tokenizer, model_config, world: World, device: torch.device):
    """(training (prompt, response) pairs, held-out pairs, a function of a model giving its
    held-out ``val/accuracy``, or None) from ``data.train_files``. The accuracy is that of the
    model's greedy answer to the last turn of each held-out record
    (:func:`refppo.tasks.rules.answer_accuracy`), when every held-out record has a ground truth."""
    from refppo.tasks.rules import answer_accuracy, ground_truth
    from refppo.training.sft import greedy_score
    from refppo.training.user_data import demonstrations

    train, held = demonstrations(config.data, tokenizer, config.trainer.seed)
    train = train[: config.sft.n_examples]
    pairs = lambda items: [(prompt, response) for prompt, response, _ in items]
    last_turns = list({id(record): (prompt, record) for prompt, _, record in held}.values())
    if not held or any(ground_truth(record) is None for _, record in last_turns):
        return pairs(train), pairs(held), None
    scored = "the held-out records (answered after training)"
    check_generation_fits(config, model_config, len(last_turns), scored, world, device)
    prompts = [prompt for prompt, _ in last_turns]
    ids, mask = tokenize_prompts(
        tokenizer, prompts, config.data.max_prompt_length, chat_template_kwargs=config.data.apply_chat_template_kwargs
    )
    records = [record for _, record in last_turns]
    limit = config.data.max_response_length
    accuracy = lambda model: greedy_score(model, tokenizer, ids, mask, records, answer_accuracy, limit, world)
    return pairs(train), pairs(held), accuracy


def run_rm(config: Config, make_run, world: World, device: torch.device) -> None:
    """``refppo rm``: a reward model from the SFT model (``model.path``) on comparisons, synthetic
    ones (``data.task=preference``) or a file's (:mod:`refppo.training.user_data`); ``make_run()`` as in
    :func:`run_sft`."""
    from refppo.accel.checkpointing import enable_gradient_checkpointing
    from refppo.rollout.models import load_value_model
    from refppo.training.reward_model import center_reward_model, held_out_comparisons, train_reward_model
    from refppo.training.user_data import comparisons

    if config.model.path is None:
        raise ValueError("refppo rm starts from the SFT model: set model.path=<sft run>/model")
    tokenizer = checked_tokenizer(config, "rm")
    r = config.rm
    if config.data.task == "file":
        pairs, held = comparisons(config.data, tokenizer, config.trainer.seed)
        centre_on = [(prompt, response) for prompt, chosen, rejected in pairs for response in (chosen, rejected)]
    else:
        check_fits(r.n_pairs * SYNTHETIC_RECORD_BYTES, torch.device("cpu"), f"rm.n_pairs={r.n_pairs}")
        pairs = preference.make_comparisons(r.n_pairs, seed=config.trainer.seed + 10)
        held = []
        centre_on = preference.make_sft_examples(512, seed=config.trainer.seed + 20)
    check_batch_fits(r.batch_size, len(pairs), "rm.batch_size", "training comparisons (rm.n_pairs)")
    kwargs = config.data.apply_chat_template_kwargs
    torch.manual_seed(config.trainer.seed)
    rm = load_value_model(config.model.path, tokenizer, device, trust_remote_code=config.model.trust_remote_code)
    if config.model.enable_gradient_checkpointing:
        enable_gradient_checkpointing(rm)
    shard(rm, world)
    run = make_run()
    train_reward_model(
        rm,
        tokenizer,
        pairs,
        r.steps,
        r.batch_size,
        r.lr,
        config.trainer.seed,
        run.log,
        config.trainer.progress_bar,
        world,
        chat_template_kwargs=kwargs,
    )
    if r.center:
        prompts, responses = [p for p, _ in centre_on], [response for _, response in centre_on]
        center_reward_model(rm, tokenizer, prompts, responses, chat_template_kwargs=kwargs)
    _save_model(rm, tokenizer, run.path / "model", world, progress_bar=config.trainer.progress_bar)
    if held:
        run.log(r.steps, held_out_comparisons(rm, tokenizer, held, chat_template_kwargs=kwargs))


def probe_reward_fn(reward_fn, records: list[dict], tokenizer, data) -> None:
    """Call a reward function on one record, then on three, as the trainer would (the prompts as
    it decodes them, empty responses), so that one that cannot score, or that returns a fixed
    number of scores, is refused before the run folder exists.

    Args:
        reward_fn: ``(prompts, responses, records) -> (B,) scores``.
        records: the task's records; the first three are used (fewer if there are fewer).
        tokenizer: the run's tokenizer.
        data: the run's ``data.*`` settings (how prompts are tokenized).
    """
    from refppo.training.reward_fns import describe, split_reward_result

    for size in sorted({1, min(3, len(records))}):
        probe = records[:size]
        ids, _ = tokenize_records(tokenizer, probe, data)
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        split_reward_result(reward_fn(texts, [""] * size, probe), size, f"reward function {describe(reward_fn)}")


def run_ppo(config: Config, make_run, world: World, device: torch.device) -> None:
    """``refppo ppo``: the PPO (or GRPO, RLOO) loop from the SFT model (``model.path``), with the
    task's reward, ``reward_model.reward_fn`` or a trained reward model (``reward_model.enable``);
    ``make_run()`` as in :func:`run_sft`."""
    from refppo.rollout.megatron_lora import has_megatron_lora, merge_megatron_lora, save_megatron_lora
    from refppo.rollout.models import freeze, is_lora, load_value_model
    from refppo.tasks.rules import require_rules
    from refppo.training.fit import fit
    from refppo.training.trainer import PPOTrainer

    if config.model.path is None:
        raise ValueError("refppo ppo starts from an SFT model: set model.path=<sft run>/model")
    tokenizer = checked_tokenizer(config, "ppo")
    check_rollouts_fit(config, world, device)
    train, val, task_reward = task_data(config, tokenizer)
    check_batch_fits(config.data.train_batch_size, len(train), "data.train_batch_size", "training prompts")
    validate(config, "ppo")
    torch.manual_seed(config.trainer.seed)
    actor = _ppo_actor(config, tokenizer, device)
    critic = None
    if needs_critic(config.algorithm.adv_estimator):
        critic_model = config.critic.model
        critic = load_value_model(
            critic_model.path or config.model.path, tokenizer, device, trust_remote_code=critic_model.trust_remote_code
        )
    reward_model = None
    if config.reward_model.enable:
        rm_model = config.reward_model.model
        reward_model = load_value_model(
            rm_model.path, tokenizer, device, require_head=True, trust_remote_code=rm_model.trust_remote_code
        )
        reward_model = freeze(reward_model)
    reward_fn = _ppo_reward_fn(config, task_reward)
    if reward_fn is None and reward_model is None:
        require_rules(train + val)
    if reward_fn is not None:
        probe_reward_fn(reward_fn, val + train, tokenizer, config.data)
    # With a learned reward, the task's own rule is the gold score: report it, never train on it.
    extras = {"gold": task_reward} if reward_model is not None and task_reward is not None else None
    trainer = PPOTrainer(
        config,
        tokenizer,
        actor,
        critic,
        train,
        val,
        reward_fn=reward_fn,
        reward_model=reward_model,
        extra_reward_fns=extras,
        answer_fn=str.strip if config.data.task == "arithmetic" else None,  # its response is the answer
        world=world,
    )
    run = make_run()
    if run.resume is not None:
        trainer.load_checkpoint(run.resume.folder, run.resume.state)
    fit(trainer, run, config.trainer.progress_bar)
    if has_megatron_lora(actor):  # the adapters, then the merged model the next stage loads as model.path
        save_megatron_lora(actor, run.path / "actor_adapter")
        actor = merge_megatron_lora(actor)
    elif is_lora(actor):
        _save_model(actor, tokenizer, run.path / "actor_adapter", world, progress_bar=config.trainer.progress_bar)
        actor = actor.merge_and_unload()
    _save_model(actor, tokenizer, run.path / "actor", world, progress_bar=config.trainer.progress_bar)


def _ppo_actor(config: Config, tokenizer, device: torch.device):
    """The actor: ``model.path``, under a saved LoRA adapter (``model.lora_adapter_path``), a
    fresh one (``model.lora_rank > 0``) or Megatron's adapters (``model.lora.rank > 0``)."""
    from refppo.rollout.megatron_lora import add_megatron_lora
    from refppo.rollout.models import add_lora, check_router_losses, load_causal_lm, load_lora_adapter

    m = config.model
    actor = load_causal_lm(m.path, tokenizer, device, trust_remote_code=m.trust_remote_code)
    check_router_losses(actor, config.actor.moe_aux_loss_coeff, config.actor.moe_z_loss_coeff)
    if m.lora_adapter_path is not None:
        return load_lora_adapter(actor, m.lora_adapter_path)
    if m.lora_rank > 0:
        return add_lora(actor, m.lora_rank, m.lora_alpha)
    if m.lora.rank > 0:
        return add_megatron_lora(actor, m.lora)
    return actor


def _ppo_reward_fn(config: Config, task_reward):
    """The reward function PPO scores with: ``reward_model.reward_fn``, a verl custom reward
    function from a file, or the task's own rule (None: none, a reward model scores)."""
    from refppo.training.reward_fns import load_reward_fn, load_verl_reward_fn

    rm = config.reward_model
    if rm.reward_fn:
        return load_reward_fn(rm.reward_fn)
    if rm.custom_reward_function.path:
        custom = rm.custom_reward_function
        # verl's GDPO reward manager hands the function the run's name (verl's rlla.py reads it)
        folder = Path(config.trainer.output_dir)
        named = {"experiment_name": run_name(config, folder)} if rm.reward_manager == "gdpo" else None
        return load_verl_reward_fn(custom.path, custom.name, extra_info=named)
    return task_reward


def _raised_by_refppo(error: BaseException) -> bool:
    """Whether the innermost frame of ``error``'s traceback is refppo's own code."""
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    package = Path(__file__).resolve().parents[1]  # refppo/, this module being refppo/runs/cli.py
    return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(package)


def entry() -> int:
    """The ``refppo`` command and ``python -m refppo``: :func:`main`, where a setting or input that
    refppo's checks refuse before a run starts is one line on stderr (``refppo: error: ...``, exit
    status 2) instead of a traceback. An error raised elsewhere (a reward function, a library) or
    once the run folder is being made keeps its traceback, and under torchrun a line naming the
    process that failed."""
    started = []
    world = launched_world()
    try:
        if sys.argv[1:2] and sys.argv[1] in COMMANDS:
            # in refppo's spelling: one setting, two names (a configuration file's, then overridden, is not)
            check_once(translate(hydra_settings(split_config_options(sys.argv[2:])[1])[0])[0])
        return main(on_start=lambda: started.append(True))
    except (ValueError, OSError, ImportError) as error:
        if started or not _raised_by_refppo(error):
            _name_the_process(world, error)
            raise
        if world.main:  # every process refuses the same settings: say it once
            print(f"refppo: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        _name_the_process(world, error)
        raise


def _name_the_process(world: World, error: BaseException) -> None:
    """With several processes, one line naming the process that failed and why (torchrun then
    stops the others)."""
    if world.distributed:
        # one write, so that two processes' lines do not interleave
        sys.stderr.write(f"refppo: process {world.rank} of {world.size} failed: {type(error).__name__}: {error}\n")
        sys.stderr.flush()


def main(argv: list[str] | None = None, on_start=None) -> int:
    """Entry point: ``refppo sft|rm|ppo [key=value ...]`` or ``refppo plot RUN ... -m KEY -o FILE``.

    Args:
        argv: the arguments after ``refppo``; default ``sys.argv[1:]``.
        on_start: called once every check has passed, just before the run folder is made.
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "plot":
        from refppo.runs.plots import run_plot

        return run_plot(argv[1:])
    if argv and argv[0] == "doctor":
        from refppo.runs.doctor import run_doctor

        return run_doctor(argv[1:])
    asked = bool(argv) and argv[0] in ("-h", "--help")
    if not argv or argv[0] not in COMMANDS:
        out = sys.stdout if asked else sys.stderr
        if argv and not asked:  # a mistyped command: one line, not the whole help
            print(
                f"refppo: error: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}, plot, doctor", file=out
            )
        else:
            print(_as_plain_text(__doc__), file=out)
        print(
            f"usage: refppo {{{'|'.join(COMMANDS)}}} [section.key=value ...]   (refppo COMMAND --help: its settings)\n"
            "       refppo plot RUN [RUN ...] -m METRIC -o FILE\n       refppo doctor RUN [RUN ...]",
            file=out,
        )
        return 0 if asked else 2
    command = argv[0]
    overrides = argv[1:]
    if "-h" in overrides or "--help" in overrides:
        print(settings_help(command))
        return 0
    config, notes = command_settings(command, [o for o in overrides if o not in PRINTS])
    world = launched_world()  # torchrun's processes, or one
    if world.main:
        print("".join(f"refppo: note: {note}\n" for note in notes), end="", file=sys.stderr)
    if "--print-verl" in argv:
        print(verl_command(config, command))
        return 0
    if "--print-verl-yaml" in argv:
        print(verl_yaml(config, command), end="")
        return 0
    check_world(config, world)
    check_installed(config.trainer.logger)
    device = start(world, resolve_device(config.trainer.device))
    out = config.trainer.output_dir
    # Before any work: a run is never written over another, and a resume finds a checkpoint
    # that loads and the same settings (an empty or missing folder starts fresh). The first
    # process looks, the others take its answer.
    resume = broadcast(_checked_folder(out, config, command) if world.main else None, world)
    if isinstance(resume, Exception):
        raise resume
    try:
        _run_command(command, config, resume, world, device, on_start)
    finally:
        stop(world)
    if world.main:
        print(summary(out))
    return 0


def _run_command(command: str, config: Config, resume, world: World, device: torch.device, on_start) -> None:
    """Run ``refppo <command>``. It loads everything that can fail (models, data, reward function)
    first and only then creates the run folder, whose loggers' runs end as finished, or failed."""
    made: list[RunFolder] = []

    def folder() -> RunFolder:
        if on_start is not None:
            on_start()
        made.append(RunFolder(config.trainer.output_dir, config, resume, world))
        return made[-1]

    ok = False
    try:
        {"sft": run_sft, "rm": run_rm, "ppo": run_ppo}[command](config, folder, world, device)
        ok = True
    finally:
        for run in made:
            run.close(ok)


def _as_plain_text(docstring: str) -> str:
    """A reStructuredText docstring as a terminal shows it: roles (``:mod:`x```) and literals
    (````x````) as their bare text, a literal block's ``::`` as ``:``."""
    text = re.sub(r":\w+:`([^`]+)`", r"\1", docstring)
    return text.replace("``", "").replace("::\n", ":\n")


def _checked_folder(out: str, config: Config, command: str):
    """:func:`refppo.runs.folder.check_resume`'s answer for ``out`` (None: a fresh run in a free folder),
    or the error refusing it, to pass to the other processes."""
    try:
        check_writable(out)
        check_unlocked(out)
        resume = check_resume(out, config) if config.trainer.resume else None
        if resume is None:
            check_free(out, resumable=command in declarations(config)["trainer.resume"].commands)
        return resume
    except (ValueError, OSError) as error:
        return error


if __name__ == "__main__":
    raise SystemExit(entry())
