"""A setting is declared once: a field added from outside the package, with its range, the
condition under which it is read and whether a resume may change it, is parsed, validated,
refused when another setting turns it off, listed by --help and judged by the resume check,
with no other change."""

from dataclasses import dataclass

import pytest

from refppo.runs.cli import settings_help
from refppo.settings.config import ActorConfig, Config, apply_overrides
from refppo.settings.declare import setting
from refppo.settings.overrides import check_overrides_are_read
from refppo.settings.validate import ignored_settings, read_settings, resumable_settings, validate


@dataclass
class ActorWithFloor(ActorConfig):
    # read only with an entropy bonus; a resumed run may change the second one
    entropy_floor: float = setting(
        0.5, "[0, 1]", needs=lambda site: None if site.owner.entropy_coeff else "actor.entropy_coeff != 0"
    )
    floor_logging: bool = setting(False, resumable=True)


def extended() -> Config:
    return Config(actor=ActorWithFloor())


def test_a_setting_added_from_outside_is_read_everywhere_from_its_one_declaration():
    config = apply_overrides(extended(), ["actor.entropy_coeff=0.01", "actor.entropy_floor=0.3"])
    assert validate(config).actor.entropy_floor == 0.3
    assert "actor.entropy_floor" in read_settings("ppo", config) and "actor.entropy_floor" not in read_settings(
        "sft", config
    )
    with pytest.raises(ValueError, match=r"did you mean actor.entropy_floor"):
        apply_overrides(extended(), ["actor.entropy_flor=0.3"])
    with pytest.raises(ValueError, match=r"actor.entropy_floor=1.5 is outside its valid range \[0, 1\]"):
        validate(apply_overrides(extended(), ["actor.entropy_coeff=0.01", "actor.entropy_floor=1.5"]))
    # Turned off by another setting: listed as ignored, refused by validate and by the command.
    off = apply_overrides(extended(), ["actor.entropy_floor=0.3"])
    assert ignored_settings(off)["actor.entropy_floor"] == "actor.entropy_coeff != 0"
    with pytest.raises(
        ValueError, match=r"actor.entropy_floor=0.3 is ignored: .* read only with actor.entropy_coeff != 0"
    ):
        validate(off)
    with pytest.raises(ValueError, match=r"refppo ppo: actor.entropy_floor=0.3 is ignored"):
        check_overrides_are_read("ppo", off, ["actor.entropy_floor=0.3"])
    with pytest.raises(
        ValueError, match=r"refppo sft does not read actor.entropy_floor \(it is a setting of refppo ppo\)"
    ):
        check_overrides_are_read("sft", off, ["actor.entropy_floor=0.3"])
    # --help lists it with its range and the condition; the resume check lets only the resumable one change.
    assert "  actor.entropy_floor=0.5" in settings_help("ppo", extended())
    assert "[0, 1]  (read only with actor.entropy_coeff != 0)" in settings_help("ppo", extended())
    free = resumable_settings(config)
    assert "actor.floor_logging" in free and "actor.entropy_floor" not in free
