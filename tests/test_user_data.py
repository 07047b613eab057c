"""refppo sft and refppo rm on a user's files (refppo.training.user_data): every layout TRL, verl and
OpenRLHF read trains, each problem is refused by file, line and key before any write, and the
README's "your own data" story runs as written."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from refppo.runs.cli import main
from refppo.settings.config import Config, apply_overrides
from refppo.tasks.tokenizer import build_tokenizer
from refppo.training.user_data import held_out, read_comparisons, read_demonstrations

ROOT = Path(__file__).parents[1]
TINY = [
    "model.hidden_size=32",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
]
LENGTHS = ["data.max_prompt_length=40", "data.max_response_length=4", "trainer.progress_bar=false"]
SFT = ["sft.steps=2", "sft.batch_size=2", *TINY, *LENGTHS]
RM = ["rm.steps=2", "rm.batch_size=2", *LENGTHS]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def write(path: Path, records: list) -> Path:
    if path.suffix == ".parquet":
        pd.DataFrame(records).to_parquet(path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def data(*overrides):
    return apply_overrides(Config(), ["data.task=file", "data.train_files=x", *LENGTHS, *overrides]).data


SUMS = [(a, b) for a in range(4) for b in range(8, 13)]  # 20 records a file, two-digit answers
SFT_LAYOUTS = {
    "chat": ([], [{"messages": [user(f"{a}+{b}="), assistant(str(a + b))]} for a, b in SUMS]),
    "multi-turn chat": (
        [],
        [
            {"messages": [user(f"{a}+{b}="), assistant(str(a + b)), user(f"{b}+{a}="), assistant(str(a + b))]}
            for a, b in SUMS
        ],
    ),
    "TRL prompt-completion": ([], [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in SUMS]),
    "TRL conversational prompt-completion": (
        [],
        [{"prompt": [user(f"{a}+{b}=")], "completion": [assistant(str(a + b))]} for a, b in SUMS],
    ),
    "verl keys": (
        ["data.prompt_key=question", "data.response_key=answer"],
        [{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in SUMS],
    ),
}


@pytest.mark.parametrize("layout", SFT_LAYOUTS)
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_sft_trains_on_each_layout(tmp_path, layout, suffix):
    overrides, records = SFT_LAYOUTS[layout]
    path = write(tmp_path / f"sft{suffix}", records)
    found = read_demonstrations(str(path), data(*overrides), build_tokenizer())
    turns = 2 if layout == "multi-turn chat" else 1
    assert len(found) == turns * len(records)
    prompt, response, record = found[-1]
    a, b = SUMS[-1]
    assert response == str(a + b) and record == records[-1]
    if layout == "multi-turn chat":
        assert prompt == [user(f"{a}+{b}="), assistant(str(a + b)), user(f"{b}+{a}=")], "the turns before the answer"
    out = tmp_path / "run"
    assert (
        main(["sft", "data.task=file", f"data.train_files={path}", f"trainer.output_dir={out}", *SFT, *overrides]) == 0
    )
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 2] and lines[-1]["val/loss"] > 0
    assert "val/accuracy" not in lines[-1], "no ground truth in these records"


def test_sft_held_out_loss_and_accuracy(tmp_path):
    """data.val_files gives the held-out records; val/loss is their responses' mean NLL, and with
    ground truths val/accuracy is the share of greedy answers equal to them (recomputed here)."""
    records = [
        {"messages": [user(f"{a}+{b}="), assistant(str(a + b))], "reward_model": {"ground_truth": str(a + b)}}
        for a, b in SUMS
    ]
    train, val = write(tmp_path / "train.jsonl", records[:16]), write(tmp_path / "val.jsonl", records[16:])
    out = tmp_path / "run"
    files = [f"data.train_files={train}", f"data.val_files={val}"]
    assert (
        main(["sft", "data.task=file", *files, f"trainer.output_dir={out}", *SFT, "sft.steps=30", "sft.lr=3e-3"]) == 0
    )
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    import torch
    from transformers import AutoModelForCausalLM

    from refppo.rollout.generation import generate
    from refppo.rollout.prompts import build_batch, decode_texts, tokenize_prompts

    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    prompts = [r["messages"][:1] for r in records[16:]]
    answers = [r["messages"][1]["content"] for r in records[16:]]
    batch = build_batch(tok, prompts, answers)
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
    width = batch["responses"].shape[1]
    logp = torch.log_softmax(logits[:, -width - 1 : -1].double(), -1).gather(-1, batch["responses"][..., None])[..., 0]
    mask = batch["response_mask"].double()
    assert last["val/loss"] == pytest.approx(float(-(logp * mask).sum() / mask.sum()), rel=1e-4)
    ids, attention = tokenize_prompts(tok, prompts, 40)
    greedy = generate(model, ids, attention, tok.eos_token_id, tok.pad_token_id, 4, do_sample=False)
    said = decode_texts(tok, greedy)[1]
    assert last["val/accuracy"] == pytest.approx(sum(s.strip() == a for s, a in zip(said, answers)) / len(answers))


RM_LAYOUTS = {
    "texts with a prompt": (
        [],
        [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)} for a, b in SUMS],
    ),
    "HH whole conversations": (
        [],
        [{"chosen": f"u: {a}+{b}= a: {a + b}", "rejected": f"u: {a}+{b}= a: {a + b + 1}"} for a, b in SUMS],
    ),
    "UltraFeedback chats": (
        [],
        [
            {
                "prompt": f"{a}+{b}=",
                "chosen": [user(f"{a}+{b}="), assistant(str(a + b))],
                "rejected": [user(f"{a}+{b}="), assistant("99")],
            }
            for a, b in SUMS
        ],
    ),
    "TRL explicit prompt, chats": (
        [],
        [
            {"prompt": [user(f"{a}+{b}=")], "chosen": [assistant(str(a + b))], "rejected": [assistant("99")]}
            for a, b in SUMS
        ],
    ),
    "OpenRLHF keys": (
        ["data.prompt_key=input", "data.chosen_key=pos", "data.rejected_key=neg"],
        [{"input": f"{a}+{b}=", "pos": str(a + b), "neg": str(a + b + 2)} for a, b in SUMS],
    ),
}


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "run"
    assert (
        main(
            ["sft", f"trainer.output_dir={out}", "sft.steps=2", "sft.batch_size=8", *TINY, "trainer.progress_bar=false"]
        )
        == 0
    )
    return out / "model"


@pytest.mark.parametrize("layout", RM_LAYOUTS)
def test_rm_trains_on_each_layout(tmp_path, sft_model, layout):
    overrides, records = RM_LAYOUTS[layout]
    path = write(tmp_path / "pairs.jsonl", records)
    found = read_comparisons(str(path), data(*overrides), build_tokenizer())
    assert len(found) == len(records)
    a, b = SUMS[-1]
    prompt, chosen, rejected = found[-1]
    if layout == "HH whole conversations":  # the shared beginning, up to its last whitespace
        assert (prompt, chosen, rejected) == (f"u: {a}+{b}= a:", f" {a + b}", f" {a + b + 1}")
    else:
        assert chosen == str(a + b) and rejected != chosen
        assert prompt in (f"{a}+{b}=", [user(f"{a}+{b}=")])
    out = tmp_path / "run"
    run = ["rm", f"model.path={sft_model}", "data.task=file", f"data.train_files={path}", f"trainer.output_dir={out}"]
    assert main(run + RM + overrides) == 0
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and 0 <= last["val/accuracy"] <= 1 and "val/margin" in last


def test_held_out_is_seeded_and_keeps_a_chat_whole(tmp_path):
    items = list(range(20))
    assert held_out(items, 0.1, seed=0) == held_out(items, 0.1, seed=0)
    train, held = held_out(items, 0.1, seed=0)
    assert len(held) == 2 and sorted(train + held) == items and held != held_out(items, 0.1, seed=1)[1]
    assert held_out(items[:2], 0.9, seed=0)[0], "one is always left to train on"
    # one item cannot be split: refused, where nothing was held out and no val/* logged, silently
    with pytest.raises(ValueError, match=r"data.val_fraction=0.5 holds out one of 1 item\(s\), which leaves none"):
        held_out(items[:1], 0.5, seed=0)
    assert held_out(items[:1], 0.0, seed=0) == ([0], [])
    path = write(tmp_path / "sft.jsonl", SFT_LAYOUTS["multi-turn chat"][1])
    config = apply_overrides(Config(), ["data.task=file", f"data.train_files={path}", *LENGTHS]).data
    from refppo.training.user_data import demonstrations

    train, held = demonstrations(config, build_tokenizer(), seed=0)
    assert len(held) == 4 and len(train) == 36, "both turns of each held-out chat are held out"
    assert held[0][2] is held[1][2] and all(t[2] is not held[0][2] for t in train)


@pytest.mark.parametrize(
    "command, records, problem",
    [
        (
            "sft",
            [{"question": "1+1=", "answer": "2"}],
            r"sft.jsonl:1: the record has neither 'messages' .* nor 'prompt' and 'completion'",
        ),
        ("sft", [{"prompt": "1+1=", "completion": " "}], r"sft.jsonl:1: an empty response in 'completion'"),
        ("sft", [{"messages": [user("1+1=")]}], r"sft.jsonl:1: the chat in 'messages' ends with a 'user' turn"),
        ("sft", [{"messages": [assistant("2"), user("1+1="), assistant("2")]}], "opens with an assistant turn"),
        (
            "sft",
            [{"prompt": "1+1=", "completion": [user("2")]}],
            "'completion' is neither a text nor a chat of one assistant",
        ),
        (
            "sft",
            [{"prompt": "1+1=", "completion": "2" * 9}],
            r"sft.jsonl:1: a response has 10 tokens with EOS, more than data.max_response_length=4",
        ),
        (
            "sft",
            [{"prompt": "1+" * 30, "completion": "2"}],
            r"sft.jsonl:1: the prompt has 61 tokens, more than data.max_prompt_length=40",
        ),
        ("rm", [{"prompt": "1+1=", "chosen": "2"}], r"pairs.jsonl:1: the record has no field 'rejected'"),
        (
            "rm",
            [{"prompt": "1+1=", "chosen": "2", "rejected": "2"}],
            r"pairs.jsonl:1: 'chosen' and 'rejected' are the same response",
        ),
        (
            "rm",
            [{"prompt": "1+1=", "chosen": "2", "rejected": ""}],
            r"pairs.jsonl:1: an empty response in 'chosen' and 'rejected'",
        ),
        (
            "rm",
            [{"chosen": [user("1+1="), assistant("2")], "rejected": [user("1+2="), assistant("3")]}],
            "have different prompts",
        ),
        (
            "rm",
            [{"chosen": [user("1+1="), assistant("2")], "rejected": [assistant("2"), user("x")]}],
            "ends with a 'user' turn",
        ),
        ("rm", [{"chosen": "2", "rejected": "3"}], "share no beginning to take as the prompt: add 'prompt'"),
        ("rm", [{"prompt": "1+1=", "chosen": "2", "rejected": [assistant("3")]}], "must both be texts or both chats"),
        (
            "rm",
            [{"chosen": [assistant("2")], "rejected": [assistant("3")]}],
            "hold only the assistant's turn, and there is no 'prompt'",
        ),
    ],
)
def test_bad_records_are_refused_by_file_line_and_key_before_any_write(tmp_path, sft_model, command, records, problem):
    name = "sft.jsonl" if command == "sft" else "pairs.jsonl"
    path = write(tmp_path / name, records * 4)
    out = tmp_path / "run"
    settings = SFT if command == "sft" else [f"model.path={sft_model}", *RM]
    with pytest.raises(ValueError, match=problem):
        main([command, "data.task=file", f"data.train_files={path}", f"trainer.output_dir={out}", *settings])
    assert not out.exists()


def test_overlong_records_are_dropped_when_asked(tmp_path):
    records = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in SUMS]
    records[3]["completion"] = "1" * 9
    path = write(tmp_path / "sft.jsonl", records)
    kept = read_demonstrations(str(path), data("data.filter_overlong_prompts=true"), build_tokenizer())
    assert len(kept) == len(records) - 1 and all(response != "1" * 9 for _, response, _ in kept)


def test_sft_and_rm_settings_for_files_are_refused_elsewhere(tmp_path):
    with pytest.raises(
        ValueError, match="data.response_key=answer is ignored: data.response_key is read only with data.task=file"
    ):
        main(["sft", "data.response_key=answer", f"trainer.output_dir={tmp_path / 'a'}"])
    with pytest.raises(ValueError, match="refppo rm trains on comparisons: data.task=preference"):
        main(["rm", "data.task=arithmetic", "model.path=x", f"trainer.output_dir={tmp_path / 'b'}"])


def readme_story() -> list[list[str]]:
    """The commands of the README's "your own data" section, as written."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Your own data") :]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    commands = [
        shlex.split(line.partition("#")[0].replace("\\\n", " ")) for line in block.replace("\\\n", " ").splitlines()
    ]
    return [c for c in commands if c]


def test_the_readme_story_runs_as_written(tmp_path):
    """SFT, the reward model, then PPO, on the three hand-made files, with the README's commands
    (only the run folders moved under a temporary folder), and the files are the script's."""
    subprocess.run([sys.executable, "examples/own_data/make_files.py", "--out", str(tmp_path)], cwd=ROOT, check=True)
    for name in ("sft.jsonl", "pairs.jsonl", "prompts.jsonl"):
        assert (tmp_path / name).read_text() == (ROOT / "examples" / "own_data" / name).read_text(), name
    commands = readme_story()
    assert [c[:2] for c in commands] == [["refppo", "sft"], ["refppo", "rm"], ["refppo", "ppo"]]
    for command in commands:
        args = [a.replace("runs/", f"{tmp_path}/runs/") for a in command[1:]]
        subprocess.run([sys.executable, "-m", "refppo", *args], cwd=ROOT, check=True, capture_output=True)
    for run in ("own_sft", "own_rm", "own_ppo"):
        assert (tmp_path / "runs" / run / "metrics.jsonl").exists(), run
