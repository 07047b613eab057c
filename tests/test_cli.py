"""The refppo command and run folders (refppo.runs.cli, refppo.runs.folder)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from _inputs import CHAT_TEMPLATES

from refppo.runs.cli import main
from refppo.runs.folder import RunFolder
from refppo.settings.config import Config

TINY = [
    "model.hidden_size=32",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
]
QUICK_PPO = [
    "trainer.total_training_steps=2",
    "trainer.test_freq=1",
    "data.train_batch_size=8",
    "actor.ppo_mini_batch_size=4",
    "data.val_size=8",
    "trainer.progress_bar=false",
    "data.max_response_length=4",
    "trainer.critic_warmup=0",
]
FILE_PPO = [o for o in QUICK_PPO if o != "data.val_size=8"]  # data.val_files would leave data.val_size unread (refused)


def logged(run, key: str) -> list:
    """The values of ``key`` in a run folder's metrics.jsonl, in order (rows without it skipped)."""
    rows = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [r[key] for r in rows if key in r]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "sft"
    assert main(["sft", f"trainer.output_dir={out}", "sft.steps=3", "sft.batch_size=8", *TINY]) == 0
    return out


def test_sft_writes_a_run_folder(sft_run):
    assert json.loads((sft_run / "config.json").read_text())["sft"]["steps"] == 3
    lines = [json.loads(ln) for ln in (sft_run / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [1, 2, 3, 3] and "sft/loss" in lines[0]
    assert list(lines[-1]) == ["step", "val/score"], "the held-out score, after the last step"
    assert (sft_run / "model" / "config.json").exists() and (sft_run / "model" / "tokenizer_config.json").exists()
    assert sorted(p.name for p in sft_run.iterdir()) == ["config.json", "metrics.jsonl", "model"], (
        "no empty checkpoints/"
    )


@pytest.mark.parametrize("shown", [False, True])
def test_transformers_save_bar_follows_trainer_progress_bar(tmp_path, capsys, shown):
    """save_pretrained's "Writing model shards" bar shows only with trainer.progress_bar, and
    transformers' own switch is as it was after the run."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    out = tmp_path / "sft"
    settings = [f"trainer.output_dir={out}", "sft.steps=1", "sft.batch_size=8", f"trainer.progress_bar={shown}"]
    assert main(["sft", *settings, *TINY]) == 0
    assert ("Writing model shards" in capsys.readouterr().err) == shown
    assert hf_logging.is_progress_bar_enabled()


def test_a_second_sft_run_into_a_used_folder_is_refused_without_a_resume_it_cannot_do(sft_run):
    """sft saves no checkpoints and does not read trainer.resume, so its refusal does not offer it
    (ppo's does: test_ppo_run_resume_and_refusal)."""
    with pytest.raises(FileExistsError, match=r"already holds a run; pick a new trainer.output_dir$"):
        main(["sft", f"trainer.output_dir={sft_run}", "sft.steps=3", "sft.batch_size=8", *TINY])


def test_the_sft_held_out_score_is_the_ppo_runs_first(tmp_path, capsys):
    """The SFT summary's held-out score is what a PPO run from its model logs at step 0 (the
    preference task's gold reward: a continuous score that tells responses apart)."""
    sft = tmp_path / "sft"
    task = ["data.task=preference", "data.val_size=16", "data.max_response_length=4", "trainer.progress_bar=false"]
    assert main(["sft", f"trainer.output_dir={sft}", "sft.steps=3", "sft.batch_size=8", *TINY, *task]) == 0
    sft_score = json.loads((sft / "metrics.jsonl").read_text().splitlines()[-1])["val/score"]
    assert f"val/score: {sft_score:.4g} (step 3)" in capsys.readouterr().out
    out = tmp_path / "ppo"
    quick = [o for o in QUICK_PPO if o.split("=")[0] not in [t.split("=")[0] for t in task]]
    assert main(["ppo", f"model.path={sft}/model", f"trainer.output_dir={out}", *quick, *task]) == 0
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["val/score"] == sft_score


def test_ppo_run_resume_and_refusal(sft_run, tmp_path, capsys):
    out = tmp_path / "ppo"
    args = ["ppo", f"model.path={sft_run}/model", f"trainer.output_dir={out}", *QUICK_PPO]
    assert main(args) == 0
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    val = [ln["val/score"] for ln in lines]
    printed = capsys.readouterr().out  # the closing summary, computed from the folder
    assert f"run {out}: 2 steps" in printed and f"first {val[0]:.4g} (step 0), last {val[2]:.4g} (step 2)" in printed
    assert (
        f"actor/ppo_kl {lines[2]['actor/ppo_kl']:.4g}" in printed
        and "files: config.json, metrics.jsonl, actor/, checkpoints/" in printed
    )
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [0, 1, 2] and "val/score" in lines[0] and "actor/pg_loss" in lines[2]
    assert (out / "latest").read_text() == "2" and (out / "checkpoints" / "step_000002" / "trainer_state.pt").exists()
    assert (out / "actor" / "config.json").exists()
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(FileExistsError, match="already holds a run; .* or set trainer.resume=true to continue it"):
        main(args)
    assert (out / "metrics.jsonl").read_text() == before  # untouched
    # Resume to step 3: the first lines stay, one line is added.
    assert main(args + ["trainer.resume=true", "trainer.total_training_steps=3"]) == 0
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [0, 1, 2, 3]


def test_a_lora_run_saves_a_merged_actor_the_next_stage_loads(sft_run, tmp_path):
    from refppo.rollout.models import load_causal_lm

    out = tmp_path / "ppo_lora"
    args = [
        "ppo",
        f"model.path={sft_run}/model",
        f"trainer.output_dir={out}",
        "model.lora_rank=4",
        "actor.optim.lr=1e-2",
    ]
    assert main([*args, *QUICK_PPO]) == 0
    assert (out / "actor_adapter" / "adapter_config.json").exists() and not (
        out / "actor" / "adapter_config.json"
    ).exists()
    merged, sft = load_causal_lm(out / "actor"), load_causal_lm(sft_run / "model")
    assert merged.state_dict().keys() == sft.state_dict().keys()  # a plain model: no lora_ weights left
    assert any(not torch.equal(a, b) for a, b in zip(merged.state_dict().values(), sft.state_dict().values()))
    assert main(["ppo", f"model.path={out}/actor", f"trainer.output_dir={tmp_path / 'next'}", *QUICK_PPO]) == 0


def test_a_megatron_lora_run_saves_its_adapters_and_a_merged_actor(sft_run, tmp_path):
    """``model.lora.rank``: Megatron's adapters go to actor_adapter (their tensors and settings),
    the merged actor, a plain model of the SFT model's weights moved, to actor; the next stage loads it."""
    from safetensors.torch import load_file

    from refppo.rollout.models import load_causal_lm

    out = tmp_path / "ppo_megatron_lora"
    args = ["ppo", f"model.path={sft_run}/model", f"trainer.output_dir={out}", "model.lora.rank=4"]
    assert main([*args, "model.lora.lora_A_init_method=kaiming", "actor.optim.lr=1e-2", *QUICK_PPO]) == 0
    settings = json.loads((out / "actor_adapter" / "megatron_lora.json").read_text())
    assert settings == {
        "rank": 4,
        "alpha": 32,
        "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        "lora_A_init_method": "kaiming",
        "lora_B_init_method": "zero",
        "tensor_model_parallel_size": 1,
        "expert_model_parallel_size": 1,
        "expert_tensor_parallel_size": None,
    }
    tensors = load_file(out / "actor_adapter" / "megatron_lora.safetensors")
    assert any(name.endswith("self_attn.linear_qkv_lora.linear_in") for name in tensors)
    merged, sft = load_causal_lm(out / "actor"), load_causal_lm(sft_run / "model")
    assert merged.state_dict().keys() == sft.state_dict().keys()
    assert any(not torch.equal(a, b) for a, b in zip(merged.state_dict().values(), sft.state_dict().values()))
    assert main(["ppo", f"model.path={out}/actor", f"trainer.output_dir={tmp_path / 'next'}", *QUICK_PPO]) == 0


def _saved_adapter(model_folder, folder, rank=4):
    """A LoRA adapter of ``model_folder``'s model with non-zero weights, saved as peft saves one."""
    from refppo.rollout.models import add_lora, load_causal_lm

    torch.manual_seed(5)
    adapted = add_lora(load_causal_lm(model_folder), r=rank)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:  # peft starts B at 0: the adapter would be the identity
                param.normal_(0.0, 0.05)
    adapted.save_pretrained(folder)
    return adapted


def test_ppo_starts_from_a_saved_lora_adapter(sft_run, tmp_path):
    """verl's actor_rollout_ref.model.lora_adapter_path: the actor is model.path under the saved
    adapter, trainable; the reference is model.path itself (the adapter disabled, verl's
    ref_in_actor); the run saves the trained adapter and the merged model."""
    from refppo.rollout.models import load_causal_lm, load_lora_adapter, make_reference

    adapter = tmp_path / "adapter"
    saved = _saved_adapter(sft_run / "model", adapter)
    base = load_causal_lm(sft_run / "model")
    actor = load_lora_adapter(load_causal_lm(sft_run / "model"), str(adapter))
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(actor(ids).logits, saved.eval()(ids).logits)
        assert not torch.equal(actor(ids).logits, base(ids).logits), "a vacuous check: the adapter changes nothing"
        assert torch.equal(make_reference(actor)(ids).logits, base(ids).logits)
    assert any(p.requires_grad for n, p in actor.named_parameters() if "lora_" in n)
    out = tmp_path / "ppo"
    args = ["ppo", f"model.path={sft_run}/model", f"model.lora_adapter_path={adapter}", f"trainer.output_dir={out}"]
    assert main([*args, "actor.optim.lr=1e-2", *QUICK_PPO]) == 0
    assert (out / "actor_adapter" / "adapter_config.json").exists() and (out / "actor" / "config.json").exists()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: None, "no adapter_config.json there"),
        (lambda d: (d / "adapter_config.json").write_text('{"peft_type": "PREFIX_TUNING"}'), "a PREFIX_TUNING adapter"),
        (lambda d: (d / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}'), "no adapter weights"),
    ],
)
def test_a_folder_that_is_not_a_lora_adapter_is_refused_before_any_work(sft_run, tmp_path, make, message):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    make(adapter)
    out = tmp_path / "ppo"
    args = ["ppo", f"model.path={sft_run}/model", f"model.lora_adapter_path={adapter}", f"trainer.output_dir={out}"]
    with pytest.raises(ValueError, match=message):
        main([*args, *QUICK_PPO])
    assert not out.exists(), "nothing written before the check"


def _file_run(sft_run, tmp_path, prompts: int, quick: list[str]):
    """``refppo ppo`` arguments for a run on a file of ``prompts`` arithmetic prompts with their
    answers, and its run folder."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(prompts)))
    out = tmp_path / "ppo_file"
    model = f"model.path={sft_run}/model"
    return ["ppo", model, f"trainer.output_dir={out}", "data.task=file", f"data.train_files={data}", *quick], out


def test_ppo_on_a_user_dataset_with_a_custom_reward(sft_run, tmp_path):
    args, out = _file_run(sft_run, tmp_path, 20, QUICK_PPO)
    assert main(args + ["reward_model.reward_fn=refppo.tasks.arithmetic:exact_match_reward"]) == 0
    assert (out / "metrics.jsonl").exists()


def test_a_ppo_run_ended_by_its_epochs_keeps_the_schedule_of_total_training_steps(sft_run, tmp_path):
    """As verl (``RayPPOTrainer._create_dataloader``): 16 prompts in batches of 8 end the run after
    one epoch (2 steps), and the learning rate follows the cosine schedule of all 10 steps."""
    from test_optim import verl_lr_factors

    args, out = _file_run(sft_run, tmp_path, 16, FILE_PPO)
    schedule = ["actor.optim.lr=1e-3", "actor.optim.lr_scheduler_type=cosine"]
    epochs = ["trainer.total_training_steps=10", "trainer.total_epochs=1"]
    assert main([*args, *epochs, *schedule, "reward_model.reward_fn=refppo.tasks.arithmetic:exact_match_reward"]) == 0
    assert logged(out, "actor/lr") == pytest.approx([1e-3 * f for f in verl_lr_factors(10, cosine=True)[1:3]], rel=1e-6)


def rendered_and_right(prompts, responses, records):
    """A gsm8k-style rule reward: the answer from the record's ``reward_model.ground_truth``;
    -1 for a prompt that reached the reward function not rendered by the chat template."""
    return [
        float(r.strip() == rec["reward_model"]["ground_truth"])
        if p.startswith("user: ") and p.endswith(".assistant:")
        else -1.0
        for p, r, rec in zip(prompts, responses, records)
    ]


def test_ppo_on_chat_prompts_in_verls_format(sft_run, tmp_path):
    """Prompts as chats (verl's datasets) from a Parquet file, rendered by the chat template the
    model folder's tokenizer carries."""
    import shutil

    import pandas as pd
    from transformers import AutoTokenizer

    model = tmp_path / "chat_model"
    shutil.copytree(sft_run / "model", model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = CHAT_TEMPLATES["bos"]
    tokenizer.save_pretrained(model)
    records = [
        {"prompt": [{"role": "user", "content": f"{i}+{i}="}], "reward_model": {"ground_truth": str(2 * i)}}
        for i in range(20)
    ]
    pd.DataFrame(records).to_parquet(tmp_path / "chats.parquet")
    out = tmp_path / "ppo_chat"
    args = [
        "ppo",
        f"model.path={model}",
        f"trainer.output_dir={out}",
        "data.task=file",
        f"data.train_files={tmp_path / 'chats.parquet'}",
    ]
    overrides = [*QUICK_PPO, "data.max_prompt_length=32", "reward_model.reward_fn=test_cli:rendered_and_right"]
    assert main(args + overrides) == 0
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(ln["critic/score/min"] >= 0 for ln in lines if "critic/score/min" in ln) and len(lines) == 3
    assert all(ln["val/score"] >= 0 for ln in lines if "val/score" in ln)
    bare = tmp_path / "no_template_model"  # a model folder whose tokenizer has none, as many a base model's
    shutil.copytree(sft_run / "model", bare)
    (bare / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="the record's 'prompt' is a chat, but the tokenizer has no chat template"):
        main(
            [
                "ppo",
                f"model.path={bare}",
                f"trainer.output_dir={tmp_path / 'no_template'}",
                *args[3:],
                *overrides,
            ]
        )
    assert not (tmp_path / "no_template").exists()


def returns_strings(prompts, responses, records):
    return ["good"] * len(responses)


def returns_none(prompts, responses, records):
    return None


def returns_two(prompts, responses, records):
    return [0.0, 0.0]  # right for a batch of 2 only


def returns_one(prompts, responses, records):
    return [0.0]  # right for a batch of 1 only


@pytest.mark.parametrize(
    "extra, error, message",
    [
        (["data.train_files=/nowhere/x.jsonl"], FileNotFoundError, "does not exist"),
        (["data.train_files=/dev/null"], ValueError, "'/dev/null' is not a regular file"),
        (["data.train_files={bad}"], ValueError, "bad.jsonl:2 is not valid JSON"),
        (["data.train_files={nokey}"], ValueError, "nokey.jsonl:1: the record has no field 'prompt'"),
        (["data.train_files={twice}"], ValueError, "twice.jsonl:2 gives the key 'prompt' twice; keep one"),
        (["data.train_files={latin1}"], ValueError, "latin1.jsonl:2 is not UTF-8 text"),
        (
            ["data.train_files={long}"],
            ValueError,
            "long.jsonl:3: the prompt has 2[0-9] tokens, more than data.max_prompt_length=16",
        ),
        (["data.train_files={good}", "data.val_files={long}"], ValueError, "long.jsonl:3: the prompt has"),
        (["data.train_files={folder}"], IsADirectoryError, "is a folder"),
        (
            ["data.train_files={good}", "reward_model.reward_fn=test_cli:returns_strings"],
            ValueError,
            r"reward function test_cli:returns_strings returned a list; expected 1 number\(s\)",
        ),
        (
            ["data.train_files={good}", "reward_model.reward_fn=test_cli:returns_two"],
            ValueError,
            r"test_cli:returns_two returned shape \(2,\); expected \(1,\)",
        ),
        (
            ["data.train_files={good}", "reward_model.reward_fn=test_cli:returns_one"],
            ValueError,
            r"test_cli:returns_one returned shape \(1,\); expected \(3,\)",
        ),
        (
            ["data.train_files={good}", "reward_model.reward_fn=test_cli:returns_none"],
            ValueError,
            "test_cli:returns_none returned a NoneType",
        ),
        (
            ["data.train_files={good}", "reward_model.enable=true", "reward_model.model.path={lm}"],
            ValueError,
            "holds no trained scalar head",
        ),
        (
            ["data.train_files={good}", "reward_model.reward_fn=refppo.tasks.arithmetic:nothing"],
            ValueError,
            "has no function 'nothing'",
        ),
        (["data.train_files={good}", "reward_model.reward_fn=nocolon"], ValueError, "package.module:function"),
        (["data.train_files={good}", "reward_model.reward_fn=:fn"], ValueError, "package.module:function, a function"),
        (["data.train_files={good}", "reward_model.reward_fn=.relative:fn"], ValueError, "package.module:function"),
        (
            ["data.train_files={good}", "reward_model.reward_fn=test_cli:takes_one"],
            ValueError,
            r"test_cli:takes_one' cannot be called as fn\(prompts, responses, records\): too many positional",
        ),
        (
            ["data.train_files={good}", "reward_model.reward_fn=test_cli:keyword_only"],
            ValueError,
            "test_cli:keyword_only' cannot be called as fn",
        ),
        (["data.train_files={good}"], ValueError, "needs reward_model.reward_fn"),
    ],
)
def test_bad_datasets_and_reward_functions_create_no_run_folder(sft_run, tmp_path, extra, error, message):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1="}\n{not json}\n')
    (tmp_path / "nokey.jsonl").write_text('{"question": "1+1="}\n')
    (tmp_path / "twice.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": "1+1=", "prompt": "2+2="}\n')
    (tmp_path / "good.jsonl").write_text('{"prompt": "1+1="}\n' * 8)  # a batch of 8
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "1+1="}\n{"prompt": "café"}\n'.encode("latin-1"))
    (tmp_path / "long.jsonl").write_text('{"prompt": "1+1="}\n\n{"prompt": "' + "1+" * 10 + '1="}\n')
    (tmp_path / "folder.jsonl").mkdir()
    files = {k: tmp_path / f"{k}.jsonl" for k in ("bad", "nokey", "twice", "good", "latin1", "long", "folder")} | {
        "lm": f"{sft_run}/model"
    }
    out = tmp_path / "run"
    extra = [e.format(**files) for e in extra]
    with pytest.raises(error, match=message):
        main(["ppo", f"model.path={sft_run}/model", f"trainer.output_dir={out}", "data.task=file", *extra, *FILE_PPO])
    assert not out.exists()


def test_sft_with_fused_kernels_gives_the_same_run(sft_run, tmp_path, monkeypatch):
    """model.use_fused_kernels in refppo sft: the loss from the final hidden states, the same
    losses step by step as the logits path (CPU, float32)."""
    from refppo.accel.logprobs import BlockLogProbs

    seen, call = [], BlockLogProbs.__call__

    def recording(self, *args, **kwargs):
        seen.append(self.fused)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(BlockLogProbs, "__call__", recording)
    out = tmp_path / "fused"
    assert (
        main(
            [
                "sft",
                f"trainer.output_dir={out}",
                "sft.steps=3",
                "sft.batch_size=8",
                "model.use_fused_kernels=true",
                *TINY,
            ]
        )
        == 0
    )
    losses = [logged(run, "sft/loss") for run in (sft_run, out)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-6)
    assert seen and all(seen), "the flag must reach the loss"


@pytest.mark.parametrize("command", ["sft", "rm"])
def test_sft_and_rm_with_gradient_checkpointing_give_the_same_run(sft_run, tmp_path, monkeypatch, command):
    """model.enable_gradient_checkpointing in refppo sft and refppo rm: it reaches the trained
    model, and the losses are the same step by step (recomputing a layer changes no number)."""
    import refppo.accel.checkpointing
    from refppo.accel.checkpointing import enable_gradient_checkpointing

    seen = []

    def recording(model, *args):
        seen.append(type(model).__name__)
        enable_gradient_checkpointing(model, *args)

    monkeypatch.setattr(refppo.accel.checkpointing, "enable_gradient_checkpointing", recording)
    args = {
        "sft": ["sft.steps=3", "sft.batch_size=8", *TINY],
        "rm": ["data.task=preference", f"model.path={sft_run}/model", "rm.steps=3", "rm.batch_size=8", "rm.n_pairs=24"],
    }[command]
    runs = [tmp_path / "plain", tmp_path / "checkpointed"]
    for out, flag in zip(runs, ("false", "true")):
        assert main([command, f"trainer.output_dir={out}", f"model.enable_gradient_checkpointing={flag}", *args]) == 0
    losses = [logged(run, f"{command}/loss") for run in runs]
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    assert seen == ["LlamaForCausalLM" if command == "sft" else "LlamaForTokenClassification"]


@pytest.mark.parametrize(
    "command, extra, message",
    [
        ("sft", ["model.lora_rank=4"], r"refppo sft does not read model.lora_rank \(it trains every weight\): drop it"),
        ("rm", ["model.lora_alpha=4"], r"refppo rm does not read model.lora_alpha \(it trains every weight\)"),
        (
            "rm",
            ["model.use_fused_kernels=true"],
            r"refppo rm does not read model.use_fused_kernels \(it trains a scalar head",
        ),
        ("sft", ["trainer.resume=true"], r"refppo sft does not read trainer.resume \(it saves no checkpoints\)"),
        (
            "rm",
            ["model.hidden_size=64"],
            r"refppo rm does not read model.hidden_size \(the model's shape comes from model.path\)",
        ),
        (
            "sft",
            ["model.num_key_value_heads=1"],
            r"refppo sft: model.num_key_value_heads=1 is ignored: .* read only with model.path=null \(a fresh",
        ),
        (
            "ppo",
            ["model.arch=qwen2"],
            r"refppo ppo does not read model.arch \(the model's shape comes from model.path\)",
        ),
        ("sft", ["actor.optim.lr=1e-3"], r"refppo sft does not read actor.optim.lr \(it is a setting of refppo ppo\)"),
        ("rm", ["sft.steps=3"], r"refppo rm does not read sft.steps \(it is a setting of refppo sft\)"),
        ("ppo", ["rm.steps=3"], r"refppo ppo does not read rm.steps \(it is a setting of refppo rm\)"),
        (
            "ppo",
            ["algorithm.adv_estimator=grpo", "rollout.n=2", "critic.optim.lr=1e-4"],
            r"refppo ppo: critic.optim.lr=1e-4 is ignored: critic.optim.lr is read only with "
            r"algorithm.adv_estimator=gae",
        ),
        # Given at all, even at its default: refppo ppo would not read it.
        (
            "ppo",
            ["algorithm.kl_ctrl.kl_coef=0.001"],
            r"refppo ppo: algorithm.kl_ctrl.kl_coef=0.001 is ignored: .* read only with "
            r"algorithm.use_kl_in_reward=true\. Set that, or drop",
        ),
        (
            "ppo",
            ["rollout.ignore_eos=true", "reward_model.missing_eos_penalty=3"],
            r"reward_model.missing_eos_penalty=3 is ignored: .* read only with rollout.ignore_eos=false",
        ),
        (
            "ppo",
            ["algorithm.rollout_correction.bypass_mode=true", "rollout.log_prob_micro_batch_size_per_gpu=2"],
            "rollout.log_prob_micro_batch_size_per_gpu=2 is ignored",
        ),
        (
            "sft",
            ["trainer.total_training_steps=3"],
            r"refppo sft does not read trainer.total_training_steps \(of trainer.\* it reads trainer.seed, "
            r"trainer.device, trainer.output_dir, trainer.logger, trainer.project_name, "
            r"trainer.experiment_name, trainer.progress_bar\)",
        ),
        (
            "rm",
            ["data.max_response_length=4"],
            r"refppo rm: data.max_response_length=4 is ignored: .* read only with data.task=file",
        ),
        (
            "sft",
            ["sft.teacher_carry_error=0.5"],
            r"refppo sft: sft.teacher_carry_error=0.5 is ignored: .* read only with data.task=arithmetic",
        ),
    ],
)
def test_options_a_command_would_ignore_are_refused(sft_run, tmp_path, command, extra, message):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        main([command, f"trainer.output_dir={out}", "data.task=preference", f"model.path={sft_run}/model", *extra])
    assert not out.exists()


@pytest.mark.parametrize("command", ["sft", "rm", "ppo"])
def test_help_lists_every_setting_a_command_reads_as_an_override_that_parses_back(command, capsys):
    from refppo.runs.cli import read_settings
    from refppo.settings.config import apply_overrides

    assert main([command, "--help"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    settings = [row[0] for row in rows]
    assert [s.partition("=")[0] for s in settings] == read_settings(command, Config())
    expected = Config()
    expected.trainer.output_dir = f"runs/{command}"
    assert apply_overrides(Config(), settings) == expected  # each line is the default, as an override
    valid = {row[0].partition("=")[0]: " ".join(row[1:]) for row in rows}
    assert valid["trainer.device"] == "auto | cpu | cuda" and valid["trainer.seed"] == "[0, 4294967295]"
    if command == "ppo":
        # Registered estimators are valid too (test_registry.py adds some when it is imported).
        assert (
            valid["algorithm.adv_estimator"].startswith("gae | grpo | grpo_vectorized | rloo")
            and valid["actor.clip_ratio_c"] == "(1, inf)"
        )
        # A setting the defaults turn off says what turns it on.
        assert valid["algorithm.kl_ctrl.kl_coef"] == "[0, inf) (read only with algorithm.use_kl_in_reward=true)"
        assert valid["data.prompt_key"] == "(read only with data.task=file)"


def test_sft_refuses_fused_kernels_for_an_unsupported_model_before_any_write(sft_run, tmp_path):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from refppo.runs.cli import load_tokenizer

    tok = load_tokenizer(f"{sft_run}/model")
    gemma = tmp_path / "gemma"
    Gemma2ForCausalLM(
        Gemma2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=len(tok),
            pad_token_id=tok.pad_token_id,
        )
    ).save_pretrained(gemma)
    tok.save_pretrained(gemma)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="the SFT model is 'gemma2'"):
        main(["sft", f"trainer.output_dir={out}", f"model.path={gemma}", "model.use_fused_kernels=true", "sft.steps=1"])
    assert not out.exists()


def test_bad_config_and_paths(tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="did you mean actor.clip_ratio"):
        main(["ppo", "actor.clip_ration=0.1", f"trainer.output_dir={out}"])
    with pytest.raises(ValueError, match="set model.path"):
        main(["ppo", f"trainer.output_dir={out}"])
    with pytest.raises(ValueError, match="missing: no such folder"):
        main(["ppo", f"model.path={tmp_path}/missing", f"trainer.output_dir={out}"])
    hub_id = r"model.path=Qwen/Qwen2.5-0.5B-Instruct: no such folder; .* never downloads: for a hub id, save it"
    with pytest.raises(ValueError, match=hub_id):
        main(["ppo", "model.path=Qwen/Qwen2.5-0.5B-Instruct", f"trainer.output_dir={out}"])
    with pytest.raises(ValueError, match=r"trainer.output_dir= has no value: give one, or drop trainer.output_dir"):
        main(["ppo", f"model.path={tmp_path}", "trainer.output_dir="])
    with pytest.raises(ValueError, match=r"critic.model.path= has no value: give one \(or null\)"):
        main(["ppo", f"model.path={tmp_path}", "critic.model.path= ", f"trainer.output_dir={out}"])
    assert not out.exists()
    assert main([]) == 2
    assert main(["--help"]) == 0
    printed = capsys.readouterr().out
    assert "refppo COMMAND --help" in printed and "Settings take refppo's short keys" in printed
    assert "``" not in printed and ":mod:" not in printed, "the help is plain text, not reStructuredText"
    with pytest.raises(ValueError, match=r"data.task=file needs data.train_files \(JSONL or Parquet\)"):
        main(["sft", "data.task=file", f"trainer.output_dir={out}"])
    assert main(["PPO"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("refppo: error: unknown command 'PPO'; commands: sft, rm, ppo, plot, doctor\nusage:"), err


@pytest.mark.parametrize(
    "command, extra, message",
    [
        (
            "ppo",
            ["rollout.n=1000000"],
            r"data.train_batch_size=8 x rollout.n=1000000 at data.max_prompt_length=\d+ \+ "
            r"data.max_response_length=4 tokens needs at least .* GiB, more than",
        ),
        ("ppo", ["data.task=preference", "data.val_size=1000000000"], r"data.val_size=1000000000 at .* needs at least"),
        (
            "sft",
            ["data.max_prompt_length=100000000000000000000000"],
            r"data.val_size \(scored after training\) at data.max_prompt_length=100000000000000000000000 \+ ",
        ),
        (
            "ppo",
            ["data.task=preference", "data.train_batch_size=4004", "actor.ppo_mini_batch_size=4004"],
            "4004 is more than the 4000 training prompts",
        ),
        (
            "sft",
            ["sft.batch_size=1000000000000000000000000000000"],
            "sft.batch_size=1000000000000000000000000000000 is",
        ),
        ("sft", ["sft.n_examples=100000000"], "sft.n_examples=100000000 is more than the arithmetic task's"),
        ("sft", ["data.task=preference", "sft.n_examples=1000000000"], r"sft.n_examples=1000000000 needs at least"),
        ("rm", ["rm.n_pairs=1000000000"], r"rm.n_pairs=1000000000 needs at least"),
        ("rm", ["rm.n_pairs=10"], r"rm.batch_size=64 is more than the 10 training comparisons"),
        (
            "sft",
            ["model.num_hidden_layers=100000000000000000000000"],  # grew the fresh model until the OOM killer came
            r"model.hidden_size=128 x model.num_hidden_layers=100000000000000000000000 needs at least .* GiB, more",
        ),
        (
            "sft",
            ["model.hidden_size=1048576"],
            r"model.hidden_size=1048576 x model.num_hidden_layers=2 needs at least",
        ),
    ],
)
def test_sizes_beyond_the_data_or_the_memory_are_refused_before_any_write(sft_run, tmp_path, command, extra, message):
    out = tmp_path / "run"
    task = ["data.task=preference"] if command == "rm" else []
    source = [] if command == "sft" and "data.task=preference" not in extra else [f"model.path={sft_run}/model"]
    quick = (
        [o for o in QUICK_PPO if o.split("=")[0] not in [e.split("=")[0] for e in extra]] if command == "ppo" else []
    )
    with pytest.raises(ValueError, match=message):
        main([command, f"trainer.output_dir={out}", *source, *task, *quick, *extra])
    assert not out.exists()


def test_a_key_given_twice_on_the_command_line_is_refused(tmp_path, monkeypatch, capsys):
    from refppo.runs.cli import entry

    out = tmp_path / "run"
    argv = ["refppo", "ppo", "actor.optim.lr=1e-4", f"trainer.output_dir={out}", "actor.optim.lr=2e-4"]
    monkeypatch.setattr(sys, "argv", argv)
    assert entry() == 2
    err = capsys.readouterr().err
    assert err == "refppo: error: actor.optim.lr is given twice ('1e-4' and '2e-4'): keep one\n"
    assert not out.exists()


def test_python_dash_m_entry_point(tmp_path):
    result = subprocess.run([sys.executable, "-m", "refppo"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage: refppo {sft|rm|ppo}" in result.stderr
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "refppo", "ppo", "actor.clip_ration=0.1", f"trainer.output_dir={out}"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and not out.exists()
    assert (
        result.stderr == "refppo: error: unknown config key 'actor.clip_ration'; did you mean actor.clip_ratio, "
        "actor.clip_ratio_c, actor.clip_ratio_low?\n"
    )


def takes_one(prompts):
    return [0.0] * len(prompts)


def keyword_only(*, prompts, responses, records):
    return [0.0] * len(prompts)


def raises_itself(prompts, responses, records):
    raise ValueError("the user's own check")


def fails_once_running(prompts, responses, records):
    return [1.0] * len(responses) if not any(responses) else None  # the probe's responses are empty


def test_the_command_states_refused_input_in_one_line_and_keeps_other_tracebacks(
    sft_run, tmp_path, monkeypatch, capsys
):
    from refppo.runs.cli import entry

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1="}\n' * 8)
    out = tmp_path / "run"
    run = [
        "ppo",
        f"model.path={sft_run}/model",
        f"trainer.output_dir={out}",
        "data.task=file",
        f"data.train_files={data}",
        *FILE_PPO,
    ]
    refused = {
        f"data.val_files={tmp_path}/missing.jsonl": f"refppo: error: dataset file '{tmp_path}/missing.jsonl' does "
        "not exist",
        f"data.val_files={tmp_path}": f"refppo: error: dataset path '{tmp_path}' is a folder",
        "reward_model.reward_fn=no_such_module:score": "refppo: error: "
        "reward_model.reward_fn='no_such_module:score': no module named 'no_such_module'",
    }
    for extra, line in refused.items():
        monkeypatch.setattr(sys, "argv", ["refppo", *run, extra])
        assert entry() == 2
        err = capsys.readouterr().err
        assert err.startswith(line) and err.count("\n") == 1, err
    assert not out.exists()
    # The user's own error, and an error once the run has started, keep their tracebacks.
    monkeypatch.setattr(sys, "argv", ["refppo", *run, "reward_model.reward_fn=test_cli:raises_itself"])
    with pytest.raises(ValueError, match="the user's own check"):
        entry()
    assert not out.exists()
    monkeypatch.setattr(sys, "argv", ["refppo", *run, "reward_model.reward_fn=test_cli:fails_once_running"])
    with pytest.raises(ValueError, match="test_cli:fails_once_running returned a NoneType"):
        entry()
    assert out.exists()


def test_a_crash_while_saving_keeps_the_last_good_checkpoint(tmp_path):
    run = RunFolder(tmp_path / "r", Config())
    run.save_checkpoint(1, lambda folder: (folder / "state").write_text("one"))

    def crash(folder):
        (folder / "state").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run.save_checkpoint(2, crash)
    assert run.latest_step() == 1
    assert (run.checkpoint_dir(1) / "state").read_text() == "one"
    assert not run.checkpoint_dir(2).exists()
    run.save_checkpoint(2, lambda folder: (folder / "state").write_text("two"))
    assert run.latest_step() == 2 and sorted(os.listdir(tmp_path / "r" / "checkpoints")) == [
        "step_000001",
        "step_000002",
    ]


def test_a_reward_module_in_the_working_directory_is_found(tmp_path):
    """The ``refppo`` script's sys.path lacks the working directory (``python -m`` adds it);
    ``-I`` reproduces that."""
    (tmp_path / "my_reward.py").write_text(
        "def score(prompts, responses, records):\n    return [1.0] * len(responses)\n"
    )
    code = (
        "from refppo.training.reward_fns import load_reward_fn; "
        "print(load_reward_fn('my_reward:score')([], ['a', 'b'], []))"
    )
    result = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[1.0, 1.0]"


@pytest.mark.parametrize(
    "logger, module, package",
    [
        ("tensorboard", "torch.utils.tensorboard", "tensorboard"),
        ("wandb", "wandb", "wandb"),
        ("mlflow", "mlflow", "mlflow-skinny"),
    ],
)
def test_a_missing_optional_package_is_named_before_the_run_folder_exists(
    sft_run, tmp_path, monkeypatch, capsys, logger, module, package
):
    from refppo.runs.cli import entry

    monkeypatch.setitem(sys.modules, module, None)  # as if the package were not installed
    out = tmp_path / "run"
    argv = [
        "refppo",
        "ppo",
        f"model.path={sft_run}/model",
        f"trainer.output_dir={out}",
        f"trainer.logger=[console,{logger}]",
    ]
    monkeypatch.setattr(sys, "argv", [*argv, *QUICK_PPO])
    assert entry() == 2
    err = capsys.readouterr().err
    assert (
        err == f"refppo: error: trainer.logger=[console,{logger}] needs the {package} package: pip install {package}\n"
    )
    assert not out.exists()


def test_an_sft_learning_rate_that_breaks_the_weights_stops_at_its_step(tmp_path):
    with pytest.raises(FloatingPointError, match="sft step 2: .*contains NaN or inf.*sft.lr"):
        main(["sft", f"trainer.output_dir={tmp_path}/run", "sft.steps=2", "sft.batch_size=4", "sft.lr=1e10", *TINY])


def test_help_and_refusals_do_not_import_transformers():
    """transformers takes seconds to import: the command imports it only to load a model, so
    `--help` and the settings' refusals answer without it."""
    code = (
        "import sys\nfrom refppo.runs.cli import main\n"
        "try:\n    main(['ppo', 'actor.optim.lr=-1'])\nexcept ValueError as e:\n    assert 'optim.lr' in str(e)\n"
        "assert main(['ppo', '--help']) == 0\n"
        "print('transformers' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False", result.stdout
