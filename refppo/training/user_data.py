"""SFT demonstrations and reward-model comparisons from a user's JSONL or Parquet files, in the
layouts TRL, verl and OpenRLHF read: the first two stages of chapter 5's loop on your own data.

Demonstrations (``refppo sft``), one layout per record:

- a chat under ``data.messages_key`` (TRL's ``messages``; verl's multi-turn
  ``data.multiturn.messages_key``): every assistant turn is a demonstration whose prompt is the
  turns before it, so the loss covers the assistant turns only. The chat ends with one;
- a prompt and a response under ``data.prompt_key`` and ``data.response_key`` (TRL's
  ``prompt`` / ``completion``, verl's SFT keys): the prompt a text or a chat, the response a
  text or a chat of one assistant message (TRL's conversational layout).

Comparisons (``refppo rm``): ``data.chosen_key`` and ``data.rejected_key`` (OpenRLHF's
``--chosen_key`` / ``--rejected_key``), texts or chats, and an optional prompt under
``data.prompt_key`` (OpenRLHF's ``--input_key``):

- chats: the turns before the last are the prompt, which both must share, and the last turn, an
  assistant's, is the response (UltraFeedback-binarized); when each holds only the assistant's
  turn, the prompt is ``data.prompt_key``'s (TRL's explicit prompt);
- texts with a prompt: the prompt and the two responses as given (TRL's explicit prompt);
- texts without one: their longest shared beginning, cut back to its last whitespace, is the
  prompt and the rest the responses (Anthropic HH's whole conversations, as TRL reads them).

A prompt is encoded as PPO encodes it (:func:`refppo.rollout.prompts.encode_prompts`: a chat through the
tokenizer's chat template with the assistant's turn opened, a text with the tokenizer's special
tokens) and a response is its text's tokens and EOS. Every problem is refused before any
training, naming the file, the line (the row of a Parquet file) and the key.
"""

from __future__ import annotations

import torch

from refppo.rollout.prompts import encode_prompts, prompt_problem
from refppo.training.data import read_records

ASSISTANT = "assistant"  # the role whose turns are responses


def read_demonstrations(path: str, data, tokenizer) -> list[tuple]:
    """The (prompt, response, record) demonstrations of a file (see the module docstring).

    Args:
        path: a JSONL or Parquet file.
        data: the run's ``data.*`` settings (the keys, the two length limits,
            ``filter_overlong_prompts``).
        tokenizer: the model's tokenizer; chats need its chat template.

    Returns:
        (prompt, response, record) triples, the prompt a text or a chat, the response a text, the
        record the line it came from (for its ground truth).
    """
    kept = _read(path, data, tokenizer, _demonstrations_of)
    return [(prompt, responses[0], record) for _, prompt, responses, record in kept]


def read_comparisons(path: str, data, tokenizer) -> list[tuple]:
    """The (prompt, chosen, rejected) comparisons of a file (see the module docstring); the
    arguments as :func:`read_demonstrations` takes them.

    Returns:
        (prompt, chosen response, rejected response) triples, the prompt a text or a chat.
    """
    kept = _read(path, data, tokenizer, _comparison_of)
    return [(prompt, *responses) for _, prompt, responses, _ in kept]


def _read(path: str, data, tokenizer, items_of) -> list[tuple]:
    """The items of a file's records within the length limits (:func:`_within_limits`), each
    (where, prompt, responses, record); ``items_of(where, record, data, tokenizer)`` gives a
    record's (prompt, responses) items or refuses the record."""
    found = []
    for where, record in read_records(path):
        if not isinstance(record, dict):
            raise ValueError(f"{where}: the record is not a JSON object")
        found += [(where, prompt, responses, record) for prompt, responses in items_of(where, record, data, tokenizer)]
    return _within_limits(path, found, tokenizer, data)


def _demonstrations_of(where: str, record: dict, data, tokenizer) -> list[tuple]:
    """A record's demonstrations as (prompt, (response,)): each assistant turn of its chat, or its
    prompt and response."""
    if data.messages_key in record:
        return [(prompt, (response,)) for prompt, response in _chat_turns(where, record, data)]
    if data.prompt_key in record and data.response_key in record:
        prompt = _prompt(where, record, data.prompt_key, tokenizer)
        return [(prompt, (_response(where, record, data.response_key),))]
    raise ValueError(
        f"{where}: the record has neither {data.messages_key!r} (data.messages_key) nor {data.prompt_key!r} "
        f"and {data.response_key!r} (data.prompt_key, data.response_key)"
    )


