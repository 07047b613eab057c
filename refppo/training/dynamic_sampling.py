"""DAPO's dynamic sampling (verl's ``algorithm.filter_groups``; Yu et al., 2025).

Under a group estimator (GRPO, RLOO, ...) a prompt whose responses all score alike gets zero
advantages: its group adds nothing to the gradient and only shrinks the batch. Dynamic sampling
drops such groups and generates for further prompts until the batch holds ``data.train_batch_size``
groups whose scores differ, within ``algorithm.filter_groups.max_num_gen_batches`` generation
batches. It follows the DAPO trainer verl's scripts run: a group of one response is kept, and the
surplus groups of the last generation batch are dropped.
"""

from __future__ import annotations

from operator import itemgetter

import numpy as np
import torch

from refppo.distributed import pad_width
from refppo.rollout.prompts import sequence_batch

SCORE, EXTRA = "_score", "_extra/"  # the scores travel in the batch while it is cut and joined


def varied_groups(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Which rows belong to a group (equal ``index``) whose values are not all alike: a population
    standard deviation above 0, computed in float64 as verl computes it with numpy, or a group of
    one.

    Args:
        values: (B,) each row's metric.
        index: (B,) each row's group.

    Returns:
        (B,) bool.
    """
    values, index = values.double().cpu().numpy(), index.cpu()
    keep = torch.zeros(len(index), dtype=torch.bool)
    for group in index.unique():
        rows = index == group
        keep[rows] = bool(rows.sum() == 1) or float(np.std(values[rows.numpy()])) > 0.0
    return keep


def join_batches(parts: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Rollout batches with the same keys as one: prompts left-padded to the widest, responses and
    the other per-token tensors right-padded (with pad ids and 0), the sequence tensors rebuilt.

    Args:
        parts: batches in the layout of :func:`refppo.rollout.generation.generate`, each (b_i, P_i) and (b_i, R_i).
        pad_token_id: the padding of narrower prompts and responses.

    Returns:
        (sum b_i, max P_i) and (sum b_i, max R_i) tensors, rows in the order of ``parts``.
    """
    width = max(p["prompts"].shape[1] for p in parts)
    length = max(p["responses"].shape[1] for p in parts)

    def joined(get, size, value, left=False):
        return torch.cat([pad_width(get(p), size, value, left) for p in parts])

    prompts = joined(lambda p: p["prompts"], width, pad_token_id, left=True)
    prompt_mask = joined(lambda p: p["attention_mask"][:, : p["prompts"].shape[1]], width, 0, left=True)
    responses = joined(lambda p: p["responses"], length, pad_token_id)
    whole = sequence_batch(prompts, prompt_mask, responses, joined(lambda p: p["response_mask"], length, 0))
    for key in parts[0]:
        if key not in whole:
            whole[key] = joined(itemgetter(key), length, 0)
    return whole


def fill_batch(trainer, records: list[dict], timing: dict):
    """Phase 1 and the scores with dynamic sampling: generate and score for ``records``, keep the
    groups whose scores differ, and repeat with the sampler's next records until
    ``len(records)`` groups are kept.

    Args:
        trainer: a :class:`refppo.training.trainer.PPOTrainer` on one process.
        records: the step's first prompt records (``data.train_batch_size`` of them).
        timing: its ``timing_s/gen`` and ``timing_s/reward`` sum over the generation batches.

    Returns:
        (batch, scores, extras, stats): as :meth:`~refppo.training.trainer.PPOTrainer.generate_and_score`,
        len(records) x rollout.n rows whose ``index`` numbers the kept groups 0, 1, ...; stats
        ``train/num_gen_batches`` and ``training/filter_groups/evicted_samples`` (groups dropped
        for scores alike, verl's name).

    Raises:
        RuntimeError: ``max_num_gen_batches`` batches did not give enough groups that differ.
    """
    c = trainer.config
    limit, n, want = c.algorithm.filter_groups.max_num_gen_batches, c.rollout.n, len(records)
    parts, kept, generated = [], 0, 0
    while kept < want:
        if generated == limit > 0:
            raise RuntimeError(
                f"algorithm.filter_groups: {generated} generation batches (max_num_gen_batches) gave {kept} of the "
                f"{want} prompts whose responses score differently; the prompts may be too easy or too hard for "
                "the policy: raise algorithm.filter_groups.max_num_gen_batches (0: no limit)"
            )
        records = records if generated == 0 else trainer.sampler.next_batch()
        batch, scores, extras = trainer.generate_and_score(records, timing, first_row=generated * want * n)
        batch["index"] += generated * want
        keep = varied_groups(scores, batch["index"])
        part = batch | {SCORE: scores} | {EXTRA + k: v for k, v in extras.items()}
        parts.append({k: v[keep.to(v.device)] for k, v in part.items()})
        kept, generated = kept + int(keep.sum()) // n, generated + 1
    whole = {k: v[: want * n] for k, v in join_batches(parts, trainer.tokenizer.pad_token_id).items()}
    whole["index"] = whole["index"].unique(return_inverse=True)[1]
    scores, extras = whole.pop(SCORE), {k[len(EXTRA) :]: whole.pop(k) for k in list(whole) if k.startswith(EXTRA)}
    stats = {"train/num_gen_batches": generated, "training/filter_groups/evicted_samples": generated * want - kept}
    return whole, scores, extras, stats
