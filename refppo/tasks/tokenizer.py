"""A character-level Hugging Face tokenizer for the offline tasks (ch 5, 6).

One token per character keeps the vocabulary small enough to print, and makes every token
boundary obvious when a chapter shows a rollout. It is a real ``PreTrainedTokenizerFast``
(built with the ``tokenizers`` library), so the same code paths serve a real checkpoint's
tokenizer: distinct pad, bos and eos tokens, left padding for prompts, ``save_pretrained``.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
# Digits and operators for arithmetic, letters and punctuation for the preference task.
CHARS = "0123456789+-*=? abcdefghijklmnopqrstuvwxyz.,:!"
# A minimal chat template in that alphabet, for chats in a user's files (refppo sft, rm and ppo):
# each turn is "<the role's first letter>: <content> ", an assistant turn closed by EOS as the
# model's own answers are, and the assistant's turn opened as "a: ". [user "3+4="] renders as
# "<bos>u: 3+4= a: ", and the model answers "7<eos>".
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}a: {% endif %}"
)


def build_tokenizer(chars: str = CHARS) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: ids 0-3 are <pad>, <bos>, <eos>, <unk>, then one id per char.

    Encoding a text prepends <bos>; characters outside ``chars`` map to <unk>; decoding joins
    the characters back without separators. Prompts are padded on the left. Chats render with
    :data:`CHAT_TEMPLATE`.

    Args:
        chars: the characters of the vocabulary, each once.

    Returns:
        A tokenizer with ``len(tokenizer) == 4 + len(chars)``.
    """
    if len(set(chars)) != len(chars):
        raise ValueError(f"chars must not repeat a character, got {chars!r}")
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *chars))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")  # (?m): "." matches "\n" too
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )
