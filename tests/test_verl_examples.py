"""verl v0.9.0's own example scripts through ``refppo ppo``.

``tests/data/verl_0_9_0_examples.json`` holds the settings each script under verl's ``examples/``
passes to ``python3 -m verl.trainer.main_ppo``, as bash expands them with the script's defaults
(``tests/data/record_verl_examples.py`` recorded them; each line's source is its script's path).
Each line is read as refppo reads a verl command line, with the data files left out (refppo's
defaults stand in; the run below gives it verl-format files): it is accepted, or refused for a
missing feature named in the refusal, or refused for a key refppo does not know yet, which must be
one of ``NOT_YET_KNOWN`` (issue 64's open work: that list only shrinks). Every accepted line then
runs a step with the model, the data files and the sizes changed for a CPU.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from test_verl_names import _gsm8k_files, chat_model  # noqa: F401  (a fixture)

from refppo.runs.cli import main
from refppo.settings.overrides import command_settings

EXAMPLES = json.loads((Path(__file__).parent / "data" / "verl_0_9_0_examples.json").read_text())["lines"]
DATA_FILES = ("data.train_files=", "data.val_files=")

# verl keys refppo refuses as unknown today, each with the scripts' reason for it. Each must still
# be what refuses some line (test_the_not_yet_known_keys_are_current), so the list tracks the work.
NOT_YET_KNOWN = {
    "--config-path": "Hydra's config file options",
    "hydra.searchpath": "Hydra's config search path",
    "data.image_key": "images (vision-language models)",
    "data.trust_remote_code": "a tokenizer's own code",
    "model.trust_remote_code": "a model's own code",
    "data.apply_chat_template_kwargs.enable_thinking": "chat template keywords",
    "data.apply_chat_template_kwargs.reasoning_effort": "chat template keywords",
    "actor.megatron.tensor_model_parallel_size": "Megatron's engine settings",
    "actor.megatron.pipeline_model_parallel_size": "Megatron's engine settings",
    "actor.model_engine": "the engine's name",
    "actor.veomni.param_offload": "VeOmni's engine settings",
    "actor.optim.override_optimizer_config.optimizer_offload_fraction": "Megatron's optimizer offload",
    "actor.policy_loss.tau_pos": "verl's nested policy-loss settings",
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": "the DAPO reward manager's keyword form",
    "reward.reward_model.rollout.name": "a reward model's rollout server",
    "rollout.dtype": "the rollout engine's precision",
    "model.lora.rank": "verl's nested LoRA settings",
    "model.lora.merge": "verl's nested LoRA settings",
    "model.lora_adapter_path": "starting from a saved LoRA adapter",
}


def _read(settings: list[str]) -> str:
    """'accepted', or the first line of refppo's refusal of the verl line ``settings``."""
    try:
        command_settings("ppo", [s for s in settings if not s.startswith(DATA_FILES)])
    except ValueError as error:
        return str(error).splitlines()[0]
    return "accepted"


OUTCOMES = {line["script"]: _read(line["settings"]) for line in EXAMPLES}
UNKNOWN = re.compile(r"^unknown config key '([^']+)'")


def _unknown_key(outcome: str) -> str | None:
    match = UNKNOWN.match(outcome)
    return match.group(1) if match else None


@pytest.mark.parametrize("script", sorted(OUTCOMES))
def test_each_example_line_is_accepted_or_refused_by_name(script):
    outcome = OUTCOMES[script]
    key = _unknown_key(outcome)
    if key is not None:
        assert key in NOT_YET_KNOWN, f"{script}: {outcome}"
    else:
        assert outcome == "accepted" or "refppo does not" in outcome or "verl" in outcome, f"{script}: {outcome}"


def test_the_not_yet_known_keys_are_current():
    refusing = {_unknown_key(outcome) for outcome in OUTCOMES.values()}
    assert set(NOT_YET_KNOWN) <= refusing, f"known now, drop from NOT_YET_KNOWN: {set(NOT_YET_KNOWN) - refusing}"


def test_the_recorded_lines_are_verls_examples():
    """A check on the record: 90 scripts, each a path under examples/ with its settings."""
    assert len(EXAMPLES) == 90
    assert all(line["script"].startswith("examples/") and line["settings"] for line in EXAMPLES)
    accepted = Counter(outcome == "accepted" for outcome in OUTCOMES.values())
    assert accepted[True] >= 17, accepted  # the count on introducing this test: it may only grow


# Sizes a CPU runs in seconds; every other setting as the script passes it.
SMALL = {
    "data.train_batch_size": "8",
    "data.max_prompt_length": "64",
    "data.max_response_length": "4",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "4",
    "critic.ppo_mini_batch_size": "4",
    "actor_rollout_ref.model.lora_rank": "8",  # at most the tiny model's width
    "trainer.logger": "console",
}
SMALL_SUFFIXES = {
    "micro_batch_size_per_gpu": "2",
    "max_token_len_per_gpu": "512",
}
ENGINE_LENGTHS = ("actor_rollout_ref.rollout.prompt_length", "actor_rollout_ref.rollout.response_length")
DROPPED = ("trainer.total_epochs", "trainer.total_training_steps", "trainer.default_local_dir", *ENGINE_LENGTHS)


def _for_a_cpu(settings: list[str], model: Path, data: Path, out: Path) -> list[str]:
    """``settings`` with the model paths, the data files, the sizes and the steps changed."""
    changed = []
    for item in settings:
        key, _, value = item.partition("=")
        if key.endswith("model.path"):
            value = str(model)
        elif key == "data.train_files":
            value = str(data / "train.parquet")
        elif key == "data.val_files":
            value = str(data / "test.parquet")
        elif key == "actor_rollout_ref.rollout.n":
            value = str(min(int(value), 4))
        elif key in SMALL:
            value = SMALL[key]
        elif key.endswith(tuple(SMALL_SUFFIXES)):
            value = next(v for suffix, v in SMALL_SUFFIXES.items() if key.endswith(suffix))
        elif key in DROPPED:
            continue
        changed.append(f"{key}={value}")
    return [
        *changed,
        "trainer.total_training_steps=1",
        f"trainer.default_local_dir={out}",
        "trainer.progress_bar=false",
    ]


@pytest.mark.parametrize("script", sorted(s for s, outcome in OUTCOMES.items() if outcome == "accepted"))
def test_each_accepted_example_line_runs_a_step(script, chat_model, tmp_path):  # noqa: F811
    _gsm8k_files(tmp_path, ("train", "test"), 16)
    settings = next(line["settings"] for line in EXAMPLES if line["script"] == script)
    out = tmp_path / "run"
    assert main(["ppo", *_for_a_cpu(settings, chat_model, tmp_path, out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and "actor/pg_loss" in rows[-1], rows[-1].keys()
