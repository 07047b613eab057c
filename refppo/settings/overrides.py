"""A command line's settings (``refppo <command> key=value ...``), in refppo's spelling or verl
0.9's (:mod:`refppo.settings.verl_names`): applied, refused where a setting would be ignored, and checked
(:func:`refppo.settings.validate.validate`), before any model or file is touched."""

from __future__ import annotations

from refppo.settings.config import Config, apply_overrides, declarations
from refppo.settings.hydra_line import hydra_settings
from refppo.settings.validate import ignored_message, ignored_settings, read_settings, validate
from refppo.settings.verl_map import verl_line_defaults
from refppo.settings.verl_names import check_context_length, is_verl_line, translate


def check_overrides_are_read(command: str, config: Config, overrides: list[str]) -> None:
    """Refuse an override that ``refppo <command>`` would ignore, naming why: a setting of another
    command, or one that another setting turns off (:func:`refppo.settings.validate.ignored_settings`).

    Args:
        command: "sft", "rm" or "ppo".
        config: the settings after the overrides.
        overrides: the ``key=value`` texts given.
    """
    declared = declarations(config)
    read = read_settings(command, config)
    ignored = ignored_settings(config, command)
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key in ignored:
            raise ValueError(f"refppo {command}: " + ignored_message(item.strip(), key, ignored[key]))
        if key in read:
            continue
        section = key.split(".")[0]
        same_section = [k for k in read if k.startswith(section + ".")]
        if declared[key].unread_because:
            why = declared[key].unread_because
        elif same_section:
            why = f"of {section}.* it reads {', '.join(same_section)}"
        else:
            why = "it is a setting of " + " and ".join(f"refppo {c}" for c in declared[key].commands)
        raise ValueError(f"refppo {command} does not read {key} ({why}): drop it")


def command_settings(command: str, given: list[str]) -> tuple[Config, list[str]]:
    """The settings of ``refppo <command> <given>`` (in refppo's or verl's spelling, in Hydra's
    grammar: :mod:`refppo.settings.hydra_line`), checked, and the notes to print: verl's engine
    settings, and, from a verl command line, the settings verl too would leave unread in its
    configuration, which refppo then drops instead of refusing."""
    given, notes = hydra_settings(given)
    overrides, verl_notes = translate(given)
    notes += verl_notes

    def fresh() -> Config:
        config = Config()
        config.trainer.output_dir = f"runs/{command}"
        return config

    defaults = []
    if is_verl_line(given):
        config = apply_overrides(fresh(), overrides)
        # verl's defaults decide what verl reads (its actor.shuffle=false leaves data_loader_seed unread)
        config = apply_overrides(config, verl_line_defaults(config, overrides, command))
        unread = ignored_settings(config, command)
        for item in [item for item in overrides if item.partition("=")[0].strip() in unread]:
            key = item.partition("=")[0].strip()
            notes.append(f"{item} is not read: {key} is read only with {unread[key]} (verl leaves it unread too)")
            overrides.remove(item)
        defaults = verl_line_defaults(apply_overrides(fresh(), overrides), overrides, command)
        if defaults:
            notes.append(
                f"a verl command line: verl 0.9's defaults where refppo's are for tiny models: {' '.join(defaults)}"
            )
    config = fresh()
    check_overrides_are_read(command, apply_overrides(config, [*defaults, *overrides]), overrides)
    config = validate(config, command)
    if command == "ppo":
        check_context_length(given, config.data.max_prompt_length, config.data.max_response_length)
    val_kwargs = config.rollout.val_kwargs
    if command == "ppo" and val_kwargs.n > 1 and val_kwargs.temperature == 0:
        notes.append(
            f"rollout.val_kwargs.n={val_kwargs.n} at rollout.val_kwargs.temperature=0 decodes greedily, as verl's "
            f"engine does: the {val_kwargs.n} responses to each held-out prompt are the same"
        )
    return config, notes
