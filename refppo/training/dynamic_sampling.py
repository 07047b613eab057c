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
from refppo.rollout.router_replay import UNRECORDED

SCORE = "_score"  # the scores travel in the batch while it is cut and joined
EXTRA = "_extra/"


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
    the other per-token tensors right-padded (with pad ids and 0), the sequence tensors rebuilt;
    R3's ``routed_experts`` (b_i, P_i + R_i, L, k) padded as the tokens they route are, with -1
    (nothing recorded: the pad positions route as the model does).

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
        if key not in whole and key != "routed_experts":
            whole[key] = joined(itemgetter(key), length, 0)
    if "routed_experts" in parts[0]:
        prompt_routes = joined(lambda p: p["routed_experts"][:, : p["prompts"].shape[1]], width, UNRECORDED, left=True)
        response_routes = joined(lambda p: p["routed_experts"][:, p["prompts"].shape[1] :], length, UNRECORDED)
        whole["routed_experts"] = torch.cat([prompt_routes, response_routes], dim=1)
    return whole


class DynamicSampling:
    """The groups a step keeps under dynamic sampling, over its generation batches: :meth:`add`
    keeps a batch's groups whose scores differ, until :attr:`full`; :meth:`result` joins them.

    Args:
        prompts: the groups the step needs (``data.train_batch_size``).
        n: responses per prompt (``rollout.n``).
        max_num_gen_batches: the most generation batches the step may take (0: no limit).
        pad_token_id: the padding of narrower prompts and responses when the batches are joined.
        metric: what a kept group's responses must differ in (``algorithm.filter_groups.metric``):
            ``seq_reward`` and ``seq_final_reward`` the score a response trains on (no KL in the
            reward here), ``acc`` or ``score`` the reward function's number of that name (verl's
            ``reward_extra_info``: ``acc`` is a plain score before DAPO's overlong penalty).
    """

    def __init__(self, prompts: int, n: int, max_num_gen_batches: int, pad_token_id: int, metric: str = "seq_reward"):
        self.prompts = prompts
        self.metric = metric
        self.n = n
        self.max_num_gen_batches = max_num_gen_batches
        self.pad_token_id = pad_token_id
        self.parts: list[dict[str, torch.Tensor]] = []
        self.kept = 0
        self.generated = 0

    @property
    def full(self) -> bool:
        """Whether ``prompts`` groups have been kept."""
        return self.kept >= self.prompts

    @property
    def first_row(self) -> int:
        """The next generation batch's first row among the step's draws."""
        return self.generated * self.prompts * self.n

    def add(self, batch: dict[str, torch.Tensor], scores: torch.Tensor, extras: dict[str, torch.Tensor]) -> None:
        """Keep the groups of one generation batch whose scores differ.

        Args:
            batch: ``prompts`` x ``n`` rows as :meth:`~refppo.training.trainer.PPOTrainer.generate_and_score`
                gives them, ``index`` numbering its groups from 0 (renumbered here after the
                earlier batches').
            scores: (prompts x n,); extras: name -> (prompts x n,) scores.

        Raises:
            RuntimeError: ``max_num_gen_batches`` batches did not give enough groups that differ, or
                the reward function gave no number named ``metric`` (verl's ``ReplayBuffer``
                raises there too).
        """
        batch["index"] += self.generated * self.prompts
        if self.metric in ("seq_reward", "seq_final_reward"):
            values = scores
        elif self.metric in extras:
            values = extras[self.metric]
        else:
            raise RuntimeError(
                f"algorithm.filter_groups.metric={self.metric}: the reward gives no {self.metric!r} (it gives "
                f"{sorted(extras)}; a plain score is acc, a dict result its keys, as in verl's reward_extra_info)"
            )
        keep = varied_groups(values, batch["index"])
        part = batch | {SCORE: scores} | {EXTRA + k: v for k, v in extras.items()}
        self.parts.append({k: v[keep.to(v.device)] for k, v in part.items()})
        self.kept += int(keep.sum()) // self.n
        self.generated += 1
        if not self.full and self.generated == self.max_num_gen_batches:
            raise RuntimeError(
                f"algorithm.filter_groups: {self.generated} generation batches (max_num_gen_batches) gave "
                f"{self.kept} of the {self.prompts} prompts whose responses score differently; the prompts may be "
                "too easy or too hard for the policy: raise algorithm.filter_groups.max_num_gen_batches (0: no limit)"
            )

    def result(self) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor], dict[str, int]]:
        """The first ``prompts`` kept groups as one batch (the surplus of the last generation batch
        dropped).

        Returns:
            (batch, scores, extras, stats): as :meth:`~refppo.training.trainer.PPOTrainer.generate_and_score`,
            ``prompts`` x ``n`` rows whose ``index`` numbers the kept groups 0, 1, ...; stats
            ``train/num_gen_batches`` and ``training/filter_groups/evicted_samples`` (groups dropped
            for scores alike, verl's name).
        """
        rows = self.prompts * self.n
        whole = {k: v[:rows] for k, v in join_batches(self.parts, self.pad_token_id).items()}
        whole["index"] = whole["index"].unique(return_inverse=True)[1]
        scores = whole.pop(SCORE)
        extras = {k[len(EXTRA) :]: whole.pop(k) for k in list(whole) if k.startswith(EXTRA)}
        evicted = self.generated * self.prompts - self.kept
        stats = {"train/num_gen_batches": self.generated, "training/filter_groups/evicted_samples": evicted}
        return whole, scores, extras, stats
