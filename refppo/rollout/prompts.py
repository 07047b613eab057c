"""Prompts to token ids (ch 5): texts and chats encoded as verl's rollout does, left-padded, and
the batch layout every forward pass reads.

A batch is a dict of tensors (B = prompts x ``rollout.n``, P = prompt width, R = response width):

- ``prompts`` (B, P): left-padded prompt ids; ``responses`` (B, R): right-padded with pad;
- ``input_ids``, ``attention_mask``, ``position_ids`` (B, P + R): the full sequences;
- ``response_mask`` (B, R): 1 on every generated token up to and including the first EOS.

Generation adds ``rollout_log_probs`` (B, R), ``is_truncated`` (B,) and ``index`` (B,)
(:func:`refppo.rollout.generation.generate`). Position ``P - 1 + t`` of a sequence is the state before
response token ``t``: its logits predict token ``t`` and its value is ``values[:, t]``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

from refppo.guards.checks import check_choice
from refppo.rollout import deepseek_v4
from refppo.settings.config import TRUNCATION_MODES

# how a chat becomes text: the tokenizer's chat template, or DeepSeek-V4's own encoding
# (verl's continuous-token rollouts of that family: refppo.rollout.deepseek_v4)
CHAT_ENCODINGS = ("template", "deepseek_v4")
# families verl's "auto" tries before DeepSeek-V4, by a model name with all but letters and digits
# removed (infer_continuous_token_model_family): a name matching one of them is not DeepSeek-V4's
FAMILIES_BEFORE_DEEPSEEK_V4 = ("glm5", "glm47", "gemma4", "gptoss")


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token-id lists into a left-padded batch.

    Args:
        sequences: N lists of token ids, each non-empty.
        pad_token_id: the id written into padding.

    Returns:
        (input_ids (N, L) int64, attention_mask (N, L) int64), L the longest length.
    """
    if len(sequences) == 0:
        raise ValueError("no prompts: the prompt list is empty")
    for i, seq in enumerate(sequences):
        if len(seq) == 0:
            raise ValueError(f"sequence {i} has no tokens")
    width = max(len(s) for s in sequences)
    # One tensor from Python lists: a copy per row costs more than the tokens on a tiny model.
    ids = torch.tensor([[pad_token_id] * (width - len(s)) + list(s) for s in sequences], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], dtype=torch.long)
    return ids, mask


def prompt_problem(prompt, tokenizer=None, chat_encoding: str = "template") -> str | None:
    """Why ``prompt`` cannot be a prompt, or None. A prompt is a text, or a chat: a non-empty list
    of ``{"role": str, "content": str}`` messages (verl's data format), which needs a tokenizer
    with a chat template (checked when ``tokenizer`` is given) unless ``chat_encoding`` is
    DeepSeek-V4's own (:data:`CHAT_ENCODINGS`)."""
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, dict):
        return "is one message, not a chat: a chat is a list of messages"
    if (
        not isinstance(prompt, (list, tuple))
        or not prompt
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        )
    ):
        return 'is neither a text nor a chat (a non-empty list of {"role": ..., "content": ...} messages, strings)'
    if chat_encoding == "template" and tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        return "is a chat, but the tokenizer has no chat template to render it"
    return None


def encode_prompts(
    tokenizer,
    prompts: Sequence,
    names: Sequence[str] | None = None,
    chat_template_kwargs: Mapping | None = None,
    chat_encoding: str = "template",
) -> list[list[int]]:
    """The token ids of each prompt, as verl's rollout builds them.

    A text is encoded with the tokenizer's special tokens (a BOS where the tokenizer adds one). A
    chat is rendered by the tokenizer's chat template with the assistant's turn opened
    (``add_generation_prompt=True``), or by DeepSeek-V4's encoding
    (:func:`refppo.rollout.deepseek_v4.encode_messages`), then encoded without adding special
    tokens: the rendering writes its own, and adding them again would double the BOS of
    Llama-style tokenizers.

    Args:
        tokenizer: a Hugging Face tokenizer; chats need its ``chat_template``.
        prompts: N texts or chats (see :func:`prompt_problem`), in any mix.
        names: N names of the prompts for errors (e.g. "file.jsonl:3"); None: "prompt i".
        chat_template_kwargs: keyword arguments to the chat template (verl's
            ``data.apply_chat_template_kwargs``, e.g. ``{"enable_thinking": False}``).
        chat_encoding: one of :data:`CHAT_ENCODINGS` (:func:`chat_encoding_for` reads it from a run's
            settings).

    Returns:
        N lists of token ids.

    Raises:
        ValueError: naming the prompt: not a text or a chat, or a chat its template refuses.
    """
    check_choice("chat_encoding", chat_encoding, CHAT_ENCODINGS)
    names = names or [f"prompt {i}" for i in range(len(prompts))]
    for name, prompt in zip(names, prompts):
        if (problem := prompt_problem(prompt, tokenizer, chat_encoding)) is not None:
            raise ValueError(f"{name} {problem}")
    chats = [not isinstance(p, str) for p in prompts]
    kwargs = dict(chat_template_kwargs or {})
    texts = [
        _render_chat(tokenizer, prompt, name, kwargs, chat_encoding) if chat else prompt
        for prompt, chat, name in zip(prompts, chats, names)
    ]
    ids: list[list[int]] = [[] for _ in prompts]
    for chat in (False, True):  # one tokenizer call for the texts, one for the chats
        rows = [i for i, c in enumerate(chats) if c == chat]
        if rows:
            for i, seq in zip(rows, tokenizer([texts[i] for i in rows], add_special_tokens=not chat)["input_ids"]):
                ids[i] = seq
    return ids


