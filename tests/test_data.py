import json

import pytest
from _inputs import chat_tokenizer, templateless_tokenizer

from refppo.training.data import EpochSampler, load_records


def test_epoch_sampler_epochs_and_state():
    sampler = EpochSampler([{"i": i} for i in range(10)], 4, seed=0)
    seen = [r["i"] for _ in range(5) for r in sampler.next_batch()]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    state = sampler.state_dict()
    after = sampler.next_batch()
    sampler.load_state_dict(state)
    assert sampler.next_batch() == after
    with pytest.raises(ValueError, match="the dataset is empty"):
        EpochSampler([], 4, 0)


def test_an_unshuffled_sampler_serves_the_records_in_order():
    """verl 0.9's ``create_rl_sampler`` (``verl/trainer/ppo/utils.py``) takes a ``SequentialSampler``
    with ``data.shuffle=false``: every epoch in the dataset's order."""
    sampler = EpochSampler([{"i": i} for i in range(10)], 4, seed=0, shuffle=False)
    seen = [r["i"] for _ in range(5) for r in sampler.next_batch()]
    assert seen == list(range(10)) * 2


def test_a_ppo_sampler_drops_an_epochs_last_partial_batch_as_verls_loader():
    """verl's PPO data loader drops the last partial batch (``drop_last=True`` in
    ``RayPPOTrainer._create_dataloader`` and the V1 trainer's ``_init_dataloader``) and starts the
    next epoch: 10 prompts in batches of 4 serve 0-3, 4-7, then 0-3 again; shuffled, each batch
    lies within one epoch's order."""
    sampler = EpochSampler([{"i": i} for i in range(10)], 4, seed=0, shuffle=False, drop_last=True)
    batches = [[r["i"] for r in sampler.next_batch()] for _ in range(4)]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]]
    shuffled = EpochSampler([{"i": i} for i in range(10)], 4, seed=3, drop_last=True)
    served = [[r["i"] for r in shuffled.next_batch()] for _ in range(4)]
    assert len({*served[0], *served[1]}) == 8 and len({*served[2], *served[3]}) == 8


# verl's data format (e.g. its gsm8k preprocessing): the prompt is a chat, the answer in a struct.
CHAT_RECORDS = [
    {
        "prompt": [{"role": "user", "content": f"{i}+{i}="}],
        "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
    }
    for i in range(3)
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_chat_prompts_load_from_jsonl_and_parquet_alike(tmp_path):
    """A Parquet file gives the same records as the JSONL one (its list columns arrive as numpy
    arrays), text prompts and chats alike."""
    import pandas as pd

    tok = chat_tokenizer()
    texts = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(3)]
    for name, records in (("texts", texts), ("chats", CHAT_RECORDS)):
        pd.DataFrame(records).to_parquet(tmp_path / f"{name}.parquet")
        from_jsonl = load_records(write_jsonl(tmp_path / f"{name}.jsonl", records), "prompt", tok, 32)
        assert from_jsonl == records
        assert load_records(str(tmp_path / f"{name}.parquet"), "prompt", tok, 32) == records
    pd.DataFrame(texts).to_parquet(tmp_path / "SHOUTED.PARQUET")  # the extension in any case
    assert load_records(str(tmp_path / "SHOUTED.PARQUET"), "prompt", tok, 32) == texts


def test_chat_prompts_are_checked_at_load_time(tmp_path):
    path = write_jsonl(
        tmp_path / "mixed.jsonl", [{"prompt": "1+1="}, *CHAT_RECORDS[:1], {"prompt": [{"content": "1"}]}]
    )
    with pytest.raises(
        ValueError, match="mixed.jsonl:2: the record's 'prompt' is a chat, but the tokenizer has no chat template"
    ):
        load_records(path, "prompt", templateless_tokenizer())
    tok = chat_tokenizer()
    with pytest.raises(ValueError, match="mixed.jsonl:3: the record's 'prompt' is neither a text nor a chat"):
        load_records(path, "prompt", tok)
    # The limit counts the template's tokens, one a character after the BOS.
    path = write_jsonl(tmp_path / "chats.jsonl", CHAT_RECORDS)
    n = 1 + len("user: 0+0=.assistant:")
    assert len(load_records(path, "prompt", tok, n)) == 3
    with pytest.raises(
        ValueError, match=f"chats.jsonl:1: the prompt has {n} tokens, more than data.max_prompt_length={n - 1}"
    ):
        load_records(path, "prompt", tok, n - 1)


def test_a_chat_the_template_refuses_is_named_by_file_line_and_roles(tmp_path):
    """A role the chat template does not know (its raise_exception, as Llama's and Qwen's
    templates have) is refused at load time, with or without a length limit."""
    tok = chat_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('roles must be user or assistant') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    tool = {"prompt": [{"role": "user", "content": "1+1="}, {"role": "tool", "content": "2"}]}
    path = write_jsonl(tmp_path / "roles.jsonl", [*CHAT_RECORDS[:2], tool])
    for limit in (None, 32):
        with pytest.raises(
            ValueError, match=r"roles.jsonl:3: the tokenizer's chat template refuses this chat \(roles: user, tool\)"
        ):
            load_records(path, "prompt", tok, limit)
    assert len(load_records(write_jsonl(tmp_path / "ok.jsonl", CHAT_RECORDS), "prompt", tok)) == 3


def test_damaged_files_are_refused_in_one_line_naming_them(tmp_path):
    import pandas as pd

    (tmp_path / "json.parquet").write_text('{"prompt": "1+1="}\n')
    pd.DataFrame([{"prompt": "1+1="}] * 50).to_parquet(tmp_path / "cut.parquet")
    cut = (tmp_path / "cut.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(cut[: len(cut) // 2])
    (tmp_path / "deep.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    for name, message in [
        ("json.parquet", "json.parquet is not a readable Parquet file"),
        ("cut.parquet", "cut.parquet is not a readable Parquet file"),
        ("deep.jsonl", "deep.jsonl:2 is nested too deeply to read"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_records(str(tmp_path / name), "prompt")
