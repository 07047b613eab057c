"""Hydra's command line and configuration files, as verl's ``main_ppo`` reads them (ch 5): a verl
user's YAML and launch line run here with the same meaning.

- ``--config-path=DIR --config-name=NAME`` (or ``-cp`` / ``-cn``, or the value as the next
  argument) reads ``DIR/NAME.yaml``; its settings come first and the command line's after them,
  as Hydra composes. Its ``defaults`` list may name verl's own ``ppo_trainer`` (or
  ``ppo_megatron_trainer``, which is ``ppo_trainer`` with ``model_engine=megatron``) and ``_self_``, and its
  ``hydra`` section may put verl's configurations on the search path (as ``refppo ppo
  --print-verl-yaml`` writes it). verl's own configuration, ``--config-path=config`` with one of
  those names, adds nothing but that engine.
- ``key=value`` sets a key; ``++key=value`` sets or adds it; ``+key=value`` adds a key verl's
  configuration lacks, and a key it has is refused, as Hydra refuses it; ``~key`` would remove one
  of verl's keys, which refppo does not implement.

The result is plain ``key=value`` settings for :func:`refppo.settings.verl_names.translate`.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from refppo.settings.config import Config, declarations
from refppo.settings.verl_keys import ADDED, MISSING
from refppo.settings.verl_map import REFPPO_ONLY, VERL_CONFIG_PACKAGE
from refppo.settings.verl_names import full_path, refppo_key, unread_reason

# verl's own configurations (verl/trainer/config) and what each adds to ppo_trainer: its
# ppo_megatron_trainer.yaml is ppo_trainer.yaml with "override model_engine: megatron"
VERL_CONFIGS = {"ppo_trainer": [], "ppo_megatron_trainer": ["model_engine=megatron"]}
VERL_CONFIG_PATHS = ("config", "./config")  # main_ppo's own folder: Hydra reads it beside main_ppo.py
CONFIG_OPTIONS = {"--config-path": "path", "-cp": "path", "--config-name": "name", "-cn": "name"}


def split_config_options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """The config path and name given (``{"path": ..., "name": ...}``), and the other arguments."""
    options = {}
    rest = []
    i = 0
    while i < len(argv):
        flag, sep, value = argv[i].partition("=")
        if flag in CONFIG_OPTIONS:
            if not sep:
                if i + 1 == len(argv):
                    raise ValueError(f"{flag} needs a value: {flag}=...")
                i += 1
                value = argv[i]
            options[CONFIG_OPTIONS[flag]] = value.strip().strip("'\"")
        else:
            rest.append(argv[i])
        i += 1
    return options, rest


def _flat(values: dict, prefix: str = "") -> list[str]:
    """``key=value`` settings from a nested mapping, lists as ``[a,b]`` and None as null."""
    out = []
    for key, value in values.items():
        if isinstance(value, dict):
            out += _flat(value, f"{prefix}{key}.")
        elif isinstance(value, list):
            out.append(f"{prefix}{key}=[{','.join(str(v) for v in value)}]")
        else:
            out.append(f"{prefix}{key}={'null' if value is None else value}")
    return out


def config_file_settings(path: str, name: str) -> tuple[list[str], list[str]]:
    """The settings of the configuration ``path/name.yaml`` (interpolations resolved) and a note.

    Args:
        path: the ``--config-path`` folder.
        name: the ``--config-name``, with or without ``.yaml``.

    Returns:
        (``key=value`` settings, notes).
    """
    stem = name.removesuffix(".yaml")
    if path in VERL_CONFIG_PATHS and stem in VERL_CONFIGS:
        return list(VERL_CONFIGS[stem]), [
            f"--config-name={name} is verl's own configuration: its algorithm defaults are refppo's on a verl line"
        ]
    file = Path(path) / f"{stem}.yaml"
    if not file.is_file():
        raise ValueError(f"--config-path={path} --config-name={name}: no configuration file {file}")
    try:
        config = OmegaConf.load(file)
    except (OmegaConfBaseException, yaml.YAMLError, OSError, ValueError) as error:
        reason = str(error).splitlines()[0]
        raise ValueError(f"{file}: not a configuration file refppo can read ({reason})") from None
    hydra = config.pop("hydra", None)
    if hydra is not None and OmegaConf.to_container(hydra) != {"searchpath": [VERL_CONFIG_PACKAGE]}:
        raise ValueError(
            f"{file}: its hydra section may only add verl's configurations to the search path "
            f"(searchpath: [{VERL_CONFIG_PACKAGE}]); refppo does not implement Hydra's other settings"
        )
    defaults = OmegaConf.to_container(config.pop("defaults", OmegaConf.create([])))
    for entry in defaults:
        if entry not in (*VERL_CONFIGS, "_self_") and not _engine_choice(entry):
            raise ValueError(
                f"{file}: its defaults list names {entry!r}; refppo composes a file with verl's "
                f"{' or '.join(VERL_CONFIGS)}, an override of model_engine and _self_ only (give the settings "
                "themselves)"
            )
    try:
        values = OmegaConf.to_container(config, resolve=True)
    except OmegaConfBaseException as error:
        raise ValueError(f"{file}: {error}".splitlines()[0]) from None
    # a model_engine the file sets comes after its defaults' own, as Hydra composes _self_ last
    engine = []
    for entry in defaults:
        choice = _engine_choice(entry)
        engine += [f"model_engine={choice}"] if choice else VERL_CONFIGS.get(entry, [])
    return [*engine, *_flat(values)], [f"the settings of {file}, then the command line's"]


def _engine_choice(entry) -> str | None:
    """The engine a defaults-list entry ``override model_engine: <engine>`` picks (as verl's
    ppo_megatron_trainer.yaml picks Megatron's), else None."""
    if isinstance(entry, dict) and list(entry) == ["override model_engine"]:
        return str(entry["override model_engine"])
    return None


def _verl_has(key: str) -> bool:
    """Whether verl's configuration has ``key`` (verl's spelling), as far as refppo knows it: a
    refppo setting with a verl counterpart, or a verl setting refppo lacks (:data:`MISSING`).
    Engine settings are not judged: verl's scripts add some with ``+`` (its configuration lacks
    them) and set others plainly, and refppo does not keep verl's whole key list."""
    full = full_path(key)
    if full in ADDED or unread_reason(full) is not None:
        return False
    name = refppo_key(key)
    if name in declarations(Config()) and name not in REFPPO_ONLY:
        return True
    return full in MISSING


def hydra_settings(argv: list[str]) -> tuple[list[str], list[str]]:
    """A command line in Hydra's grammar as plain ``key=value`` settings, and notes.

    Args:
        argv: the arguments after ``refppo <command>``.

    Returns:
        (settings, notes): a configuration file's settings first, then the command line's.

    Raises:
        ValueError: ``+key`` on a key verl's configuration has, ``~key``, a missing or unreadable
            configuration file.
    """
    options, rest = split_config_options(argv)
    settings = []
    notes = []
    if options:
        if set(options) != {"path", "name"}:
            raise ValueError("--config-path and --config-name go together: give both")
        settings, notes = config_file_settings(options["path"], options["name"])
    for item in rest:
        key, sep, value = item.partition("=")
        key = key.strip()
        if key.startswith("~"):
            raise ValueError(
                f"{item}: Hydra's ~ removes {key[1:]} from verl's configuration; refppo does not implement "
                "removing a setting (give the value you want)"
            )
        if key.startswith("++"):
            settings.append(f"{key[2:]}{sep}{value}")
        elif key.startswith("+"):
            if _verl_has(key[1:]):
                raise ValueError(
                    f"{item}: Hydra refuses + on a key verl's configuration has; give {key[1:]}={value} "
                    f"(or ++{key[1:]}={value})"
                )
            settings.append(item)
        else:
            settings.append(item)
    return settings, notes
