"""verl 0.9's continuous-token rollouts (``data.continuous_token.*``) on refppo's single-turn rollout.

verl's ``SingleTurnAgentLoop.run`` (``verl/experimental/agent_loop/single_turn_agent_loop.py``)
builds a continuous-token prompt with its builder's ``build_initial_tokens`` and appends the
response with ``merge_assistant_tokens``, which adds nothing of its own. Every builder but
DeepSeek-V4's renders the first turn with the chat template (``ContinuousTokenBuilder._render_tokens``
in ``verl/utils/tokenizer/continuous_token.py``); DeepSeek-V4's encodes it with ``encode_messages``
(``verl/utils/tokenizer/deepseek.py``) and ``tokenizer.encode(text, add_special_tokens=False)``.
The expected prompts below are written out by hand from that format.
"""

from __future__ import annotations

import types

import pytest
from transformers import AutoTokenizer

from refppo.rollout import deepseek_v4
from refppo.rollout.deepseek_v4 import ASSISTANT, BOS, EOS, MAX_EFFORT, USER, encode_messages
from refppo.rollout.prompts import chat_encoding_for, tokenize_records
from refppo.settings.overrides import command_settings
from refppo.tasks.tokenizer import build_tokenizer

LATEST = "<｜latest_reminder｜>"


def test_a_system_and_user_prompt_opens_the_assistant_turn_with_thinking_closed_or_open():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    assert encode_messages(chat) == BOS + "Be brief." + USER + "1+1?" + ASSISTANT + "</think>"
    assert encode_messages(chat, {"enable_thinking": True}) == BOS + "Be brief." + USER + "1+1?" + ASSISTANT + "<think>"
    assert encode_messages(chat, {"thinking": True}).endswith(ASSISTANT + "<think>"), "verl reads either name"
    off = encode_messages(chat, {"enable_thinking": True, "reasoning_effort": "none"})
    assert off.endswith(ASSISTANT + "</think>"), "reasoning_effort=none turns thinking off"


def test_the_maximum_effort_preamble_follows_the_bos_in_thinking_mode_only():
    chat = [{"role": "user", "content": "q"}]
    for effort in ("max", "xhigh"):
        text = encode_messages(chat, {"enable_thinking": True, "reasoning_effort": effort})
        assert text == BOS + MAX_EFFORT + USER + "q" + ASSISTANT + "<think>"
    assert MAX_EFFORT not in encode_messages(chat, {"reasoning_effort": "max"})
    assert MAX_EFFORT not in encode_messages(chat, {"enable_thinking": True, "reasoning_effort": "high"})


def test_consecutive_user_and_tool_messages_share_one_user_turn():
    chat = [
        {"role": "user", "content": "a"},
        {"role": "tool", "content": "42"},
        {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "image"}, {"type": "text", "text": "c"}]},
    ]
    assert encode_messages(chat) == BOS + USER + "a\n\n<tool_result>42</tool_result>\n\nbc" + ASSISTANT + "</think>"


def test_an_earlier_assistant_turn_keeps_its_reasoning_only_when_not_dropped():
    chat = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
    ]
    thinking = {"enable_thinking": True}
    dropped = BOS + USER + "q1" + ASSISTANT + "</think>a1" + EOS + USER + "q2" + ASSISTANT + "<think>"
    assert encode_messages(chat, thinking) == dropped
    kept = BOS + USER + "q1" + ASSISTANT + "<think>r1</think>a1" + EOS + USER + "q2" + ASSISTANT + "<think>"
    assert encode_messages(chat, {**thinking, "drop_thinking": False}) == kept
    chat_mode = BOS + USER + "q1" + ASSISTANT + "</think>a1" + EOS + USER + "q2" + ASSISTANT + "</think>"
    assert encode_messages(chat, {"drop_thinking": False}) == chat_mode, "no reasoning outside thinking mode"


def test_an_assistant_turn_after_the_last_user_turn_keeps_its_reasoning():
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"}]
    text = encode_messages(chat, {"enable_thinking": True})
    assert text == BOS + USER + "q" + ASSISTANT + "<think>r</think>a" + EOS + ASSISTANT + "<think>"


def test_developer_and_latest_reminder_messages():
    chat = [{"role": "developer", "content": "d"}, {"role": "latest_reminder", "content": "now"}]
    assert encode_messages(chat) == BOS + USER + "d" + LATEST + "now" + ASSISTANT + "</think>"