def _comparison_of(where: str, record: dict, data, tokenizer) -> list[tuple]:
    """A record's comparison as [(prompt, (chosen, rejected))]."""
    for key in (data.chosen_key, data.rejected_key):
        if key not in record:
            raise ValueError(f"{where}: the record has no field {key!r} (data.chosen_key, data.rejected_key)")
    prompt, chosen, rejected = _pair(where, record, data, tokenizer)
    return [(prompt, (chosen, rejected))]


def held_out(items: list, fraction: float, seed: int) -> tuple[list, list]:
    """Split ``items`` into (training, held-out) at random (seeded), ``fraction`` of them held out:
    at least one when ``fraction`` > 0, and at least one left to train on."""
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    if fraction > 0 and len(items) < 2:
        raise ValueError(
            f"data.val_fraction={fraction} holds out one of {len(items)} item(s), which leaves none to train on: "
            "give more records, data.val_files, or data.val_fraction=0"
        )
    count = 0 if fraction == 0 else min(max(1, round(fraction * len(items))), len(items) - 1)
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(order[:count])
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]


def _chat_turns(where: str, record: dict, data) -> list[tuple[list[dict], str]]:
    """Each assistant turn of a record's chat with the turns before it: (prompt chat, response)."""
    chat = record[data.messages_key]
    if (problem := prompt_problem(chat)) is not None:
        raise ValueError(f"{where}: the record's {data.messages_key!r} {problem} (data.messages_key)")
    if chat[-1]["role"] != ASSISTANT:
        raise ValueError(
            f"{where}: the chat in {data.messages_key!r} ends with a {chat[-1]['role']!r} turn, not an assistant's: "
            "nothing to learn after it"
        )
    turns = []
    for i, message in enumerate(chat):
        if message["role"] != ASSISTANT:
            continue
        if i == 0:
            raise ValueError(f"{where}: the chat in {data.messages_key!r} opens with an assistant turn: no prompt")
        turns.append((chat[:i], _nonempty(where, message["content"], repr(data.messages_key))))
    return turns


def _prompt(where: str, record: dict, key: str, tokenizer):
    """A record's prompt under ``key``: a text or a chat the tokenizer can render."""
    prompt = record[key]
    if (problem := prompt_problem(prompt, tokenizer)) is not None:
        raise ValueError(f"{where}: the record's {key!r} {problem} (data.prompt_key)")
    if isinstance(prompt, str) and not prompt:
        raise ValueError(f"{where}: the record's {key!r} is empty (data.prompt_key)")
    return prompt


def _response(where: str, record: dict, key: str) -> str:
    """A record's response under ``key``: a text, or a chat of one assistant message."""
    value = record[key]
    if isinstance(value, str):
        return _nonempty(where, value, repr(key))
    if prompt_problem(value) is None and len(value) == 1 and value[0]["role"] == ASSISTANT:
        return _nonempty(where, value[0]["content"], repr(key))
    raise ValueError(f"{where}: the record's {key!r} is neither a text nor a chat of one assistant message")


def _nonempty(where: str, text: str, keys: str) -> str:
    """``text``, unless it is empty or blank (named by ``where`` and the ``keys`` it came from)."""
    if not text.strip():
        raise ValueError(f"{where}: an empty response in {keys}: nothing to learn")
    return text


def _pair(where: str, record: dict, data, tokenizer) -> tuple:
    """(prompt, chosen, rejected) of one comparison record, in whichever layout it has."""
    chosen = record[data.chosen_key]
    rejected = record[data.rejected_key]
    keys = f"{data.chosen_key!r} and {data.rejected_key!r}"
    if chosen == rejected:
        raise ValueError(f"{where}: {keys} are the same response: nothing to prefer")
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise ValueError(f"{where}: {keys} must both be texts or both chats")
    has_prompt = data.prompt_key in record
    if not isinstance(chosen, str):
        for key, chat in ((data.chosen_key, chosen), (data.rejected_key, rejected)):
            if (problem := prompt_problem(chat, tokenizer)) is not None:
                raise ValueError(f"{where}: the record's {key!r} {problem}")
            if chat[-1]["role"] != ASSISTANT:
                raise ValueError(
                    f"{where}: the chat in {key!r} ends with a {chat[-1]['role']!r} turn, not an assistant's"
                )
        if chosen[:-1] != rejected[:-1]:
            raise ValueError(f"{where}: {keys} have different prompts (the turns before the last)")
        prompt = chosen[:-1] or (_prompt(where, record, data.prompt_key, tokenizer) if has_prompt else None)
        if prompt is None:
            raise ValueError(f"{where}: {keys} hold only the assistant's turn, and there is no {data.prompt_key!r}")
        replies = (chosen[-1]["content"], rejected[-1]["content"])
    elif has_prompt:
        prompt = _prompt(where, record, data.prompt_key, tokenizer)
        replies = (chosen, rejected)
    else:
        prompt, replies = _shared_beginning(chosen, rejected)
        if not prompt.strip():
            raise ValueError(f"{where}: {keys} share no beginning to take as the prompt: add {data.prompt_key!r}")
    return (prompt, *(_nonempty(where, reply, keys) for reply in replies))


