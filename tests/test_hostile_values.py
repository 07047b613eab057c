"""Every numeric setting of `refppo ppo`, `sft` and `rm`, given a value at the edge of what a
float or an int can hold (1e300, 1e39, 1e-300, 10**23), is either refused with a ValueError that
names it, before any write, or gets past every check: never another exception on the way."""

import pytest
from test_cli import TINY

from refppo.runs.cli import main
from refppo.settings.config import Config, declarations

HOSTILE = ("1e300", "1e39", "1e-300", str(10**23))


class Started(Exception):
    """Raised by ``on_start``: every check passed."""


def _start(*_):
    raise Started


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "sft"
    assert main(["sft", f"trainer.output_dir={out}", "sft.steps=1", "sft.batch_size=8", *TINY]) == 0
    return out / "model"


@pytest.mark.parametrize("command", ["ppo", "sft", "rm"])
def test_a_hostile_number_is_refused_by_name_or_passes_every_check(command, sft_model, tmp_path):
    keys = [key for key, d in declarations(Config()).items() if isinstance(d.valid, str)]  # the ranged ones
    assert {"rollout.temperature", "model.lora_rank", "actor.clip_ratio_high", "trainer.seed"} <= set(keys)
    out = tmp_path / "run"
    base = {"ppo": [f"model.path={sft_model}"], "sft": [], "rm": [f"model.path={sft_model}", "data.task=preference"]}
    base = base[command]
    started = 0
    for key in keys:
        for value in HOSTILE:
            try:
                main([command, *base, f"{key}={value}", f"trainer.output_dir={out}"], on_start=_start)
            except Started:
                started += 1
            except ValueError as error:
                assert key in str(error) or key.rsplit(".", 1)[-1] in str(error), (key, value, error)
            assert not out.exists(), (key, value)
    assert 0 < started < len(keys) * len(HOSTILE)
