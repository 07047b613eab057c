"""Model folders checked before loading (refppo.guards.model_folder, through refppo.runs.cli)."""

import json
import re
import shutil
import sys

import pytest
import torch
from test_cli import QUICK_PPO, TINY
from transformers import AutoTokenizer

from refppo.guards.model_folder import check_lora_rank, check_model_folder
from refppo.rollout.models import load_causal_lm, load_value_model
from refppo.runs.cli import entry, main


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "sft"
    assert main(["sft", f"trainer.output_dir={out}", "sft.steps=1", "sft.batch_size=4", *TINY]) == 0
    return out


def _copy(sft_run, tmp_path, name="m"):
    folder = tmp_path / name
    shutil.copytree(sft_run / "model", folder)
    return folder


def _edit_config(folder, **fields):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | fields))


def _truncate(folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _other_tokenizer(folder):
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(folder)


def _checkpoint(tmp_path):
    step = tmp_path / "run" / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    (step / "trainer_state.pt").write_bytes(b"")
    return step


# (how to make the folder from a copy of the SFT model, the setting, the message)
BAD = {
    "missing": (lambda f: shutil.rmtree(f), "model.path", "no such folder"),
    "a file": (lambda f: (shutil.rmtree(f), f.write_text("x")), "model.path", "is a file, not a model folder"),
    "empty": (lambda f: (shutil.rmtree(f), f.mkdir()), "model.path", "holds no config.json"),
    "no weights": (lambda f: (f / "model.safetensors").unlink(), "model.path", "holds a config but no weights"),
    "truncated": (_truncate, "model.path", r"model.safetensors is truncated: \d+ bytes of the \d+"),
    "garbage": (
        lambda f: (f / "model.safetensors").write_bytes(b"not a tensor file at all"),
        "model.path",
        "model.safetensors is not a safetensors file",
    ),
    "bad json": (lambda f: (f / "config.json").write_text("{"), "model.path", "config.json is not valid JSON"),
    "not a model config": (
        lambda f: (f / "config.json").write_text('{"steps": 3}'),
        "model.path",
        "config.json is not a transformers model config",
    ),
    "reward model as actor": (
        lambda f: _edit_config(f, architectures=["LlamaForTokenClassification"]),
        "model.path",
        "holds a scalar-head model \\(LlamaForTokenClassification\\), not a language model",
    ),
    "small vocabulary": (
        lambda f: _edit_config(f, vocab_size=10),
        "model.path",
        r"the tokenizer has \d+ tokens but the model only 10 embedding rows",
    ),
    "few positions": (
        lambda f: _edit_config(f, max_position_embeddings=8),
        "model.path",
        "the model has 8 positions, fewer than the 20 of data.max_prompt_length",
    ),
    "critic with another tokenizer": (_other_tokenizer, "critic.model.path", "its tokenizer differs from model.path's"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_wrong_model_folder_is_refused_in_one_line_before_any_write(case, sft_run, tmp_path, capsys, monkeypatch):
    make, key, message = BAD[case]
    folder = _copy(sft_run, tmp_path)
    make(folder)
    model = folder if key == "model.path" else sft_run / "model"
    out = tmp_path / "run"
    extra = [f"{key}={folder}"] if key != "model.path" else []
    monkeypatch.setattr(
        sys, "argv", ["refppo", "ppo", f"model.path={model}", f"trainer.output_dir={out}", *QUICK_PPO, *extra]
    )
    assert entry() == 2
    err = capsys.readouterr().err
    assert err.startswith(f"refppo: error: {key}={folder}: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert not out.exists()


def test_a_run_or_checkpoint_folder_names_the_model_or_the_resume(sft_run, tmp_path):
    with pytest.raises(ValueError, match=f"it is a refppo run folder: its model is {sft_run / 'model'}"):
        check_model_folder(sft_run, "model.path")
    step = _checkpoint(tmp_path)
    with pytest.raises(ValueError, match=f"resume it with trainer.resume=true trainer.output_dir={tmp_path / 'run'}"):
        check_model_folder(step, "model.path")
    with pytest.raises(ValueError, match="resume it"):
        check_model_folder(tmp_path / "run", "model.path")


def test_an_unreadable_file_is_named(sft_run, tmp_path, monkeypatch):
    import refppo.guards.model_folder as mf

    folder = _copy(sft_run, tmp_path)
    monkeypatch.setattr(mf.os, "access", lambda p, mode: not str(p).endswith("model.safetensors"))
    with pytest.raises(ValueError, match="cannot read model.safetensors"):
        check_model_folder(folder, "model.path")


def test_a_sharded_checkpoint_is_checked_shard_by_shard(sft_run, tmp_path):
    folder = _copy(sft_run, tmp_path)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors is missing"):
        check_model_folder(folder, "model.path")
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match="model.safetensors.index.json is not a shard index"):
        check_model_folder(folder, "model.path")
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(folder / "model-00001-of-00002.safetensors", folder / "model-00002-of-00002.safetensors")
    assert check_model_folder(folder, "model.path")["model_type"] == "llama"


def test_a_good_folder_passes_and_gives_its_config(sft_run):
    config = check_model_folder(sft_run / "model", "model.path", head=False, positions=20)
    assert config["model_type"] == "llama" and config["max_position_embeddings"] >= 20


def test_a_lora_rank_above_the_hidden_size_is_refused_before_any_write(sft_run, tmp_path, capsys, monkeypatch):
    hidden = check_model_folder(sft_run / "model", "model.path")["hidden_size"]
    check_lora_rank(hidden, {"hidden_size": hidden}, sft_run / "model")  # the largest rank that adds rank
    out = tmp_path / "run"
    for rank in (hidden + 1, 10**23):  # 10**23 overflowed inside torch
        argv = ["refppo", "ppo", f"model.path={sft_run / 'model'}", f"trainer.output_dir={out}", *QUICK_PPO]
        monkeypatch.setattr(sys, "argv", [*argv, f"model.lora_rank={rank}"])
        assert entry() == 2
        err = capsys.readouterr().err
        assert err == (
            f"refppo: error: model.lora_rank={rank} is above the hidden size {hidden} of {sft_run / 'model'}: an "
            f"adapter of every linear layer has rank at most {hidden}; make it at most {hidden}\n"
        )
        assert not out.exists()


def test_a_checkpoint_with_nan_weights_is_refused_before_any_write(sft_run, tmp_path, capsys, monkeypatch):
    """A diverged run's model loads, then failed at step 1 with a traceback once the run folder
    existed; now every loader refuses it, and the command in one line."""
    folder = tmp_path / "nan"
    model = load_causal_lm(sft_run / "model")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(sft_run / "model").save_pretrained(folder)
    capsys.readouterr()  # the save's progress bar
    message = r"1 of its \d+ weight tensors hold NaN or inf \(model.layers.0.mlp.up_proj.weight\)"
    for load in (load_causal_lm, load_value_model):
        with pytest.raises(ValueError, match=f"model folder {folder}: {message}"):
            load(folder)
    out = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["refppo", "ppo", f"model.path={folder}", f"trainer.output_dir={out}", *QUICK_PPO])
    assert entry() == 2
    err = capsys.readouterr().err
    assert re.fullmatch(f"refppo: error: model folder {folder}: {message}; .*\n", err), err
    assert not out.exists()


# A model class transformers does not know: its config and models live in the folder's own file,
# which config.json's auto_map names (as a Hugging Face checkpoint with custom code ships them).
CUSTOM_CODE = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel, LlamaPreTrainedModel
from transformers.modeling_outputs import TokenClassifierOutput


class TinyCustomConfig(LlamaConfig):
    model_type = "tiny_custom"


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig


class TinyCustomForTokenClassification(LlamaPreTrainedModel):
    config_class = TinyCustomConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.score = torch.nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        return TokenClassifierOutput(logits=self.score(hidden.last_hidden_state))
"""
AUTO_MAP = {
    "AutoConfig": "modeling_tiny_custom.TinyCustomConfig",
    "AutoModelForCausalLM": "modeling_tiny_custom.TinyCustomForCausalLM",
    "AutoModelForTokenClassification": "modeling_tiny_custom.TinyCustomForTokenClassification",
}


@pytest.fixture(scope="module")
def custom_code_model(sft_run, tmp_path_factory):
    """The SFT model's weights and tokenizer in a folder whose model type only its own code defines."""
    folder = tmp_path_factory.mktemp("custom") / "m"
    shutil.copytree(sft_run / "model", folder)
    (folder / "modeling_tiny_custom.py").write_text(CUSTOM_CODE)
    config = json.loads((folder / "config.json").read_text())
    config |= {"model_type": "tiny_custom", "architectures": ["TinyCustomForCausalLM"], "auto_map": AUTO_MAP}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_folder_with_its_own_code_loads_and_runs_with_trust_remote_code(custom_code_model, sft_run):
    """Trusted, the folder's own classes build the actor and a critic, whose outputs equal those of
    the same weights in transformers' Llama classes; a PPO step with a critic runs on it."""
    tok = AutoTokenizer.from_pretrained(custom_code_model, trust_remote_code=True)
    actor = load_causal_lm(custom_code_model, tok, trust_remote_code=True)
    critic = load_value_model(custom_code_model, tok, trust_remote_code=True)
    assert type(actor).__name__ == "TinyCustomForCausalLM", type(actor)
    assert type(critic).__name__ == "TinyCustomForTokenClassification", type(critic)
    ids = torch.tensor([tok("12+30=")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(actor(ids).logits, load_causal_lm(sft_run / "model", tok)(ids).logits)
    out = custom_code_model.parent / "ppo"
    argv = ["ppo", f"model.path={custom_code_model}", "model.trust_remote_code=true"]
    assert main([*argv, "critic.model.trust_remote_code=true", f"trainer.output_dir={out}", *QUICK_PPO]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and "critic/vf_loss" in rows[-1], rows[-1].keys()
    assert (out / "actor" / "modeling_tiny_custom.py").is_file()  # the saved actor carries its code


@pytest.mark.parametrize(
    "given, named",
    [
        ([], "model.trust_remote_code"),
        (["model.trust_remote_code=true"], "critic.model.trust_remote_code"),  # the critic's own, as verl's
        (
            ["actor_rollout_ref.model.trust_remote_code=False", "critic.model.trust_remote_code=true"]
            + ["data.max_prompt_length=16"],  # a verl line takes verl's 512 otherwise
            "model.trust_remote_code=true",
        ),
    ],
)
def test_a_folder_with_its_own_code_is_refused_without_trust_remote_code(
    custom_code_model, given, named, capsys, monkeypatch, tmp_path
):
    out = tmp_path / "run"
    argv = ["refppo", "ppo", f"model.path={custom_code_model}", *given, f"trainer.output_dir={out}", *QUICK_PPO]
    monkeypatch.setattr(sys, "argv", argv)
    assert entry() == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("refppo: error:")]
    assert len(err) == 1 and not out.exists(), err
    assert named in err[0] and "modeling_tiny_custom.py" in err[0] and "auto_map" in err[0], err


def test_trusted_code_without_the_class_a_run_builds_is_refused(custom_code_model, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "m"
    shutil.copytree(custom_code_model, folder)
    _edit_config(folder, auto_map={k: v for k, v in AUTO_MAP.items() if "TokenClassification" not in k})
    out = tmp_path / "run"
    trusted = ["model.trust_remote_code=true", "critic.model.trust_remote_code=true"]
    monkeypatch.setattr(sys, "argv", ["refppo", "ppo", f"model.path={folder}", *trusted, f"trainer.output_dir={out}"])
    assert entry() == 2
    err = capsys.readouterr().err
    assert "defines no AutoModelForTokenClassification" in err and not out.exists(), err