def _shared_beginning(a: str, b: str) -> tuple[str, tuple[str, str]]:
    """(prompt, (rest of a, rest of b)): the longest beginning a and b share, cut back to its last
    whitespace, which stays with the responses (as TRL's ``extract_prompt`` cuts HH's pairs)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    if n < min(len(a), len(b)) or len(a) != len(b):  # they part at n: back to a whitespace boundary
        while n > 0 and not a[n - 1].isspace():
            n -= 1
        while n > 0 and a[n - 1].isspace():
            n -= 1
    return a[:n], (a[n:], b[n:])


def _within_limits(path: str, found: list, tokenizer, data) -> list:
    """The items whose prompt fits ``data.max_prompt_length`` tokens and whose responses, with
    EOS, fit ``data.max_response_length``: the others are refused, naming the first, or dropped
    with ``data.filter_overlong_prompts``. Each item is (where, prompt, responses, record)."""
    prompts, names = [item[1] for item in found], [item[0] for item in found]
    prompt_lengths = map(len, encode_prompts(tokenizer, prompts, names, data.apply_chat_template_kwargs))
    kept = []
    for item, prompt_length in zip(found, prompt_lengths):
        where, _, responses, _ = item
        response_length = max(len(tokenizer(r, add_special_tokens=False)["input_ids"]) + 1 for r in responses)
        problem = None
        if prompt_length > data.max_prompt_length:
            problem = (
                f"the prompt has {prompt_length} tokens, more than data.max_prompt_length={data.max_prompt_length}"
            )
        elif response_length > data.max_response_length:
            problem = (
                f"a response has {response_length} tokens with EOS, more than "
                f"data.max_response_length={data.max_response_length}"
            )
        if problem is None:
            kept.append(item)
        elif not data.filter_overlong_prompts:
            raise ValueError(f"{where}: {problem} (raise it, or drop such records: data.filter_overlong_prompts=true)")
    if not kept:
        raise ValueError(f"{path}: every record is longer than data.max_prompt_length or data.max_response_length")
    return kept


def demonstrations(data, tokenizer, seed: int) -> tuple[list[tuple], list[tuple]]:
    """(training, held-out) demonstrations of ``data.train_files`` (:func:`read_demonstrations`):
    the held-out ones from ``data.val_files``, or ``data.val_fraction`` of the training records
    (chosen with ``seed``; the turns of one chat stay together)."""
    train = [item for path in data.train_files for item in read_demonstrations(path, data, tokenizer)]
    if data.val_files:
        return train, [item for path in data.val_files for item in read_demonstrations(path, data, tokenizer)]
    records = list({id(record): record for _, _, record in train}.values())  # each record once, in order
    _, held_records = held_out(records, data.val_fraction, seed)
    held_ids = {id(record) for record in held_records}
    return [x for x in train if id(x[2]) not in held_ids], [x for x in train if id(x[2]) in held_ids]


def comparisons(data, tokenizer, seed: int) -> tuple[list[tuple], list[tuple]]:
    """(training, held-out) comparisons of ``data.train_files`` (:func:`read_comparisons`): the
    held-out ones from ``data.val_files``, or ``data.val_fraction`` of them (chosen with ``seed``)."""
    train = [item for path in data.train_files for item in read_comparisons(path, data, tokenizer)]
    if data.val_files:
        return train, [item for path in data.val_files for item in read_comparisons(path, data, tokenizer)]
    return held_out(train, data.val_fraction, seed)
