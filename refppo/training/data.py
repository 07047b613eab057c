"""Data: prompt records from files or the offline tasks, and the epoch sampler that serves PPO
prompts, SFT demonstrations and reward-model comparisons alike."""

from __future__ import annotations

import json
import os

import torch

from refppo.rollout.prompts import chat_encoding_for, encode_prompts, prompt_problem
from refppo.settings.config import Config
from refppo.tasks import arithmetic, preference
from refppo.tasks.rules import rule_problem, rule_reward


class EpochSampler:
    """Epochs over a list of records, each in a seeded random order (or in the list's order);
    state is (epoch, cursor). ``batch_epoch`` is the epoch the last batch started in (verl's
    ``training/epoch``).

    Serves PPO prompts, SFT examples and reward-model pairs alike.

    Args:
        records: the items (prompt dicts, (prompt, response) pairs, ...).
        batch_size: records per batch.
        seed: the order of epoch e is a permutation drawn from seed + e.
        shuffle: False: every epoch in the list's order (``data.shuffle=false``).
        drop_last: True: an epoch's last partial batch is left out and the next batch starts the
            next epoch, as verl's PPO data loader (``drop_last=True``); False: a batch runs on
            into the next epoch, so every record is served.
    """

    def __init__(self, records: list[dict], batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = False):
        if not records:
            raise ValueError("the dataset is empty")
        self.records = records
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.cursor = 0
        self.batch_epoch = 0

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.records)))
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.records), generator=gen).tolist()

    def next_batch(self) -> list[dict]:
        """The next ``batch_size`` records (at an epoch boundary: see ``drop_last``)."""
        if self.drop_last and self.cursor + self.batch_size > len(self.records):
            self.epoch += 1
            self.cursor = 0
        self.batch_epoch = self.epoch
        out = []
        while len(out) < self.batch_size:
            order = self._order()
            take = order[self.cursor : self.cursor + self.batch_size - len(out)]
            out += [self.records[i] for i in take]
            self.cursor += len(take)
            if self.cursor == len(order):
                self.epoch += 1
                self.cursor = 0
        return out

    def state_dict(self) -> dict:
        """Where the sampler stands: {"epoch": int, "cursor": int}."""
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict`."""
        self.epoch = state["epoch"]
        self.cursor = state["cursor"]


def read_records(path: str) -> list[tuple[str, dict]]:
    """Every record of a JSONL or Parquet file, each with where it is ("file.jsonl:3",
    "file.parquet: row 3") for errors. A missing file or a folder, bytes that are not UTF-8, a
    line that is not JSON (or gives a key twice) and a file without records are refused, naming the
    file and line; a Parquet list column arrives as a list (``.parquet`` in any case).

    Returns:
        (where, record) pairs in file order; a record may be any JSON value (the callers check).
    """
    if os.path.isdir(path):
        raise IsADirectoryError(f"dataset path {path!r} is a folder; give a .jsonl or .parquet file")
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset file {path!r} does not exist")
    if not os.path.isfile(path):  # a device, a pipe or a socket: nothing to read records from twice
        raise ValueError(f"dataset path {path!r} is not a regular file; give a .jsonl or .parquet file")
    if path.lower().endswith(".parquet"):
        located = [(f"{path}: row {n}", _plain(rec)) for n, rec in enumerate(_parquet_rows(path), 1)]
    else:
        located = []
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                    if line.strip():
                        located.append((f"{path}:{n}", json.loads(line, object_pairs_hook=_one_value_per_key)))
                except UnicodeDecodeError:
                    raise ValueError(f"{path}:{n} is not UTF-8 text") from None
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n} is not valid JSON ({e.msg})") from None
                except RecursionError:
                    raise ValueError(f"{path}:{n} is nested too deeply to read") from None
                except KeyError as e:
                    raise ValueError(f"{path}:{n} gives the key {e.args[0]!r} twice; keep one") from None
    if not located:
        raise ValueError(f"{path} holds no records")
    return located


def _one_value_per_key(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's pairs as a dict, or KeyError naming a key given twice (``json`` keeps the last
    one silently)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise KeyError(key)
        out[key] = value
    return out


def _parquet_rows(path: str) -> list[dict]:
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("reading Parquet needs pandas and pyarrow: pip install pandas pyarrow") from None
    try:
        table = pd.read_parquet(path)
    except (ValueError, OSError) as e:  # pyarrow's errors for a foreign or damaged file derive from these
        raise ValueError(f"{path} is not a readable Parquet file ({type(e).__name__}: {e})") from None
    return table.to_dict("records")


def _plain(value):
    """A Parquet cell as JSON would give it: numpy arrays (list columns) as lists, all the way down."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def load_records(
    path: str,
    prompt_key: str,
    tokenizer=None,
    max_prompt_length: int | None = None,
    drop_overlong: bool = False,
    chat_template_kwargs: dict | None = None,
    chat_encoding: str = "template",
) -> list[dict]:
    """Prompt records from a JSONL or Parquet file (:func:`read_records`); each needs a
    ``prompt_key`` that holds a text, or a chat (a list of ``{"role", "content"}`` messages, as in
    verl's datasets) that the trainer renders with the tokenizer's chat template
    (:func:`refppo.rollout.prompts.encode_prompts`).

    Every problem is found here, before any training, and named by file and line (row for
    Parquet): those of :func:`read_records`, a record without the prompt or with one that is
    neither a text nor a chat, and, given ``tokenizer``, a chat it has no template for or that its
    template refuses (a role it does not know) and, given ``max_prompt_length`` too, a prompt with
    more tokens than that (``data.truncation=error``), which ``drop_overlong`` drops instead
    (``data.filter_overlong_prompts``); chats are rendered with ``chat_template_kwargs``
    (``data.apply_chat_template_kwargs``) and ``chat_encoding``
    (:data:`refppo.rollout.prompts.CHAT_ENCODINGS`), as the trainer renders them.
    """
    located = read_records(path)
    for where, rec in located:
        if not isinstance(rec, dict) or prompt_key not in rec:
            raise ValueError(f"{where}: the record has no field {prompt_key!r} (data.prompt_key)")
        if (problem := prompt_problem(rec[prompt_key], tokenizer, chat_encoding)) is not None:
            raise ValueError(f"{where}: the record's {prompt_key!r} {problem} (data.prompt_key)")
    if tokenizer is not None:  # renders every chat, so a template's refusal is named here
        prompts, names = [rec[prompt_key] for _, rec in located], [where for where, _ in located]
        ids = encode_prompts(tokenizer, prompts, names, chat_template_kwargs, chat_encoding)
        kept = []
        for (where, rec), length in zip(located, map(len, ids)):
            if max_prompt_length is None or length <= max_prompt_length:
                kept.append((where, rec))
            elif not drop_overlong:
                raise ValueError(
                    f"{where}: the prompt has {length} tokens, more than data.max_prompt_length={max_prompt_length} "
                    "(raise it, or set data.truncation=left to cut it from the left as verl 0.9's rollout does, or "
                    "data.filter_overlong_prompts=true)"
                )
        if not kept:
            raise ValueError(f"{path}: every prompt has more than data.max_prompt_length={max_prompt_length} tokens")
        located = kept
    return [rec for _, rec in located]


def total_steps(config: Config, prompts: int) -> int:
    """A PPO run's step count over ``prompts`` training prompts: ``trainer.total_training_steps``,
    or fewer when ``trainer.total_epochs`` passes over them end sooner (whole batches, as verl's
    loader drops an epoch's last partial one); with ``total_training_steps`` null, the epochs'."""
    t = config.trainer
    if t.total_epochs is None:
        return t.total_training_steps
    epoch_steps = t.total_epochs * (prompts // config.data.train_batch_size)
    if t.total_training_steps is None:
        return epoch_steps
    return min(t.total_training_steps, epoch_steps)


def schedule_steps(config: Config, prompts: int) -> int:
    """The steps a learning-rate schedule spans: ``trainer.total_training_steps`` even when
    ``trainer.total_epochs`` ends the run sooner, or when it is null the run's steps, as verl's
    ``RayPPOTrainer._create_dataloader`` sets ``optim.total_training_steps`` (``prompts``: the
    training prompts)."""
    if config.trainer.total_training_steps is None:
        return total_steps(config, prompts)
    return config.trainer.total_training_steps


def task_data(config: Config, tokenizer=None) -> tuple[list[dict], list[dict], object]:
    """(train records, evaluation records, default reward function) of ``data.task``; with a
    ``tokenizer``, file prompts longer than ``data.max_prompt_length`` are refused at load time
    (unless ``data.truncation`` cuts them). The evaluation records are held out of training for
    arithmetic only: the preference task's 56 prompts all occur in training, and a file without
    ``data.val_files`` gives its first ``data.val_size`` training records. A file's reward is
    verl's rule for its records' ``data_source`` (:mod:`refppo.tasks.rules`), None when a record
    has none."""
    d = config.data
    if d.task == "arithmetic":
        train, held = arithmetic.make_problems(n_heldout=d.val_size)
        as_records = lambda ps: [{"prompt": p.prompt, "answer": p.answer} for p in ps]  # noqa: E731
        return as_records(train), as_records(held), arithmetic.exact_match_reward
    if d.task == "preference":
        return (
            preference.make_prompts(4000, seed=1),
            preference.make_prompts(d.val_size, seed=2),
            preference.gold_reward,
        )
    limit = d.max_prompt_length if d.truncation == "error" or d.filter_overlong_prompts else None
    encoding = "template" if tokenizer is None else chat_encoding_for(d, tokenizer)

    def load(paths: tuple[str, ...]) -> list[dict]:
        records = []
        for path in paths:
            records += load_records(
                path,
                d.prompt_key,
                tokenizer,
                max_prompt_length=limit,
                drop_overlong=d.filter_overlong_prompts,
                chat_template_kwargs=d.apply_chat_template_kwargs,
                chat_encoding=encoding,
            )
        return records

    train = load(d.train_files)
    val = load(d.val_files) if d.val_files else train[: d.val_size]
    ruled = all(rule_problem(record) is None for record in train + val)  # verl's rule by data_source
    return train, val, rule_reward if ruled else None


def sft_examples(config: Config) -> list[tuple[str, str]]:
    """(prompt, response) demonstrations of ``data.task`` for ``refppo sft``."""
    if config.data.task == "arithmetic":
        train, _ = arithmetic.make_problems(n_heldout=config.data.val_size)
        n = config.sft.n_examples
        if n is not None and n > len(train):
            raise ValueError(f"sft.n_examples={n} is more than the arithmetic task's {len(train)} training problems")
        teacher_seed = config.trainer.seed
        return arithmetic.make_demonstrations(
            train[: config.sft.n_examples], config.sft.teacher_carry_error, teacher_seed
        )
    if config.data.task == "preference":
        return preference.make_sft_examples(preference_sft_examples(config), seed=3)
    raise ValueError("refppo sft builds its data from data.task=arithmetic or preference")


def preference_sft_examples(config: Config) -> int:
    """How many demonstrations ``refppo sft`` draws for the preference task: ``sft.n_examples``, or 4,000."""
    return config.sft.n_examples or 4000
