"""Validation (verl's ``_validate``, ch 5): the held-out prompts scored three ways.

- ``val/<name>``: one greedy response per prompt (the SFT level, and what the book plots).
- ``val/<name>_sampled``: one response sampled at the rollout temperature (what training optimises).
- ``val-core/<data_source>/<variable>/<metric>`` and ``val-aux/...``: verl 0.9's metrics of the
  ``rollout.val_kwargs`` pass (the greedy one, or ``n`` samples per prompt), from
  :func:`validation_metrics`. The variables are ``reward`` (the score trained on) and the extra
  scores, a dict result's own ``score`` among them; a record without ``data_source`` counts under
  its task's name (``data.task``).

verl's best@k, worst@k and maj@k are bootstrap estimates; refppo draws the same bootstrap samples
(numpy's legacy generator, seed 42, the same calls) so its numbers equal verl's. It adds the
unbiased pass@k of Chen et al. (2021) for variables that are 0 or 1.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import numpy as np
import torch

from refppo import distributed
from refppo.rollout.prompts import decode_texts

N_BOOTSTRAP = 1000
CORE_PREFIXES = ("mean", "maj", "best")  # verl's _val_metrics_update; refppo's own pass@k is auxiliary


def subset_sizes(n: int) -> list[int]:
    """verl's bootstrap subset sizes for n responses: 2, 4, 8, ... below n, then n; none for n = 1."""
    return [] if n <= 1 else [2**i for i in range(1, math.ceil(math.log2(n)))] + [n]


def bootstrap_indices(n: int, size: int, seed: int = 42) -> np.ndarray:
    """(N_BOOTSTRAP, size) indices into n responses, drawn with replacement as verl draws them
    (``np.random.seed(seed)`` then ``np.random.choice``, here from a private generator)."""
    return np.random.RandomState(seed).choice(n, size=(N_BOOTSTRAP, size), replace=True)


def majority_value(values: list[float], answers: list[str]) -> float:
    """The value of the first response giving the most common answer (ties: the answer seen first),
    as verl's ``calc_maj_val``."""
    counts = Counter(answers)  # insertion-ordered: max() keeps the first answer of the top count
    top = max(counts, key=counts.get)
    return values[answers.index(top)]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n responses of which c pass: 1 - C(n - c, k) / C(n, k)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def prompt_metrics(values: list[float], answers: list[str] | None = None, binary: bool = False) -> dict[str, float]:
    """One variable's statistics over one prompt's n responses, as verl's ``process_validation_metrics``.

    Args:
        values: the n responses' values (n >= 1).
        answers: the n responses' answers, for maj@k (verl's ``pred``); None: no maj@k.
        binary: the values are 0 or 1, for pass@k.

    Returns:
        mean@n; with n > 1 also std@n (population), and for each k of :func:`subset_sizes`
        best@k and worst@k (each ``/mean`` and ``/std`` over the bootstrap samples), maj@k with
        answers; pass@1 and pass@k when binary.
    """
    n = len(values)
    v = np.asarray(values, dtype=np.float64)
    out = {f"mean@{n}": float(v.mean())}
    if n > 1:
        out[f"std@{n}"] = float(v.std())
    for k in subset_sizes(n):
        idx = bootstrap_indices(n, k)
        best = v[idx].max(axis=1)
        worst = v[idx].min(axis=1)
        out |= {f"best@{k}/mean": float(best.mean()), f"best@{k}/std": float(best.std())}
        out |= {f"worst@{k}/mean": float(worst.mean()), f"worst@{k}/std": float(worst.std())}
        if answers is not None:
            maj = np.array([majority_value(list(v[row]), [answers[i] for i in row]) for row in idx])
            out |= {f"maj@{k}/mean": float(maj.mean()), f"maj@{k}/std": float(maj.std())}
    if binary:
        for k in [1, *subset_sizes(n)]:
            out[f"pass@{k}"] = pass_at_k(n, int(v.sum()), k)
    return out


def validation_metrics(
    sources: list[str], prompt_ids: list, variables: dict[str, list[float]], answers: list[str] | None = None
) -> dict[str, float]:
    """verl's validation metrics (``process_validation_metrics`` then ``_val_metrics_update``).

    Each prompt's responses give :func:`prompt_metrics` per variable; a metric is then averaged
    over the prompts of its data source. It is ``val-core`` when its variable is the core one
    (``acc`` if present, else ``reward``), its name starts with mean, maj or best and it is at the
    largest k; ``val-aux`` otherwise (pass@k, which verl does not compute, included).

    Args:
        sources: (M,) each response's data source.
        prompt_ids: (M,) each response's prompt (verl's ``uid``): equal for the responses to one prompt.
        variables: name -> (M,) values (``reward`` and any extra scores).
        answers: (M,) each response's answer, for maj@k; None: no maj@k.

    Returns:
        ``{"val-core/<source>/<variable>/<metric>": value, "val-aux/...": ...}``.
    """
    rows = defaultdict(lambda: defaultdict(list))  # source -> prompt -> response rows
    for i, (source, prompt) in enumerate(zip(sources, prompt_ids, strict=True)):
        rows[source][prompt].append(i)
    out = {}
    for source, prompts in rows.items():
        core = "acc" if "acc" in variables else "reward"
        for name, values in variables.items():
            binary = all(values[i] in (0.0, 1.0) for group in prompts.values() for i in group)
            per_prompt = defaultdict(list)
            for group in prompts.values():
                group_answers = None if answers is None else [answers[i] for i in group]
                for metric, value in prompt_metrics([values[i] for i in group], group_answers, binary).items():
                    per_prompt[metric].append(value)
            n_max = max(int(metric.split("@")[-1].split("/")[0]) for metric in per_prompt)
            for metric, value in per_prompt.items():
                is_core = name == core and metric.startswith(CORE_PREFIXES) and f"@{n_max}" in metric
                out[f"{'val-core' if is_core else 'val-aux'}/{source}/{name}/{metric}"] = float(np.mean(value))
    return out


