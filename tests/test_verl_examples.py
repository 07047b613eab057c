"""verl v0.9.0's own example scripts through ``refppo ppo``.

``tests/data/verl_0_9_0_examples.json`` holds the settings each script under verl's ``examples/``
passes to ``python3 -m verl.trainer.main_ppo``, as bash expands them with the script's defaults
(``tests/data/record_verl_examples.py`` recorded them; each line's source is its script's path).
Each line is read as refppo reads a verl command line, with the data files left out (refppo's
defaults stand in; the run below gives it verl-format files): it is accepted, or refused for a
missing feature named in the refusal. Every key any line sets is known to refppo (taken, noted as
verl's engine's, or refused by name), and every accepted line runs a step with the model, the
data files and the sizes changed for a CPU.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_verl_names import _gsm8k_files, chat_model  # noqa: F401  (a fixture)

from refppo.rollout import deepseek_v4 as deepseek_v4_tokens
from refppo.rollout.models import add_lora, load_causal_lm
from refppo.runs.cli import main
from refppo.settings.overrides import command_settings
from refppo.settings.validate import read_settings
from refppo.settings.verl_map import effective_value, verl_command, verl_yaml

EXAMPLES = json.loads((Path(__file__).parent / "data" / "verl_0_9_0_examples.json").read_text())["lines"]
DATA_FILES = ("data.train_files=", "data.val_files=")


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
    assert _unknown_key(outcome) is None, f"{script}: {outcome}"
    assert outcome == "accepted" or "refppo does not" in outcome or "verl" in outcome, f"{script}: {outcome}"


def test_every_key_of_the_example_lines_is_known():
    """Each key the lines set, read alone: a line is refused at its first missing feature, which
    would hide an unknown key after it."""
    unknown = set()
    for line in EXAMPLES:
        for item in line["settings"]:
            if not item.startswith(DATA_FILES) and _unknown_key(_read([item])) is not None:
                unknown.add(item.partition("=")[0])
    assert not unknown, sorted(unknown)


def test_the_recorded_lines_are_verls_examples():
    """A check on the record: 90 scripts, each a path under examples/ with its settings."""
    assert len(EXAMPLES) == 90
    assert all(line["script"].startswith("examples/") and line["settings"] for line in EXAMPLES)
    accepted = Counter(outcome == "accepted" for outcome in OUTCOMES.values())
    # the count when this test was last changed: it may only grow, unless a line was wrongly accepted
    # (VeOmni's router replay, refused since its engine's own router_replay.mode is read)
    assert accepted[True] >= 67, accepted


# Sizes a CPU runs in seconds; every other setting as the script passes it.
SMALL = {
    "data.train_batch_size": "8",
    "data.max_prompt_length": "64",
    "data.max_response_length": "4",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "4",
    "critic.ppo_mini_batch_size": "4",
    "actor_rollout_ref.model.lora_rank": "8",  # at most the tiny model's width
    "actor_rollout_ref.model.lora.rank": "8",
    "trainer.logger": "console",
}
SMALL_SUFFIXES = {
    "micro_batch_size_per_gpu": "2",
    "max_token_len_per_gpu": "512",
}
ENGINE_LENGTHS = ("actor_rollout_ref.rollout.prompt_length", "actor_rollout_ref.rollout.response_length")
DROPPED = ("trainer.total_epochs", "trainer.total_training_steps", "trainer.default_local_dir", *ENGINE_LENGTHS)


@pytest.fixture(scope="module")
def reward_model(chat_model, tmp_path_factory):  # noqa: F811
    """A reward model trained for three steps from the chat model, for the lines that score with one."""
    out = tmp_path_factory.mktemp("verl_rm") / "rm"
    argv = ["rm", "data.task=preference", f"model.path={chat_model}", "rm.steps=3", "rm.batch_size=8"]
    assert main([*argv, "rm.n_pairs=24", f"trainer.output_dir={out}", "trainer.progress_bar=false"]) == 0
    return out / "model"


@pytest.fixture(scope="module")
def stand_ins(chat_model, tmp_path_factory):  # noqa: F811
    """``stand_in(settings)``: the tiny model standing in for a line's policy, the chat model but
    for what the line needs of its model: DeepSeek-V4's special tokens in the tokenizer (and rows
    for them in the embeddings) where it renders prompts with DeepSeek-V4's encoding, and a
    mixture-of-experts model of the same vocabulary (Qwen3-MoE, 4 experts, 2 per token) where it
    replays the actor's routing or trains Megatron's LoRA (whose line's model, Qwen3-30B-A3B, is one)."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    made = {}

    def stand_in(settings: list[str]) -> Path:
        deepseek_v4 = "data.continuous_token.model_family=deepseekv4" in settings
        moe = any(".router_replay.mode=R" in item or "model.lora.rank=" in item for item in settings)
        if not (deepseek_v4 or moe):
            return chat_model
        if (deepseek_v4, moe) in made:
            return made[deepseek_v4, moe]
        folder = tmp_path_factory.mktemp("stand_in") / "model"
        tokenizer = AutoTokenizer.from_pretrained(chat_model)
        if deepseek_v4:
            specials = [
                deepseek_v4_tokens.BOS,
                deepseek_v4_tokens.EOS,
                deepseek_v4_tokens.USER,
                deepseek_v4_tokens.ASSISTANT,
            ]
            tokenizer.add_special_tokens({"additional_special_tokens": specials})
        if moe:
            torch.manual_seed(0)
            config = Qwen3MoeConfig(
                vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
                num_experts_per_tok=2, max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
            model = Qwen3MoeForCausalLM(config)
        else:
            model = load_causal_lm(chat_model)
            model.resize_token_embeddings(len(tokenizer))
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        made[deepseek_v4, moe] = folder
        return folder

    return stand_in


def _for_a_cpu(settings: list[str], models: tuple[Path, Path], data: Path, out: Path) -> list[str]:
    """``settings`` with the model paths (the policy's and critic's, the reward model's), the data
    files, the sizes and the steps changed."""
    policy, scorer = models
    changed = []
    for item in settings:
        key, _, value = item.partition("=")
        if "reward_model" in key and key.endswith(("model.path", "model_path")):
            value = str(scorer)
        elif key.endswith("model.path"):
            value = str(policy)
        elif key == "data.train_files":
            value = str(data / "train.parquet")
        elif key == "data.val_files":
            value = str(data / "test.parquet")
        elif key.endswith("custom_reward_function.path"):
            value = str(data / "reward.py")
        elif key.endswith("lora_adapter_path"):
            value = str(data / "adapter")
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


# A stand-in for the reward files verl's lines name (verl/utils/reward_score/rlla.py for GDPO): a
# dict result with the components GDPO's line normalises, as rlla's compute_score returns them.
STAND_IN_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info):
    accuracy = 3.0 if str(ground_truth) in solution_str else -3.0
    form = float(len(solution_str) % 2)
    return {"score": accuracy + form, "format_reward": form, "accuracy_reward": accuracy}
"""


@pytest.mark.parametrize("script", sorted(s for s, outcome in OUTCOMES.items() if outcome == "accepted"))
def test_each_accepted_example_line_runs_a_step(script, chat_model, reward_model, stand_ins, tmp_path):  # noqa: F811
    _gsm8k_files(tmp_path, ("train", "test"), 16)
    (tmp_path / "reward.py").write_text(STAND_IN_REWARD)
    settings = next(line["settings"] for line in EXAMPLES if line["script"] == script)
    if any("lora_adapter_path" in item for item in settings):  # a saved adapter of the tiny model
        add_lora(load_causal_lm(chat_model), r=4).save_pretrained(tmp_path / "adapter")
    out = tmp_path / "run"
    policy = stand_ins(settings)
    assert main(["ppo", *_for_a_cpu(settings, (policy, reward_model), tmp_path, out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and "actor/pg_loss" in rows[-1], rows[-1].keys()


def _printed_settings(config) -> list[str]:
    """The settings of ``refppo ppo --print-verl``'s command line (its comments left out)."""
    line = verl_command(config).split("\n# refppo settings")[0]
    return [item.strip().rstrip("\\").strip() for item in line.splitlines()[1:] if item.strip()]


@pytest.mark.parametrize("script", sorted(s for s, outcome in OUTCOMES.items() if outcome == "accepted"))
def test_print_verl_round_trips_each_accepted_line(script):
    """The line ``--print-verl`` prints for an example's settings reads back as the same run: every
    setting the run reads has the same value (a null that stands for another setting is printed as
    that setting's value, as verl needs it, so the two are compared as refppo runs them)."""
    settings = next(line["settings"] for line in EXAMPLES if line["script"] == script)
    config, _ = command_settings("ppo", [s for s in settings if not s.startswith(DATA_FILES)])
    again, _ = command_settings("ppo", _printed_settings(config))
    for key in read_settings("ppo", config):
        assert effective_value(again, key) == effective_value(config, key), key
    assert set(read_settings("ppo", again)) == set(read_settings("ppo", config))


@pytest.mark.parametrize("script", sorted(s for s, outcome in OUTCOMES.items() if outcome == "accepted"))
def test_print_verl_yaml_round_trips_each_accepted_line(script, tmp_path):
    """``--print-verl-yaml`` writes the run as a YAML verl's main_ppo loads (``ppo_trainer`` through
    Hydra's search path, then the settings); read back with ``--config-path`` it is the same run."""
    settings = next(line["settings"] for line in EXAMPLES if line["script"] == script)
    config, _ = command_settings("ppo", [s for s in settings if not s.startswith(DATA_FILES)])
    (tmp_path / "run.yaml").write_text(verl_yaml(config))
    again, notes = command_settings("ppo", [f"--config-path={tmp_path}", "--config-name=run"])
    for key in read_settings("ppo", config):
        assert effective_value(again, key) == effective_value(config, key), key
    assert any(note.startswith("the settings of") for note in notes)
