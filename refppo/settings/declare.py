"""How a setting is declared: beside its default, in the dataclass field that holds it
(:func:`setting`), so that validation, the refusal of ignored settings, ``--help`` and the resume
check (:mod:`refppo.settings.validate`) all read one declaration; and how settings are read and set by
their dotted keys (``actor.optim.lr``)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import types
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from refppo.settings.verl_names import translate


@dataclass(frozen=True)
class Site:
    """Where a setting sits when its conditions are asked: the whole config, the dataclass that
    holds it, its dotted key and the command reading it."""

    config: typing.Any
    owner: typing.Any
    key: str
    command: str

    @property
    def name(self) -> str:
        """The setting's own name, the key's last part (``clip_ratio`` of ``actor.clip_ratio``)."""
        return self.key.rpartition(".")[2]

    @property
    def section(self) -> str:
        """The key's dotted prefix (``actor.optim.`` of ``actor.optim.lr``)."""
        return self.key.rpartition(".")[0] + "."


# A condition on the other settings: None when the setting is read, else what would make it read,
# as an override says it ("algorithm.use_kl_in_reward=true").
Needs = Callable[[Site], "str | None"]


@dataclass(frozen=True)
class Declaration:
    """What a setting's field declares beside its default (:func:`setting`)."""

    valid: str | tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None
    commands: tuple[str, ...] | None = None
    needs: tuple[Needs, ...] = ()
    resumable: bool = False
    unread_because: str | None = None


def setting(default=None, valid=None, *, commands=None, needs=(), resumable=False, unread_because=None, factory=None):
    """A setting's one declaration, as a dataclass field.

    Args:
        default: its value when not overridden (``factory`` instead for a section's dataclass).
        valid: an interval ("[0, 1)", "-1 or [1, inf)") for a number, the names for a choice (a
            tuple, or a function returning them, for registries); None for anything of its type.
            A null Optional setting is derived from another and not checked.
        commands: the refppo commands that read it; None: those of the section holding it (ppo at
            the top).
        needs: conditions under which they read it (each a :data:`Needs`); a setting another one
            turns off is refused, never ignored.
        resumable: a resumed run may change it (how a run runs, never what it computes).
        unread_because: why the commands that do not read it do not (a refusal says so).
    """
    meta = {
        "setting": Declaration(
            valid, commands, tuple(needs) if isinstance(needs, tuple) else (needs,), resumable, unread_because
        )
    }
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def section(factory, **declaration):
    """A nested section (a dataclass) whose ``commands`` and ``needs`` hold for all its settings."""
    return setting(factory=factory, **declaration)


def when(test: Callable[[Site], bool], text: str | Callable[[Site], str]) -> Needs:
    """A condition from a test on the :class:`Site` and, when it fails, the text (or a function of
    the site giving it) of what would make the setting read."""
    return lambda site: None if test(site) else (text if isinstance(text, str) else text(site))


# ---- reading and writing settings by their dotted keys -------------------------------------
TOP = Declaration(commands=("ppo",))  # what a top-level section inherits


def declarations(config, prefix: str = "", inherited: Declaration = TOP) -> dict[str, Declaration]:
    """Every dotted key of a config dataclass with its declaration, in declaration order; a key
    takes the commands of the nearest section that names them, and the conditions of every section
    above it as well as its own."""
    out = {}
    for f in dataclasses.fields(config):
        own = f.metadata.get("setting", Declaration())
        merged = dataclasses.replace(
            own,
            commands=own.commands or inherited.commands,
            needs=inherited.needs + own.needs,
            unread_because=own.unread_because or inherited.unread_because,
        )
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out |= declarations(value, f"{prefix}{f.name}.", merged)
        else:
            out[prefix + f.name] = merged
    return out


def leaf_keys(config, prefix: str = "") -> list[str]:
    """Every dotted key of a config dataclass, e.g. ``actor.optim.lr``, in declaration order."""
    return list(declarations(config, prefix))