def _render_chat(tokenizer, chat: Sequence[dict], name: str, kwargs: dict, chat_encoding: str) -> str:
    """A chat rendered by the tokenizer's template (or DeepSeek-V4's encoding) with the
    assistant's turn opened; a refusal (e.g. of a role it does not know) becomes a ValueError
    naming the prompt and its roles."""
    from jinja2 import TemplateError

    if chat_encoding == "deepseek_v4":
        try:
            return deepseek_v4.encode_messages(chat, kwargs)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
    try:
        return tokenizer.apply_chat_template(list(chat), add_generation_prompt=True, tokenize=False, **kwargs)
    except TemplateError as error:
        roles = ", ".join(dict.fromkeys(str(m.get("role")) for m in chat))
        raise ValueError(f"{name}: the tokenizer's chat template refuses this chat (roles: {roles}): {error}") from None


def truncated(seq: list[int], max_length: int, truncation: str) -> list[int]:
    """``seq`` cut to ``max_length`` tokens as verl's ``postprocess_data`` cuts a prompt: "left"
    keeps the last ``max_length``, "right" the first, "middle" the first ``max_length // 2`` and
    the rest from the end."""
    if truncation == "left":
        return seq[-max_length:]
    if truncation == "right":
        return seq[:max_length]
    left_half = max_length // 2
    return seq[:left_half] + seq[len(seq) - (max_length - left_half) :]