def chosen_generations(inputs: list[str], outputs: list[str], scores: list[float], count: int) -> list[dict]:
    """The ``count`` validation samples verl's ``_maybe_log_val_generations`` logs: sorted by input,
    shuffled by ``RandomState(42)``, the first ``count``; each ``{"input", "output", "score"}``."""
    samples = sorted(zip(inputs, outputs, scores, strict=True), key=lambda sample: sample[0])
    np.random.RandomState(42).shuffle(samples)
    return [{"input": i, "output": o, "score": s} for i, o, s in samples[:count]]


@torch.no_grad()
def held_out_metrics(trainer) -> tuple[dict[str, float], list[dict]]:
    """Validate a :class:`refppo.training.trainer.PPOTrainer` on its held-out prompts.

    Args:
        trainer: the trainer (its config, actor, held-out records, processes and ``answer_fn``,
            a response's answer for maj@k when not None).

    Returns:
        (metrics, generations): ``val/*`` and verl's ``val-core/*`` / ``val-aux/*`` metrics (see the
        module docstring); ``trainer.log_val_generations`` samples of the ``val_kwargs`` pass for
        ``val_generations.jsonl`` (none when it is 0).
    """
    c = trainer.config
    world = trainer.world
    answer_fn = trainer.answer_fn
    kw = c.rollout.val_kwargs
    keep = c.trainer.log_val_generations
    records, first, count = distributed.padded_share(trainer.val_records, world)
    out = {}
    # texts only where they are read: the val_kwargs pass, which is the greedy one at temperature 0, n = 1
    want_texts = answer_fn is not None or keep > 0
    greedy_is_val_kwargs = kw.temperature == 0 and kw.n == 1
    passes = {}
    for suffix, do_sample in (("", False), ("_sampled", True)):
        batch = trainer.generate(records, n=1, do_sample=do_sample, first_row=first, stream=1)
        passes[suffix] = _gathered(
            trainer, batch, records, count, want_texts and not do_sample and greedy_is_val_kwargs
        )
        lengths = batch["response_mask"].sum(-1).float()
        out[f"val/response_length{suffix}"] = float(distributed.gather_rows(lengths, world)[:count].mean())
        # val/score is the score trained on; a dict result's own "score" (before shaping) is not a second one
        named = passes[suffix][0]
        logged = {"score": named["reward"]} | {k: v for k, v in named.items() if k not in ("reward", "score")}
        out |= {f"val/{name}{suffix}": float(values.mean()) for name, values in logged.items()}
    n = kw.n
    values, texts, preds = passes[""]
    if not greedy_is_val_kwargs:
        if kw.temperature == 0:  # verl's engine decodes greedily at temperature 0: n equal responses
            batch = trainer.generate(records, n, do_sample=False, first_row=first * n, stream=2)
        else:
            batch = trainer.generate(records, n, do_sample=True, first_row=first * n, stream=2, sampling=kw)
        rows = [r for r in records for _ in range(n)]
        values, texts, preds = _gathered(trainer, batch, rows, count * n, want_texts)
    sources = [r.get("data_source", c.data.task) for r in trainer.val_records for _ in range(n)]
    prompt_ids = [i for i in range(count) for _ in range(n)]
    variables = {k: v.tolist() for k, v in values.items()}
    # maj@k votes on the task's answers, else on those the reward function parsed (verl's "pred")
    answers = preds if answer_fn is None else [answer_fn(text) for text in texts[1]]
    out |= validation_metrics(sources, prompt_ids, variables, answers)
    samples = chosen_generations(*texts, variables["reward"], keep) if keep > 0 else []
    return out, samples


def _gathered(trainer, batch: dict[str, torch.Tensor], rows: list[dict], count: int, texts: bool):
    """Of a validation batch, every process's rows, the first ``count``: the scores by name, each
    (count,), as verl's ``_validate`` names them (``reward``, the score trained on, then the extras,
    a dict result's own ``score`` among them); if ``texts``, the (prompts, responses) texts; the
    answers the reward function parsed (``"pred"``), or None."""
    world = trainer.world
    pad = trainer.tokenizer.pad_token_id
    scores, extras, answers = trainer.score_and_answers(batch, rows)
    named = {"reward": scores} | {k: v for k, v in extras.items() if k != "reward"}
    values = {k: distributed.gather_rows(v, world)[:count].cpu() for k, v in named.items()}
    if answers is not None:
        answers = distributed.gather_items(answers, world)[:count]
    if not texts:
        return values, None, answers
    tokens = {
        "prompts": distributed.gather_rows(batch["prompts"], world, pad, pad_left=True)[:count],
        "responses": distributed.gather_rows(batch["responses"], world, pad)[:count],
        "response_mask": distributed.gather_rows(batch["response_mask"], world)[:count],
    }
    return values, decode_texts(trainer.tokenizer, tokens), answers