def test_an_unknown_role_or_a_tool_calling_field_is_refused_by_message():
    with pytest.raises(ValueError, match=r"message 1: DeepSeek-V4's encoding has no role 'narrator'"):
        encode_messages([{"role": "user", "content": "q"}, {"role": "narrator", "content": "n"}])
    with pytest.raises(ValueError, match="messages must be a list of"):
        encode_messages("1+1?")
    with pytest.raises(ValueError, match="message 0 is not a"):
        encode_messages(["1+1?"])
    with pytest.raises(ValueError, match="message 0 has tool_calls: refppo encodes DeepSeek-V4 prompts without"):
        encode_messages([{"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}])


@pytest.fixture(scope="module")
def v4_tokenizer(tmp_path_factory):
    """The offline tasks' tokenizer with DeepSeek-V4's special tokens, saved under a DeepSeek-V4
    name (what ``auto`` reads)."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [BOS, EOS, USER, ASSISTANT]})
    folder = tmp_path_factory.mktemp("tok") / "DeepSeek-V4-Flash"
    tokenizer.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def _data(enable=True, family="deepseekv4", filter_overlong=False, kwargs=None):
    """The ``data.*`` settings chat_encoding_for and tokenize_records read."""
    return types.SimpleNamespace(
        continuous_token=types.SimpleNamespace(enable=enable, model_family=family),
        filter_overlong_prompts=filter_overlong,
        prompt_key="prompt",
        max_prompt_length=None,
        truncation="error",
        apply_chat_template_kwargs=kwargs or {},
    )


def test_only_the_deepseek_v4_family_changes_how_a_first_turn_is_rendered(v4_tokenizer):
    """verl's builders for every other family render a first turn with the chat template."""
    assert chat_encoding_for(_data(enable=False), v4_tokenizer) == "template"
    assert chat_encoding_for(_data(), v4_tokenizer) == "deepseek_v4"
    for family in ("default", "qwen3", "glm5", "gemma4", "gptoss", "minimaxm27"):
        assert chat_encoding_for(_data(family=family), v4_tokenizer) == "template", family


def test_auto_reads_the_model_name_as_verls_inference_does(v4_tokenizer):
    """``infer_continuous_token_model_family``: letters and digits of the name, GLM-5, GLM-4.7,
    Gemma 4 and gpt-oss tried before DeepSeek-V4 (deepseekv4, dsv4)."""
    names = {
        "deepseek-ai/DeepSeek-V4-Flash": "deepseek_v4",
        "/data/dsv4_mini": "deepseek_v4",
        "deepseek-ai/DeepSeek-V3": "template",
        "Qwen/Qwen3-8B": "template",
        "glm-5-distilled-dsv4": "template",
        "gpt_oss_on_deepseek_v4": "template",
    }
    for name, encoding in names.items():
        v4_tokenizer.name_or_path = name
        assert chat_encoding_for(_data(family="auto"), v4_tokenizer) == encoding, name


def test_deepseek_v4_needs_its_end_of_sentence_token_and_no_length_filter(v4_tokenizer):
    with pytest.raises(ValueError, match="the tokenizer has no DeepSeek-V4 token '<｜end▁of▁sentence｜>'"):
        chat_encoding_for(_data(), build_tokenizer())
    with pytest.raises(ValueError, match="filter_overlong_prompts=true: verl measures the prompts it filters with"):
        chat_encoding_for(_data(filter_overlong=True), v4_tokenizer)


def test_a_run_tokenizes_its_chats_with_the_encoding(v4_tokenizer):
    """The ids verl's builder gives: the encoded text without added special tokens; a text prompt
    is encoded as before."""
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "12+34="}]
    records = [{"prompt": chat}, {"prompt": "7+8="}]
    ids, mask = tokenize_records(v4_tokenizer, records, _data(kwargs={"enable_thinking": True}))
    expected = v4_tokenizer.encode(BOS + "s" + USER + "12+34=" + ASSISTANT + "<think>", add_special_tokens=False)
    assert ids[0][mask[0].bool()].tolist() == expected
    assert ids[1][mask[1].bool()].tolist() == v4_tokenizer("7+8=")["input_ids"]
    assert v4_tokenizer.convert_tokens_to_ids(deepseek_v4.EOS) in v4_tokenizer.get_vocab().values()


def test_the_settings_are_verls_and_read_only_when_enabled():
    config, _ = command_settings(
        "ppo",
        [
            "data.train_files=a.parquet",
            "data.continuous_token.enable=True",
            "data.continuous_token.model_family=deepseekv4",
        ],
    )
    assert (config.data.continuous_token.enable, config.data.continuous_token.model_family) == (True, "deepseekv4")
    with pytest.raises(ValueError, match="data.continuous_token.model_family"):
        command_settings("ppo", ["data.train_files=a.parquet", "data.continuous_token.model_family=deepseekv4"])
    with pytest.raises(ValueError, match="data.continuous_token.model_family"):
        command_settings(
            "ppo",
            [
                "data.train_files=a.parquet",
                "data.continuous_token.enable=true",
                "data.continuous_token.model_family=llama",
            ],
        )