def tokenize_prompts(
    tokenizer,
    prompts: Sequence,
    max_prompt_length: int | None = None,
    truncation: str = "error",
    chat_template_kwargs: Mapping | None = None,
    chat_encoding: str = "template",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize prompts into a left-padded batch (texts with the tokenizer's special tokens, chats
    through its chat template or DeepSeek-V4's encoding: :func:`encode_prompts`).

    Args:
        tokenizer: a tokenizer prepared by ``refppo.rollout.models.prepare_tokenizer``.
        prompts: N texts or chats.
        max_prompt_length: longest allowed prompt in tokens; None for no limit.
        truncation: what a longer prompt gets, as verl's ``data.truncation`` means it
            (``postprocess_data`` in ``verl/utils/torch_functional.py``): "error"; "left" cuts
            tokens from the left (keeps the end, next to the response); "right" from the right
            (keeps the start); "middle" keeps the first half and the last half.
        chat_template_kwargs: keyword arguments to the chat template (:func:`encode_prompts`).
        chat_encoding: one of :data:`CHAT_ENCODINGS` (:func:`encode_prompts`).

    Returns:
        (input_ids (N, L) int64, attention_mask (N, L) int64).
    """
    check_choice("truncation", truncation, TRUNCATION_MODES)
    if isinstance(prompts, str):
        raise ValueError("prompts must be a list of texts, got one string")
    if len(prompts) == 0:
        raise ValueError("no prompts: the prompt list is empty")
    ids = encode_prompts(tokenizer, prompts, chat_template_kwargs=chat_template_kwargs, chat_encoding=chat_encoding)
    if max_prompt_length is not None:
        for i, seq in enumerate(ids):
            if len(seq) > max_prompt_length:
                if truncation == "error":
                    raise ValueError(
                        f"prompt {i} has {len(seq)} tokens, more than max_prompt_length={max_prompt_length} "
                        "(raise the limit or set truncation to 'left', 'right' or 'middle')"
                    )
                ids[i] = truncated(seq, max_prompt_length, truncation)
    return left_pad(ids, tokenizer.pad_token_id)


def tokenize_records(tokenizer, records: Sequence[dict], data) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tokenize_prompts` of the records' prompts (``data.prompt_key``) under ``data``'s
    ``max_prompt_length``, ``truncation``, ``apply_chat_template_kwargs`` and ``continuous_token``
    (a run's ``config.data``): (N, L) ids and mask."""
    prompts = [r[data.prompt_key] for r in records]
    return tokenize_prompts(
        tokenizer,
        prompts,
        max_prompt_length=data.max_prompt_length,
        truncation=data.truncation,
        chat_template_kwargs=data.apply_chat_template_kwargs,
        chat_encoding=chat_encoding_for(data, tokenizer),
    )


def chat_encoding_for(data, tokenizer) -> str:
    """How a run renders its chat prompts (:data:`CHAT_ENCODINGS`), from ``data.continuous_token``
    (a run's ``config.data``) as verl's single-turn rollout renders them: "deepseek_v4" for the
    ``deepseekv4`` family, or for "auto" when the tokenizer's name (refppo's ``model.path``) says
    DeepSeek-V4 as verl's ``infer_continuous_token_model_family`` reads it; "template" otherwise,
    since every other family's builder renders a first turn with the chat template.

    Raises:
        ValueError: DeepSeek-V4's encoding with a tokenizer that lacks its end-of-sentence token
            (verl's builder requires it), or with ``data.filter_overlong_prompts`` (verl measures
            those lengths with the chat template, not the encoding it trains on).
    """
    ct = data.continuous_token
    if not ct.enable:
        return "template"
    name = re.sub(r"[^a-z0-9]+", "", str(getattr(tokenizer, "name_or_path", "") or "").lower())
    named_v4 = ("deepseekv4" in name or "dsv4" in name) and not any(f in name for f in FAMILIES_BEFORE_DEEPSEEK_V4)
    if ct.model_family != "deepseekv4" and not (ct.model_family == "auto" and named_v4):
        return "template"
    family = f"data.continuous_token.model_family={ct.model_family}"
    if tokenizer.convert_tokens_to_ids(deepseek_v4.EOS) in (None, tokenizer.unk_token_id):  # not a token of its own
        raise ValueError(f"{family}: the tokenizer has no DeepSeek-V4 token {deepseek_v4.EOS!r}, which verl requires")
    if data.filter_overlong_prompts:
        raise ValueError(
            f"{family} with data.filter_overlong_prompts=true: verl measures the prompts it filters with the "
            "tokenizer's chat template, not the DeepSeek-V4 encoding it trains on (verl's deepseek.py says to "
            "leave filtering off); set data.filter_overlong_prompts=false"
        )
    return "deepseek_v4"


def decode_texts(tokenizer, batch: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """A batch's prompts and responses as texts without special tokens (padding, BOS, EOS): what a
    reward function reads.

    Args:
        tokenizer: the batch's tokenizer.
        batch: ``prompts`` (B, P), ``responses`` (B, R) and ``response_mask`` (B, R).

    Returns:
        (prompts, responses): B texts each.
    """
    responses = batch["responses"].masked_fill(batch["response_mask"] == 0, tokenizer.pad_token_id)
    return [tokenizer.batch_decode(ids, skip_special_tokens=True) for ids in (batch["prompts"], responses)]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only attended tokens, so left padding does not shift them.

    Args:
        attention_mask: (B, L) 0/1.

    Returns:
        (B, L) int64: 0 for the first real token of each row (and for the padding before it).
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def sequence_batch(prompts, prompt_mask, responses, response_mask) -> dict[str, torch.Tensor]:
    """The batch layout's sequence tensors.

    Args:
        prompts, prompt_mask: (B, P) left-padded prompt ids and their 0/1 mask.
        responses, response_mask: (B, R) right-padded response ids and their 0/1 mask.

    Returns:
        ``prompts``, ``responses``, ``input_ids``, ``attention_mask``, ``position_ids``,
        ``response_mask`` (see the module docstring).
    """
    full_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": full_mask,
        "position_ids": position_ids_from_mask(full_mask),
        "response_mask": response_mask,
    }


def build_batch(
    tokenizer,
    prompts: Sequence[str],
    responses: Sequence[str],
    add_eos: bool = True,
    chat_template_kwargs: Mapping | None = None,
) -> dict[str, torch.Tensor]:
    """A batch in the rollout layout from given texts (for SFT, reward-model pairs, tests).

    Args:
        tokenizer: a prepared tokenizer.
        prompts: N prompt texts (tokenized with the tokenizer's special tokens, left-padded).
        responses: N response texts (tokenized without special tokens, right-padded).
        add_eos: end each response with EOS, as a finished rollout does.
        chat_template_kwargs: keyword arguments to the chat template of chat prompts.

    Returns:
        dict with ``prompts``, ``responses``, ``input_ids``, ``attention_mask``,
        ``position_ids``, ``response_mask`` (see the module docstring).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, chat_template_kwargs=chat_template_kwargs)
    eos = [tokenizer.eos_token_id] if add_eos else []
    response_lists = [seq + eos for seq in tokenizer(list(responses), add_special_tokens=False)["input_ids"]]
    # Right padding is left padding of the reversed lists, reversed back.
    flipped, flipped_mask = left_pad([seq[::-1] for seq in response_lists], tokenizer.pad_token_id)
    return sequence_batch(prompt_ids, prompt_mask, flipped.flip(1), flipped_mask.flip(1))