def _parse(text: str, hint, key: str):
    """Convert override text to the field's type (bool, int, float, str, their Optional, tuples; a
    union such as ``float | str`` takes the first type the text reads as). A text in quotes is
    Hydra's quoted string: without them, and a string where the field takes one."""
    args = typing.get_args(hint)
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
        if hint is str or str in args:
            return text
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if text.lower() in ("null", "none") and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options[:-1]:  # float | str: the first type the text reads as
            if "_" in text and option in (int, float):
                continue  # Python reads "2_0.5" as 20.5: an underscore makes it the text
            with contextlib.suppress(ValueError):
                return _parse(text, option, key)
        hint = options[-1]
        args = typing.get_args(hint)
    try:
        if hint is bool:
            if text.lower() not in ("true", "false"):
                raise ValueError
            return text.lower() == "true"
        if typing.get_origin(hint) is tuple:
            parts = [part.strip().strip("'\"") for part in text.strip("()[]").split(",")]
            if args[1:] == (Ellipsis,):  # tuple[str, ...]: any length ("a", "[a, b]", "a,")
                parts = [part for part in parts if part]
                args = (args[0],) * len(parts)
            types_ = args
            return tuple(_parse(part, a, key) for part, a in zip(parts, types_, strict=True))
        if typing.get_origin(hint) is dict:  # keyword arguments, as JSON (refppo.settings.verl_names.DICTS)
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError
            return value
        return hint(text)
    except ValueError:
        raise ValueError(f"{key}={text!r}: expected {getattr(hint, '__name__', hint)}") from None


def apply_overrides(config, overrides: list[str]):
    """Set ``section.key=value`` entries on ``config`` (in place), typed by the dataclass fields,
    in refppo's spelling or verl 0.9's (:func:`refppo.settings.verl_names.translate`); a setting of verl's
    engine is dropped with a warning that says so.

    Args:
        config: the config to change.
        overrides: "dotted.key=value" strings.

    Returns:
        ``config``.
    """
    valid = leaf_keys(config)
    overrides, notes = translate(overrides)
    for note in notes:
        warnings.warn(note, stacklevel=2)
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"override {item!r} must look like key=value")
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"unknown config key {key!r}{hint}")
        owner, name = owner_of(config, key)
        if not text.strip():  # an empty path or name would be taken as "here" or "none" silently
            null = " (or null)" if is_optional(config, key) else ""
            raise ValueError(f"{key}= has no value: give one{null}, or drop {key}")
        setattr(owner, name, _parse(text.strip(), typing.get_type_hints(type(owner))[name], key))
    return config


def check_once(overrides: list[str]) -> None:
    """Refuse a key given twice on the command line, naming both values (in a Python list of
    overrides the later one wins, so that a chapter can vary a shared list)."""
    seen = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if sep and key.strip() in seen:
            raise ValueError(f"{key.strip()} is given twice ({seen[key.strip()]!r} and {text!r}): keep one")
        seen[key.strip()] = text


def owner_of(config, key: str):
    """The dataclass holding a dotted key, and the field's name."""
    *parents, name = key.split(".")
    owner = config
    for p in parents:
        owner = getattr(owner, p)
    return owner, name


def is_optional(config, key: str) -> bool:
    """Whether a setting may be null (derived from another setting)."""
    owner, name = owner_of(config, key)
    return type(None) in typing.get_args(typing.get_type_hints(type(owner))[name])


def get_value(config, key: str):
    """The value of a dotted key, e.g. ``get_value(config, "actor.optim.lr")``."""
    owner, name = owner_of(config, key)
    return getattr(owner, name)


def flatten(values: dict, prefix: str = "") -> dict:
    """Nested dicts as one dict with dotted keys: {"actor": {"ppo_epochs": 1}} -> {"actor.ppo_epochs": 1}."""
    out = {}
    for k, v in values.items():
        out |= flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v}
    return out
