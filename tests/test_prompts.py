import pytest
import torch
from _inputs import CHAT_TEMPLATES, chat_tokenizer, templateless_tokenizer

from refppo.rollout.prompts import (
    decode_texts,
    encode_prompts,
    left_pad,
    position_ids_from_mask,
    sequence_batch,
    tokenize_prompts,
    tokenize_records,
)
from refppo.settings.config import Config, apply_overrides
from refppo.settings.overrides import command_settings


def test_prompt_length_limit(tok):
    with pytest.raises(ValueError, match="prompt 1 has 7 tokens, more than max_prompt_length=5"):
        tokenize_prompts(tok, ["1+1=", "12+34="], max_prompt_length=5)
    # verl's postprocess_data (verl/utils/torch_functional.py): "left" cuts from the left, keeping
    # input_ids[:, -max_length:]; "right" keeps [:, :max_length]; "middle" the halves around the cut
    ids, mask = tokenize_prompts(tok, ["1+1=", "12+34="], max_prompt_length=5, truncation="left")
    assert tok.decode(ids[1]) == "2+34="
    ids, _ = tokenize_prompts(tok, ["12+34="], max_prompt_length=5, truncation="right")
    assert tok.decode(ids[0]) == "<bos>12+3"
    ids, _ = tokenize_prompts(tok, ["12+34="], max_prompt_length=5, truncation="middle")
    assert tok.decode(ids[0]) == "<bos>134="
    with pytest.raises(ValueError, match="unknown truncation 'centre'"):
        tokenize_prompts(tok, ["1"], max_prompt_length=5, truncation="centre")


def test_records_are_tokenized_under_the_data_settings_and_decoded_back(tok):
    data = apply_overrides(Config(), ["data.prompt_key=question", "data.max_prompt_length=5"]).data
    records = [{"question": "1+1="}, {"question": "12+34="}]
    with pytest.raises(ValueError, match="prompt 1 has 7 tokens"):
        tokenize_records(tok, records, data)
    data.truncation = "left"  # the end of the prompt, next to the response
    ids, mask = tokenize_records(tok, records, data)
    assert torch.equal(ids, tokenize_prompts(tok, ["1+1=", "12+34="], 5, "left")[0])
    # responses "2<eos><pad>" and "46<eos>": the texts leave out BOS, EOS and padding
    responses = torch.tensor([[tok.convert_tokens_to_ids("2"), tok.eos_token_id, tok.pad_token_id], [0, 0, 0]])
    responses[1] = torch.tensor(tok.convert_tokens_to_ids(["4", "6"]) + [tok.eos_token_id])
    batch = sequence_batch(ids, mask, responses, torch.tensor([[1, 1, 0], [1, 1, 1]]))
    assert decode_texts(tok, batch) == [["1+1=", "2+34="], ["2", "46"]]


@pytest.mark.parametrize("template", CHAT_TEMPLATES)
def test_chat_prompts_are_encoded_as_verl_encodes_them(template):
    """A chat (verl's data format) goes through the chat template with the assistant's turn
    opened and gets no second BOS; a text keeps the tokenizer's own. Expected ids written out
    character by character, and equal to transformers' apply_chat_template(tokenize=True), which
    verl's rollout calls."""
    chat_tok = chat_tokenizer(template)
    vocab = chat_tok.get_vocab()
    chats = [
        [{"role": "user", "content": "abc"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "d"}],
    ]
    prompts = ["1+1=", chats[0], "7*8=", chats[1]]
    ids = encode_prompts(chat_tok, prompts)
    head = [vocab["<bos>"]] if template == "bos" else []
    chat_texts = ["user: abc.assistant:", "system: be brief.user: d.assistant:"]
    expected = [[vocab["<bos>"]] + [vocab[c] for c in text] for text in ("1+1=", "7*8=")]
    expected_chats = [head + [vocab[c] for c in text] for text in chat_texts]
    assert ids == [expected[0], expected_chats[0], expected[1], expected_chats[1]]
    for chat, seq in zip(chats, expected_chats):
        assert chat_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"] == seq
    batch_ids, mask = tokenize_prompts(chat_tok, prompts)
    assert [row[m.bool()].tolist() for row, m in zip(batch_ids, mask)] == ids
    with pytest.raises(ValueError, match="prompt 1 has 2[0-9] tokens, more than max_prompt_length=16"):
        tokenize_prompts(chat_tok, prompts, max_prompt_length=16)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([{"role": "user", "content": "abc"}], "prompt 1 is a chat, but the tokenizer has no chat template"),
        ({"role": "user", "content": "abc"}, "prompt 1 is one message, not a chat"),
        ([], "prompt 1 is neither a text nor a chat"),
        ([{"role": "user"}], "prompt 1 is neither a text nor a chat"),
        ([{"role": "user", "content": ["abc"]}], "prompt 1 is neither a text nor a chat"),
        (7, "prompt 1 is neither a text nor a chat"),
    ],
)
def test_prompts_that_are_neither_texts_nor_renderable_chats_are_refused(prompt, message):
    with pytest.raises(ValueError, match=message):
        tokenize_prompts(templateless_tokenizer(), ["1+1=", prompt])


def test_position_ids_count_only_attended_tokens():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]]


def test_bad_prompts(tok):
    with pytest.raises(ValueError, match="the prompt list is empty"):
        tokenize_prompts(tok, [])
    with pytest.raises(ValueError, match="one string"):
        tokenize_prompts(tok, "1+1=")
    with pytest.raises(ValueError, match="sequence 0 has no tokens"):
        left_pad([[]], tok.pad_token_id)


def test_chat_template_keywords_change_the_prompt_tokens():
    """data.apply_chat_template_kwargs reaches the template (verl's enable_thinking): the tokens
    differ with the keyword, and a template without it renders as before."""
    chat_tok, tok = chat_tokenizer(), chat_tokenizer()
    tok.chat_template = "{% if enable_thinking %}<think>{% endif %}" + chat_tok.chat_template
    chat = [{"role": "user", "content": "1+1="}]
    plain = encode_prompts(tok, [chat])[0]
    thinking = encode_prompts(tok, [chat], chat_template_kwargs={"enable_thinking": True})[0]
    assert thinking[-len(plain) :] == plain and len(thinking) > len(plain)
    assert encode_prompts(tok, [chat], chat_template_kwargs={"enable_thinking": False})[0] == plain
    ids, _ = tokenize_prompts(tok, [chat], chat_template_kwargs={"enable_thinking": True})
    assert ids[0].tolist() == thinking
    assert encode_prompts(chat_tok, [chat], chat_template_kwargs={"enable_thinking": True})[0] == plain


def test_chat_template_keywords_are_read_from_a_verl_line():
    config, _ = command_settings(
        "ppo",
        ["data.train_files=x.jsonl", "+data.apply_chat_template_kwargs.enable_thinking=False"]
        + ["+data.apply_chat_template_kwargs.reasoning_effort=medium"],
    )
    assert config.data.apply_chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "medium"}
    for bad, message in (
        ("data.apply_chat_template_kwargs={enable_thinking: false}", "give each keyword"),
        ("+data.apply_chat_template_kwargs.tokenize=true", "apply_chat_template's own argument"),
    ):
        with pytest.raises(ValueError, match=message):
            command_settings("ppo", ["data.train_files=x.jsonl", bad])
    with pytest.raises(ValueError, match="read only with data.task=file"):
        command_settings("ppo", ["data.apply_chat_template_kwargs.enable_thinking=true"])
