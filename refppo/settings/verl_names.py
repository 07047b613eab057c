"""verl 0.9's spellings of refppo's settings (ch 5), so that a verl command line runs as it is.

:func:`translate` reads each setting of a verl line with the tables of
:mod:`refppo.settings.verl_keys`:

- verl's full paths (``actor_rollout_ref.actor.optim.lr``) and its other names
  (``actor.policy_loss.loss_mode``, ``trainer.default_local_dir``) are the same settings as
  refppo's short ones: one setting, two spellings (:func:`refppo_key`).
- A setting of verl's engine (vLLM, FSDP, Ray, the cluster) is taken with a note that it has no
  effect here; one verl's code leaves unread, or fills itself, is dropped with a note saying why.
- A verl setting that would change the numbers and that refppo does not implement is refused,
  naming what is missing, unless it is given the value that means "off".
- A refppo setting that has been renamed is refused with its new name.
- A setting read against the rest of the line (``critic.enable``, bypass mode's loss and its
  settings) is checked on the translated line.
- ``data.train_files`` without ``data.task`` reads the prompts from the files (``data.task=file``),
  as a verl command line that names only its files means.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable

from refppo.advantages import needs_critic
from refppo.settings.verl_keys import (
    ACTOR_ROUTER_REPLAY,
    APPLY_CHAT_TEMPLATE_OWN,
    BYPASS_LOSS_DEFAULTS,
    CRITIC_SEED_FROM_ACTOR,
    CUT_FROM_THE_LEFT,
    DETECTED_DEVICES,
    DICTS,
    ENGINE,
    ENGINE_GROUPS,
    FULL,
    KEY_VALUES,
    LORA_PARALLEL_SIZES,
    MEGATRON_ENGINES,
    MEGATRON_LORA_RANK,
    MISSING,
    MISSING_CHOICES,
    MODEL_ENGINES,
    NAMES,
    NOT_IMPLEMENTED,
    OFF,
    OWN_NOTES,
    PEFT_LORA,
    REMOVE_PADDING,
    RENAMED,
    ROLLOUT_LENGTHS,
    ROLLOUT_ROUTES,
    ROUTER_REPLAY_ENGINES,
    SECTIONS,
    SEQUENCE_PARALLEL,
    TORCHTITAN,
    TRANSFORMER_SETTINGS,
    UNREAD_BY_VERL,
    VALUES,
    VEOMNI_UNREAD,
    WORKER_ROLLOUT_CORRECTION,
)


def full_path(key: str) -> str:
    """A key as verl spells it in full (``actor.optim.lr`` -> ``actor_rollout_ref.actor.optim.lr``)."""
    return FULL + key if key.startswith(SECTIONS) else key


def refppo_key(key: str) -> str:
    """The refppo setting a key names, in either spelling: ``actor_rollout_ref.actor.optim.lr``
    and ``actor.optim.lr`` are both ``actor.optim.lr``; any other key is returned as it is."""
    full = full_path(key)
    if full in NAMES:
        return NAMES[full]
    return full[len(FULL) :] if full.startswith(FULL) else key


def _in_family(full: str, k: str) -> bool:
    """Whether the verl key ``full`` is the table key ``k``, or one under it when ``k`` ends in "."."""
    return full == k or (k.endswith(".") and full.startswith(k))


def _is_engine(full: str) -> bool:
    return any(_in_family(full, k) for k in ENGINE)


def _line_values(items: list[str]) -> dict[str, str]:
    """The values of ``key=value`` settings (a verl command line's, or translated ones) by verl's
    full key, ``+`` dropped and spaces stripped; a key given twice takes its last value."""
    values = {}
    for item in items:
        key, _, text = item.partition("=")
        values[full_path(key.strip().lstrip("+"))] = text.strip()
    return values


def _unquoted(text: str) -> str:
    """An override's value without its quotes, its case kept (verl's router-replay modes are R2, R3)."""
    return text.strip().strip("'\"")


def _plain(text: str) -> str:
    """An override's value as verl's Hydra reads it, for comparing: no quotes, lower case."""
    return _unquoted(text).lower().replace("none", "null")


def _same_value(text: str, off: str) -> bool:
    """Whether two plain values are one value as Hydra reads them (``0`` is ``0.0``)."""
    if text == off:
        return True
    try:
        return float(text) == float(off)
    except ValueError:
        return False


def _line_engine(given: dict[str, str]) -> str:
    """The ``model_engine`` a verl command line's values (:func:`_line_values`) pick: FSDP's, dp, unless given."""
    return _plain(given.get("model_engine", "dp"))


def _sequence_parallel_budgets(translated: list[str], line: list[str], notes: list[str]) -> list[str]:
    """``translated`` (refppo's keys) with each token budget multiplied by its model's
    sequence-parallel size under the engine of the verl command ``line`` (:data:`SEQUENCE_PARALLEL`);
    a note for each goes to ``notes``."""
    given = _line_values(line)
    engine = _line_engine(given)
    out = []
    for item in translated:
        key, sep, text = item.partition("=")
        size_keys = SEQUENCE_PARALLEL.get(key.strip(), {}).get(engine, ())
        sizes = [given[k] for k in size_keys if k in given]
        if not sep or not sizes or int(_plain(sizes[0])) == 1:
            out.append(item)
            continue
        budget = int(_plain(text)) * int(_plain(sizes[0]))
        notes.append(
            f"{key}={text} with a sequence-parallel size of {_plain(sizes[0])} in verl's {engine} engine: verl's "
            f"micro-batches hold {budget} tokens, and so do refppo's"
        )
        out.append(f"{key}={budget}")
    return out


def _estimator(translated: list[str]) -> str:
    """The advantage estimator a translated line gives (verl's default, gae, when it gives none)."""
    return _plain(_line_values(translated).get("algorithm.adv_estimator", "gae"))


def _critic_enable(text: str, translated: list[str], notes: list[str]) -> None:
    """verl 0.9's ``critic.enable`` (``need_critic`` in ``verl/trainer/ppo/utils.py``): null leaves
    the choice to the estimator, as refppo always does; true or false must agree with it."""
    value = _plain(text)
    if value == "null":
        return
    estimator = _estimator(translated)
    if (value == "true") != needs_critic(estimator):
        raise ValueError(
            f"critic.enable={text} with algorithm.adv_estimator={estimator}: refppo trains a critic exactly when "
            "the estimator reads one (gae); it does not implement a critic the advantages ignore or GAE without one"
        )
    notes.append(f"critic.enable={text} is refppo's behaviour already with algorithm.adv_estimator={estimator}")


def _bypass_loss(key: str, text: str, line: list[str], translated: list[str], notes: list[str]) -> None:
    """verl's bypass-mode loss chosen by name (``policy_loss.loss_mode=bypass_mode``), as verl's
    documentation has a bypass-mode line do: its workers take the loss from their own settings, and
    ``apply_bypass_mode`` (``verl/trainer/ppo/rollout_corr_helper.py``) changes only the trainer's
    copy. refppo's bypass mode computes that loss, so the name is its behaviour beside
    ``algorithm.rollout_correction.bypass_mode=true`` and refused without it. The loss reads its
    settings from the workers' copy only (:func:`_worker_rollout_correction`), so a loss setting the
    verl command ``line`` gives under ``algorithm.rollout_correction`` alone is refused."""
    if _plain(_line_values(translated).get("algorithm.rollout_correction.bypass_mode", "false")) != "true":
        raise ValueError(
            f"{key}={text}: refppo computes bypass mode's loss in bypass mode: give it with "
            "algorithm.rollout_correction.bypass_mode=true (and the loss's settings under "
            f"{WORKER_ROLLOUT_CORRECTION}*)"
        )
    _bypass_settings_in_the_workers_copy(key, text, line)
    notes.append(f"{key}={text} is refppo's loss in bypass mode (algorithm.rollout_correction.bypass_mode=true)")


def _bypass_settings_in_the_workers_copy(key: str, text: str, line: list[str]) -> None:
    """Refuse a setting of bypass mode's loss that the verl command ``line`` (which names that loss,
    ``key=text``) gives under ``algorithm.rollout_correction`` at other than
    :data:`BYPASS_LOSS_DEFAULTS` and not in the workers' copy, which alone verl's loss reads."""
    given = _line_values(line)
    for field, default in BYPASS_LOSS_DEFAULTS.items():
        trainers = f"algorithm.rollout_correction.{field}"
        workers = WORKER_ROLLOUT_CORRECTION + field
        if trainers in given and workers not in given and not _same_value(_plain(given[trainers]), default):
            raise ValueError(
                f"{trainers}={given[trainers]} with {key}={text}: verl's workers compute bypass mode's loss from "
                f"their own copy of the setting, {workers} ({default} unless given), and would not read this one; "
                "give it there too, as verl's documentation does"
            )


def _bypass_by_name(line: list[str]) -> bool:
    """Whether the verl command ``line`` chooses bypass mode's loss by name."""
    for item in line:
        key, _, text = item.partition("=")
        if refppo_key(key.strip().lstrip("+")) == "actor.policy_loss" and _plain(text) == "bypass_mode":
            return True
    return False


def _worker_rollout_correction(key: str, text: str, line: list[str], translated: list[str], notes: list[str]) -> None:
    """A setting of verl's worker-side copy of the rollout correction settings
    (``actor.policy_loss.rollout_correction.*``), which only verl's bypass-mode loss reads
    (``compute_policy_loss_bypass_mode`` in ``verl/trainer/ppo/core_algos.py``). On a ``line`` that
    chooses that loss by name it is refppo's ``algorithm.rollout_correction.*``, added to
    ``translated`` unless the line gives that too, when the two must agree (verl's documentation has a
    bypass line give both); on any other line, and for its ``bypass_mode``, which no worker reads,
    verl leaves it unread. A note for each goes to ``notes``."""
    name = full_path(key).removeprefix(WORKER_ROLLOUT_CORRECTION)
    if name == "bypass_mode" or not _bypass_by_name(line):
        notes.append(
            f"{key}={text} is not read: verl's workers read it only in bypass mode's loss, chosen by "
            "actor.policy_loss.loss_mode=bypass_mode (verl leaves it unread too)"
        )
        return
    target = f"algorithm.rollout_correction.{name}"
    given = _line_values(translated).get(target)
    if given is not None and not _same_value(_plain(given), _plain(text)):
        raise ValueError(
            f"{key}={text} and {target}={given}: verl's bypass loss reads the first, and refppo's one "
            f"setting is {target}; give the two the same value"
        )
    notes.append(f"{key}={text} is refppo's {target}, which its bypass-mode loss reads")
    if given is None:
        translated.append(f"{target}={text}")


def _line_check(
    key: str, full: str, sep: str, text: str, line: list[str]
) -> Callable[[list[str], list[str]], None] | None:
    """For a verl setting read against the rest of the verl command ``line`` (``critic.enable``,
    bypass mode's loss by name and its settings, ``model_engine``, ``rollout.calculate_log_probs``):
    its check, to run on the translated line with the notes; None for any other setting."""
    if sep and full == "critic.enable":
        return functools.partial(_critic_enable, text)
    if sep and refppo_key(key) == "actor.policy_loss" and _plain(text) == "bypass_mode":
        return functools.partial(_bypass_loss, key, text, line)
    if sep and full.startswith(WORKER_ROLLOUT_CORRECTION):
        return functools.partial(_worker_rollout_correction, key, text, line)
    if sep and full == "model_engine":
        return functools.partial(_model_engine, key, text, line)
    if sep and full == "actor_rollout_ref.rollout.calculate_log_probs":
        return functools.partial(_calculate_log_probs, key, text)
    if sep and full in ACTOR_ROUTER_REPLAY.values():
        return functools.partial(_router_replay, key, full, text, line)
    if sep and full == ROLLOUT_ROUTES:
        return functools.partial(_rollout_routes, key, text, line)
    if sep and key.startswith(FULL) and full in (MEGATRON_LORA_RANK, *PEFT_LORA):
        return functools.partial(_lora_of_the_engine, key, full, text, line)
    if sep and full in LORA_PARALLEL_SIZES:
        return functools.partial(_lora_parallel_size, key, full, text, line)
    return None


def _actor_strategy(line: list[str]) -> str:
    """The actor's ``strategy`` on a verl command ``line``: given, or its ``model_engine``'s (each
    engine's actor configuration sets its own: fsdp, megatron, veomni, ...)."""
    given = _line_values(line)
    engine = _line_engine(given)
    return _plain(given.get("actor_rollout_ref.actor.strategy", "fsdp" if engine == "dp" else engine))


def _line_router_replay(line: list[str]) -> str:
    """The actor's router replay on a verl command ``line``: the mode in the copy of its strategy's
    engine, if that engine replays (:data:`ROUTER_REPLAY_ENGINES`); else disabled."""
    strategy = _actor_strategy(line)
    if strategy not in ROUTER_REPLAY_ENGINES:
        return "disabled"
    return _unquoted(_line_values(line).get(ACTOR_ROUTER_REPLAY[strategy], "disabled"))


def _router_replay(key: str, full: str, text: str, line: list[str], translated: list[str], notes: list[str]) -> None:
    """The actor's ``<engine>.router_replay.mode``: refppo's ``actor.router_replay`` when it is the
    copy of the actor's strategy (verl 0.9's ``ActorRolloutRefWorker.__init__`` reads that one, for
    Megatron and VeOmni), else unread, with a note to ``notes``.

    Raises:
        ValueError: R3 without the rollout's routes (``rollout.enable_rollout_routing_replay``), or R2
            with them, which verl's trainer refuses; VeOmni's without ``use_remove_padding``, which
            its actor's configuration refuses.
    """
    given = _line_values(line)
    strategy = _actor_strategy(line)
    if strategy not in ROUTER_REPLAY_ENGINES or full != ACTOR_ROUTER_REPLAY[strategy]:
        notes.append(
            f"{key}={text} is not read: verl replays the routing in the copy of the actor's strategy "
            f"({strategy}), if it is megatron or veomni (verl leaves it unread too)"
        )
        return
    mode = _line_router_replay(line)  # the line's last value of this key, as Hydra takes it
    routes = _plain(given.get(ROLLOUT_ROUTES, "false")) == "true"
    if mode == "R3" and not routes:
        raise ValueError(
            f"{key}={text}: verl's R3 replays the rollout's routing, which its rollout returns only with "
            f"{ROLLOUT_ROUTES}=true"
        )
    if mode == "R2" and routes:
        raise ValueError(f"{key}={text} with {ROLLOUT_ROUTES}=true: verl's trainer refuses the two together (R3 only)")
    padding = given.get("actor_rollout_ref.actor.use_remove_padding", given.get(REMOVE_PADDING, "true"))
    if strategy == "veomni" and mode != "disabled" and _plain(padding) == "false":
        raise ValueError(
            f"{key}={text} without use_remove_padding: verl's VeOmni actor refuses router replay on padded "
            "sequences (VeOmniActorConfig); give actor_rollout_ref.model.use_remove_padding=true"
        )
    translated.append(f"actor.router_replay={mode}")


def _lora_of_the_engine(key: str, full: str, text: str, line: list[str], translated: list[str], notes: list[str]):
    """verl's two LoRAs on a verl command ``line``: the engines built on Megatron-Core train
    Megatron-Bridge's (``model.lora.*``) and leave PEFT's settings unread, the others train PEFT's
    (``model.lora_rank``) and leave Megatron's unread (:data:`MEGATRON_ENGINES`); the setting the
    actor's strategy reads goes to ``translated``, a note for one it leaves unread to ``notes``.

    Raises:
        ValueError: ``model.lora.rank > 0`` under another engine, whose rollout server would then
            expect an adapter its actor does not train.
    """
    strategy = _actor_strategy(line)
    megatron = strategy in MEGATRON_ENGINES
    if full in PEFT_LORA and megatron:
        notes.append(
            f"{key}={text} is not read: verl's {strategy} actor trains Megatron's LoRA, "
            "actor_rollout_ref.model.lora.* (verl leaves it unread too)"
        )
        return
    if full == MEGATRON_LORA_RANK and not megatron and not _same_value(_plain(text), "0"):
        raise ValueError(
            f"{key}={text} with the actor's strategy {strategy}: verl trains Megatron's LoRA (model.lora.*) only "
            f"in its engines built on Megatron-Core ({', '.join(MEGATRON_ENGINES)}); its {strategy} actor trains "
            "PEFT's, actor_rollout_ref.model.lora_rank"
        )
    translated.append(f"{refppo_key(key)}={text}")


def _lora_parallel_size(key: str, full: str, text: str, line: list[str], translated: list[str], notes: list[str]):
    """A Megatron parallel size of the actor's engine (:data:`LORA_PARALLEL_SIZES`): refppo's
    ``model.lora.<size>`` when the verl command ``line`` trains Megatron's LoRA in that engine, as
    Megatron-Bridge 0.5 builds the adapters under it (``ParallelLinearAdapter``); else a setting of
    verl's engine, noted. The translation goes to ``translated``, the note to ``notes``."""
    strategy = _actor_strategy(line)
    rank = _plain(_line_values(line).get(MEGATRON_LORA_RANK, "0"))
    if _same_value(rank, "0") or full != f"actor_rollout_ref.actor.{strategy}.{LORA_PARALLEL_SIZES[full]}":
        notes.append(_engine_note(key, text))
        return
    name = f"model.lora.{LORA_PARALLEL_SIZES[full]}"
    translated.append(f"{name}={text}")
    notes.append(f"{key}={text}: {name}={_plain(text)}, as Megatron-Bridge builds the LoRA adapters under it")


def _rollout_routes(key: str, text: str, line: list[str], translated: list[str], notes: list[str]) -> None:
    """verl's ``rollout.enable_rollout_routing_replay``: its rollout returns each token's routing,
    which R3 replays (:func:`_router_replay` checks the two agree); a note to ``notes``."""
    if _plain(text) == "true" and _line_router_replay(line) != "R3":
        notes.append(f"{key}={text} has no effect: no R3 router replay on the line reads the rollout's routing")
    else:
        notes.append(f"{key}={text}: the rollout's routing is recorded exactly when actor.router_replay=R3")


def _calculate_log_probs(key: str, text: str, translated: list[str], notes: list[str]) -> None:
    """verl's ``rollout.calculate_log_probs``: whether its rollout engine returns the sampler's
    log-probs, which refppo always records. Without them verl's trainer skips the rollout
    correction (``compute_rollout_correction_and_add_to_batch`` runs only with
    ``rollout_log_probs`` in the batch) and its bypass mode stops (``apply_bypass_mode``), so false
    is refused beside a correction that ``translated`` turns on; otherwise it is noted to ``notes``."""
    given = _line_values(translated)
    prefix = "algorithm.rollout_correction."
    correcting = [
        f"{prefix}{k}={_plain(given[prefix + k])}"
        for k, off in (("rollout_is", "null"), ("rollout_rs", "null"), ("bypass_mode", "false"))
        if _plain(given.get(prefix + k, off)) != off
    ]
    if _plain(text) == "false" and correcting:
        raise ValueError(
            f"{key}={text} with {correcting[0]}: verl corrects for the sampler only with its log-probs, which this "
            "turns off (its trainer then skips a decoupled correction and stops in bypass mode); refppo always records "
            "them: give it true"
        )
    notes.append(_engine_note(key, text))


def _model_engine(key: str, text: str, line: list[str], translated: list[str], notes: list[str]) -> None:
    """verl's ``model_engine``, which picks the actor's, reference's and critic's configuration groups
    (``defaults`` in ``verl/trainer/config/ppo_trainer.yaml``): the engine's defaults where they
    differ from FSDP's (:data:`MODEL_ENGINES`) are added to ``translated`` where the verl command
    ``line`` leaves them, its critic takes the actor's ``data_loader_seed`` unless given
    (:data:`CRITIC_SEED_FROM_ACTOR`), Megatron's optimizers spare 1-D parameters the weight decay
    (:data:`MEGATRON_ENGINES`), and VeOmni's unread warm-up length is dropped; a note for each
    goes to ``notes``.

    Raises:
        ValueError: TorchTitan's engine (:data:`TORCHTITAN`), or an engine verl 0.9 lacks.
    """
    engine = _plain(text)
    if engine == "torchtitan":
        raise ValueError(f"{key}={text}: refppo does not implement {TORCHTITAN}")
    if engine not in MODEL_ENGINES:
        raise ValueError(f"{key}={text}: verl 0.9's engines are {', '.join(MODEL_ENGINES)} and torchtitan")
    notes.append(f"{key}={text} picks verl's {engine} engine, whose settings have no effect in refppo")
    given = _line_values(line)
    has_critic = needs_critic(_estimator(translated))
    for verl, default in MODEL_ENGINES[engine].items():
        name = refppo_key(verl)
        if verl not in given and (has_critic or not name.startswith("critic.")):
            translated.append(f"{name}={default}")
            notes.append(f"{key}={text}: {name}={default}, the default of verl's {engine} configuration")
    seed = given.get("actor_rollout_ref.actor.data_loader_seed")
    if engine in CRITIC_SEED_FROM_ACTOR and seed is not None and "critic.data_loader_seed" not in given:
        translated.append(f"critic.data_loader_seed={seed}")
        notes.append(f"{key}={text}: critic.data_loader_seed={seed}, the actor's, as verl's {engine} critic takes it")
    if engine in MEGATRON_ENGINES:
        for role in ("actor", "critic") if has_critic else ("actor",):
            translated.append(f"{role}.optim.decay_1d_params=false")
            notes.append(
                f"{key}={text}: {role}.optim.decay_1d_params=false, as verl's {engine} optimizer takes no weight "
                "decay on biases and norms' weights (Megatron-Core's parameter groups)"
            )
    _router_losses(key, text, engine, given, translated, notes)
    if engine == "veomni":
        for item in [item for item in translated if full_path(item.partition("=")[0].strip()) in VEOMNI_UNREAD]:
            translated.remove(item)
            notes.append(
                f"{item} is not read: verl's VeOmni engine warms up for optim.lr_warmup_steps_ratio of the run "
                "(verl leaves it unread too)"
            )


def _router_losses(
    key: str, text: str, engine: str, given: dict[str, str], translated: list[str], notes: list[str]
) -> None:
    """Megatron's router losses under a Megatron engine (:data:`TRANSFORMER_SETTINGS`): on
    Megatron-Bridge's path verl turns the load-balancing loss off unless the line's
    ``moe_router_load_balancing_type`` turns it on; the deprecated mbridge (``vanilla_mbridge=true``,
    MindSpeed's only path) keeps the model's, at the line's coefficient or else the model's own
    (null); the z-loss runs wherever the line gives it a coefficient. Those a line turns on go to
    ``translated`` as ``actor.moe_aux_loss_coeff`` and ``actor.moe_z_loss_coeff``, which a
    mixture-of-experts actor refuses, each with a note to ``notes``."""
    if engine not in TRANSFORMER_SETTINGS:
        return
    section = TRANSFORMER_SETTINGS[engine]
    mbridge = _plain(given.get(f"actor_rollout_ref.actor.{engine}.vanilla_mbridge", "false")) == "true"
    vanilla = engine == "mindspeed" or mbridge
    # _plain reads Megatron's "none" as Hydra's null, which is off too
    balancing = _plain(given.get(f"{section}moe_router_load_balancing_type", "aux_loss" if vanilla else "none"))
    aux = _plain(given.get(f"{section}moe_aux_loss_coeff", "null"))
    z_loss = _plain(given.get(f"{section}moe_z_loss_coeff", "null"))
    turned_on = {}  # refppo's setting -> (its value, the loss)
    if balancing != "null" and not _same_value(aux, "0"):
        turned_on["actor.moe_aux_loss_coeff"] = (
            aux,
            f"load-balancing loss ({balancing}; null: the model's coefficient)",
        )
    if z_loss != "null" and not _same_value(z_loss, "0"):
        turned_on["actor.moe_z_loss_coeff"] = (z_loss, "z-loss")
    for name, (value, loss) in turned_on.items():
        translated.append(f"{name}={value}")
        notes.append(
            f"{key}={text}: verl's {engine} engine adds Megatron's router {loss} on a mixture-of-experts model: "
            f"{name}={value}, which refppo refuses for a model with routers"
        )


def unread_reason(full: str) -> str | None:
    """Why verl leaves the setting ``full`` unread (:data:`UNREAD_BY_VERL`), or None."""
    for k, why in UNREAD_BY_VERL.items():
        if _in_family(full, k):
            return why
    return None


def _engine_note(key: str, text: str, what: str | None = None) -> str:
    """The note for a setting of verl's engine (``what`` names it where the key alone does not)."""
    named = "" if what is None else f" ({what})"
    return f"{key}={text} is a setting of verl's engine{named}: it has no effect in refppo"


def _not_implemented(key: str, full: str, sep: str, text: str) -> str | None:
    """For a key of :data:`NOT_IMPLEMENTED`: a ValueError naming what refppo lacks, unless the value
    turns the feature off (then the note that says so); None for any other key."""
    missing = [what for k, what in NOT_IMPLEMENTED.items() if full not in ENGINE and _in_family(full, k)]
    if not missing:
        return None
    if not (sep and _plain(text) in OFF):
        raise ValueError(f"{key}{sep}{text}: refppo does not implement {missing[0]}")
    return f"{key}={text} is refppo's behaviour already (it does not implement {missing[0]})"


def _refppo_setting(key: str, sep: str, text: str, notes: list[str]) -> str:
    """A setting refppo takes, as ``key=value`` in refppo's names (verl's names of the key and of
    the value translated); a device verl would leave for the one it detects is refppo's auto, and a
    ``data.truncation`` verl never applies (:data:`CUT_FROM_THE_LEFT`) is the left cut verl makes,
    each with a note to ``notes``.

    Raises:
        ValueError: a name in verl's registries that refppo does not implement.
    """
    name = refppo_key(key)
    if sep and name == "trainer.device" and _plain(text) in DETECTED_DEVICES:
        notes.append(
            f"{key}={text}: verl runs on the accelerator it detects (auto_set_device), and so does refppo "
            "(trainer.device=auto: CUDA when there is one, else the CPU)"
        )
        return "trainer.device=auto"
    if sep and name == "data.truncation" and _plain(text) in CUT_FROM_THE_LEFT:
        notes.append(
            f"{key}={text}: verl 0.9's rollout cuts a prompt longer than rollout.prompt_length from the left "
            "whatever data.truncation says (AgentLoopBase.apply_chat_template), and so does refppo "
            "(data.truncation=left)"
        )
        return "data.truncation=left"
    if sep and (name, _plain(text)) in MISSING_CHOICES:
        raise ValueError(f"{key}={text}: refppo does not implement {MISSING_CHOICES[name, _plain(text)]}")
    value = VALUES.get((name, _plain(text)), text) if sep else text
    return f"{name}{sep}{value}"


def translate(overrides: list[str]) -> tuple[list[str], list[str]]:
    """Overrides in refppo's spelling, and a note for each verl setting that has no effect here.

    Args:
        overrides: ``key=value`` texts in either spelling.

    Returns:
        (the overrides with refppo's keys and values, minus those of verl's engine, plus
        ``data.task=file`` for files named without a task; the notes).

    Raises:
        ValueError: a renamed refppo setting (naming the new one), or a verl setting refppo does
            not implement given a value other than the one that turns it off.
    """
    out = []
    notes = []
    lengths = {}
    line_checks = []
    dicts: dict[str, dict] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip().lstrip("+")  # Hydra's "+key=value" adds a key verl's config lacks
        full = full_path(key)
        if _dict_entry(full, sep, text, dicts):
            continue
        if key in RENAMED:
            raise ValueError(f"{key} is now {RENAMED[key]} (verl 0.9's names)")
        if sep and (full, _plain(text)) in ENGINE_GROUPS:
            notes.append(_engine_note(key, text, ENGINE_GROUPS[full, _plain(text)]))
            continue
        off_note = _not_implemented(key, full, sep, text)
        if off_note is not None:
            notes.append(off_note)
            continue
        check = _line_check(key, full, sep, text, overrides)
        if check is not None:
            line_checks.append(check)
            continue
        if sep and full in OWN_NOTES:
            notes.append(f"{key}={text}: {OWN_NOTES[full]}")
            continue
        unread = unread_reason(full) if sep else None
        if unread is not None:
            notes.append(f"{key}={text} is not read: {unread} (verl leaves it unread too)")
            continue
        if sep and full in ROLLOUT_LENGTHS:
            lengths[ROLLOUT_LENGTHS[full]] = (key, text.strip())
            continue
        if sep and full in MISSING:  # before the engine's prefixes, which may hold one
            off, what = MISSING[full]
            if not _same_value(_plain(text), off):
                raise ValueError(f"{key}={text}: refppo does not implement {what} (only {key}={off})")
            notes.append(f"{key}={text} is refppo's behaviour already (it does not implement {what})")
            continue
        if sep and _is_engine(full):
            notes.append(_engine_note(key, text))
            continue
        if sep and full in KEY_VALUES:
            choices = KEY_VALUES[full]
            if _plain(text) not in choices:
                raise ValueError(f"{key}={text}: refppo takes {' or '.join(choices)} (the run in trainer.output_dir)")
            out.append(choices[_plain(text)])
            continue
        out.append(_refppo_setting(key, sep, text, notes))
    out += _rollout_lengths(lengths, out, notes)
    out += [f"{name}={json.dumps(entries)}" for name, entries in dicts.items()]
    for check in line_checks:
        check(out, notes)
    out = _sequence_parallel_budgets(out, overrides, notes)
    keys = _line_values(out)
    if "data.train_files" in keys and "data.task" not in keys:  # verl's command lines name only their files
        out.append("data.task=file")
    return out, notes


def _hydra_scalar(text: str):
    """A value as Hydra reads it: true/false, null, an int, a float, else the text (unquoted)."""
    plain = text.strip()
    if len(plain) >= 2 and plain[0] == plain[-1] and plain[0] in "'\"":
        return plain[1:-1]
    if plain.lower() in ("true", "false"):
        return plain.lower() == "true"
    if plain.lower() in ("null", "none"):
        return None
    for kind in (int, float):
        try:
            return kind(plain)
        except ValueError:
            pass
    return plain


def _dict_entry(full: str, sep: str, text: str, dicts: dict[str, dict]) -> bool:
    """Whether ``full=text`` sets a :data:`DICTS` setting or one of its keys; its entries then go
    to ``dicts`` (refppo's key -> the entries given so far). A whole dict is ``{}`` or JSON (as
    :func:`translate` writes it); its keys are given one by one, as verl's example lines do."""
    name = next((k for k in DICTS if full == k or full.startswith(k + ".")), None)
    if name is None or not sep:
        return False
    entries = dicts.setdefault(DICTS[name], {})
    keyword = full[len(name) + 1 :]
    whole = None
    if full == name:
        with contextlib.suppress(ValueError):
            whole = json.loads(text)
    if isinstance(whole, dict):
        entries.clear()
        for keyword, value in whole.items():
            _check_keyword(name, keyword, text)
            entries[keyword] = value
        return True
    if full == name:
        raise ValueError(
            f"{full}={text}: give each keyword as {name}.<name>=<value> (e.g. +{name}.enable_thinking=false)"
        )
    _check_keyword(name, keyword, text)
    entries[keyword] = _hydra_scalar(text)
    return True


def _check_keyword(name: str, keyword: str, text: str) -> None:
    """Refuse a keyword of the dict setting ``name`` that is no variable name, or that is one of
    apply_chat_template's own arguments (:data:`APPLY_CHAT_TEMPLATE_OWN`)."""
    if not keyword.isidentifier():
        raise ValueError(f"{name}.{keyword}={text}: {keyword!r} is not a keyword argument's name")
    if keyword in APPLY_CHAT_TEMPLATE_OWN:
        raise ValueError(
            f"{name}.{keyword}={text}: {keyword} is apply_chat_template's own argument, which refppo sets (prompts "
            "are rendered as text with the assistant's turn opened); give only the chat template's variables"
        )


def _rollout_lengths(lengths: dict[str, tuple[str, str]], out: list[str], notes: list[str]) -> list[str]:
    """The data lengths that verl's ``rollout.prompt_length`` / ``response_length`` give (their
    refppo setting -> (verl's key, value)), checked against the same lengths in ``out``; a note for
    each goes to ``notes``."""
    given = _line_values(out)
    added = []
    for data_key, (key, text) in lengths.items():
        if data_key in given and _plain(given[data_key]) != _plain(text):
            raise ValueError(
                f"{key}={text} and {data_key}={given[data_key]}: refppo generates and filters with one length, "
                f"{data_key}; give the two the same value or drop {key}"
            )
        if data_key not in given:
            added.append(f"{data_key}={text}")
        notes.append(f"{key}={text} is refppo's {data_key}")
    return added


def check_context_length(line: list[str], prompt_length: int, response_length: int) -> None:
    """verl's rollout servers cap a response at the context left after its prompt (verl 0.9's
    ``vLLMHttpServer.generate``: ``max_model_len`` minus the prompt's tokens; SGLang's server one
    token fewer), so a ``rollout.max_model_len`` below the longest prompt plus the longest response
    cuts long prompts' responses short, which refppo does not do.

    Args:
        line: the verl command line's ``key=value`` items.
        prompt_length, response_length: the run's ``data.max_prompt_length`` and ``max_response_length``.

    Raises:
        ValueError: naming ``max_model_len`` and the context it needs.
    """
    given = _line_values(line)
    text = given.get("actor_rollout_ref.rollout.max_model_len")
    if text is None or _plain(text) == "null":
        return
    sglang = _plain(given.get("actor_rollout_ref.rollout.name", "vllm")) == "sglang"
    needed = prompt_length + response_length + (1 if sglang else 0)
    if int(_plain(text)) < needed:
        server = "SGLang's server leaves one token more" if sglang else "vLLM's server"
        raise ValueError(
            f"actor_rollout_ref.rollout.max_model_len={text}: refppo does not implement a context shorter than "
            f"{needed} tokens (data.max_prompt_length + data.max_response_length"
            f"{' + 1' if sglang else ''}), where verl's {server} cuts a long prompt's response to the context "
            "left after it"
        )


def is_verl_line(overrides: list[str]) -> bool:
    """Whether a command line spells some setting as only verl does (a full path such as
    ``actor_rollout_ref.actor.optim.lr``, ``trainer.default_local_dir``, a setting of verl's engine
    or one refppo lacks): a verl command line."""
    keys = [item.partition("=")[0].strip().lstrip("+") for item in overrides]
    verl_only = {*NAMES, *KEY_VALUES, *MISSING, *OWN_NOTES, "model_engine"}
    return any(key.startswith(FULL) or key in verl_only or _is_engine(full_path(key)) for key in keys)


def verl_key(key: str) -> str:
    """verl 0.9's full path of a refppo setting (``model.path`` -> ``actor_rollout_ref.model.path``);
    where verl has two places for one setting, the first of :data:`NAMES` (its current one)."""
    for verl, name in NAMES.items():
        if name == key:
            return verl
    return full_path(key)
