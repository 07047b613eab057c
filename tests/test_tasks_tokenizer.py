import pytest

from refppo.tasks.tokenizer import CHARS, SPECIAL_TOKENS, build_tokenizer


def test_vocabulary_and_special_ids():
    tok = build_tokenizer()
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHARS)
    ids = {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}
    assert len(ids) == 4  # all distinct; pad is never EOS
    assert tok.padding_side == "left"
    assert tok.convert_ids_to_tokens(list(range(4, len(tok)))) == list(CHARS)


def test_encode_decode_one_token_per_char():
    tok = build_tokenizer()
    text = "12+34=46? ok, yes!"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert len(ids) == 1 + len(text)
    assert ids[1:] == [4 + CHARS.index(c) for c in text]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids + [tok.eos_token_id]) == "<bos>" + text + "<eos>"
    assert tok("A#", add_special_tokens=False)["input_ids"] == [tok.unk_token_id] * 2


def test_left_padding_and_save_load(tmp_path):
    tok = build_tokenizer()
    enc = tok(["1+1=", "12+30="], padding=True)
    assert enc["input_ids"][0][:2] == [tok.pad_token_id] * 2
    assert enc["attention_mask"][0] == [0, 0, 1, 1, 1, 1, 1]
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    back = AutoTokenizer.from_pretrained(tmp_path)
    assert back("7*8=56")["input_ids"] == tok("7*8=56")["input_ids"]
    assert (back.pad_token_id, back.eos_token_id, back.padding_side) == (tok.pad_token_id, tok.eos_token_id, "left")


def test_small_custom_alphabet_and_bad_alphabet():
    tok = build_tokenizer("ab")
    assert len(tok) == 6
    assert tok.decode(tok("abba")["input_ids"], skip_special_tokens=True) == "abba"
    with pytest.raises(ValueError, match="must not repeat"):
        build_tokenizer("aba")
