"""The forward passes of a PPO step (ch 5): the responses' log-probs (actor, reference), values
(critic) and scores (reward model), one micro-batch at a time.

A batch has the layout of :mod:`refppo.rollout.prompts`; position ``P - 1 + t`` of a sequence predicts
response token ``t``, so a pass reads the ``R`` positions ``P - 1 .. P + R - 2``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from refppo.functional import (
    calculate_sum_pi_squared_from_logits,
    entropy_from_logits,
    last_valid_index,
    logprobs_from_logits,
)
from refppo.guards.checks import checks_once
from refppo.rollout.device import trainable_forward


def micro_batches(batch: dict[str, torch.Tensor], micro_batch_size: int | None) -> list[dict[str, torch.Tensor]]:
    """Consecutive row slices of a batch dict (every tensor sliced on dim 0).

    Args:
        batch: dict of tensors with a common first dimension B.
        micro_batch_size: rows per slice; None for the whole batch in one.

    Returns:
        dicts of the same keys with at most ``micro_batch_size`` rows each.
    """
    rows = next(iter(batch.values())).shape[0]
    size = rows if micro_batch_size is None else micro_batch_size
    if size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [{k: v[start : start + size] for k, v in batch.items()} for start in range(0, rows, size)]


def model_inputs(model, batch: dict[str, torch.Tensor]) -> dict:
    """The keyword inputs of a full-sequence forward pass of ``model`` over ``batch``, on its device."""
    device = model.device
    return dict(
        input_ids=batch["input_ids"].to(device),
        attention_mask=batch["attention_mask"].to(device),
        position_ids=batch["position_ids"].to(device),
        use_cache=False,
    )


def _forward(model, batch: dict[str, torch.Tensor], **kwargs):
    with trainable_forward(model.device):
        return model(**model_inputs(model, batch), **kwargs)


def response_logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One forward pass of a causal LM: the logits at the R positions that predict the response.

    Args:
        model: a causal LM.
        batch: needs ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask``.

    Returns:
        (B, R, vocab) logits (bf16 under CUDA's autocast), with gradients.
    """
    length = batch["input_ids"].shape[1]
    width = batch["response_mask"].shape[1]
    # The positions as an index tensor, not a count: the head then reads a contiguous copy of
    # them, not a strided slice, whose matrix-product path torch picks by the weight's
    # requires_grad; some BLAS kernels round the two paths differently, and a trainable actor
    # and its frozen reference would then differ at step 0.
    keep = torch.arange(length - width - 1, length - 1, device=model.device)
    return _forward(model, batch, logits_to_keep=keep).logits


@checks_once  # per micro-batch: the trainer's batch holds the model's own token ids
def response_log_probs(
    model, batch: dict[str, torch.Tensor], temperature: float = 1.0, calculate_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward pass: log-probs (and entropies) of the response tokens, with gradients.

    Args:
        model: a causal LM.
        batch: needs ``input_ids``, ``attention_mask``, ``position_ids``, ``responses``,
            ``response_mask``.
        temperature: the rollout's temperature.
        calculate_entropy: also return the entropy of each next-token distribution.

    Returns:
        (log_probs (B, R) float32, entropy (B, R) float32 or None), 0 at padding.
    """
    mask = batch["response_mask"].to(model.device).bool()
    logits = response_logits(model, batch)
    log_probs = logprobs_from_logits(logits, batch["responses"].to(model.device), temperature).masked_fill(~mask, 0.0)
    if not calculate_entropy:
        return log_probs, None
    return log_probs, entropy_from_logits(logits, temperature).masked_fill(~mask, 0.0)


def response_sum_pi_squared(model, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """One forward pass: sum_v pi_v^2 of each response token's next-token distribution at
    ``temperature`` (verl 0.9's ``sum_pi_squared``, which the optimal token baseline reads).

    Args:
        model: a causal LM.
        batch: needs ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask``.
        temperature: the rollout's temperature.

    Returns:
        (B, R) float32, 0 at padding.
    """
    mask = batch["response_mask"].to(model.device).bool()
    logits = response_logits(model, batch)
    return calculate_sum_pi_squared_from_logits(logits, temperature).float().masked_fill(~mask, 0.0)


def response_values(critic, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One forward pass of a scalar-head model: the value of the state before each response token.

    Args:
        critic: a model from ``refppo.rollout.models.load_value_model``.
        batch: needs ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask``.

    Returns:
        (B, R) float32 values, 0 at padding, with gradients.
    """
    mask = batch["response_mask"].to(critic.device).bool()
    width = mask.shape[1]
    values = _forward(critic, batch).logits[:, -width - 1 : -1, 0].float()
    return values.masked_fill(~mask, 0.0)


@checks_once  # per micro-batch: the trainer's batch holds the model's own masks
def response_scores(reward_model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One forward pass of a scalar-head model: the score at each row's last valid response token.

    Args:
        reward_model: a scalar-head model.
        batch: needs ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask``;
            every row needs a valid response token.

    Returns:
        (B,) float32 scores, with gradients.
    """
    mask = batch["response_mask"].to(reward_model.device)
    if bool((mask.sum(dim=-1) == 0).any()):
        raise ValueError("a response has no valid token: the reward model has nothing to score")
    out = _forward(reward_model, batch).logits[:, -mask.shape[1] :, 0].float()
    return out.gather(1, last_valid_index(mask)[:, None]).squeeze(1)


# (model, micro-batch, temperature, calculate_entropy) -> (log_probs (b, R), entropy (b, R) or None)
LogProbsFn = Callable[..., tuple]


@dataclass(frozen=True)
class ForwardPasses:
    """A whole batch's passes, micro-batch by micro-batch, without gradients: the old-log-prob,
    reference and value passes of a step.

    These are the plain ones. :func:`refppo.accel.select` builds one whose ``log_probs`` (one
    micro-batch's, as :func:`response_log_probs`) or ``micro_batches`` are faster or leaner, for
    the same numbers. ``sum_pi_squared`` is one micro-batch's :func:`response_sum_pi_squared`.
    """

    log_probs: LogProbsFn = response_log_probs
    sum_pi_squared: Callable[..., torch.Tensor] = response_sum_pi_squared

    def micro_batches(self, batch: dict[str, torch.Tensor], rows: int | None) -> list[tuple[torch.Tensor | None, dict]]:
        """The batch in micro-batches of ``rows`` rows (None: one).

        Returns:
            [(row indices (b,), or None for the next consecutive rows, micro-batch dict)].
        """
        return [(None, mb) for mb in micro_batches(batch, rows)]

    def per_row(self, fn, batch: dict[str, torch.Tensor], rows: int | None) -> list[torch.Tensor]:
        """``fn(micro_batch) -> [(b,) or (b, r) tensors]`` over :meth:`micro_batches`, put back in
        the batch's row order and response width (zeros in columns a micro-batch was cut from)."""
        count, width = batch["response_mask"].shape
        outs = None
        start = 0
        for idx, mb in self.micro_batches(batch, rows):
            results = fn(mb)
            if outs is None:
                outs = [r.new_zeros((count, width) if r.dim() == 2 else (count,)) for r in results]
            where = slice(start, start + len(results[0])) if idx is None else idx
            start += len(results[0])
            for out, r in zip(outs, results):
                if r.dim() == 2:
                    out[where, : r.shape[1]] = r
                else:
                    out[where] = r
        return outs

    @torch.no_grad()
    def compute_log_probs(
        self,
        model,
        batch: dict[str, torch.Tensor],
        temperature: float = 1.0,
        micro_batch_size: int | None = None,
        calculate_entropy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Old or reference log-probs of the responses, without gradients.

        Args:
            model: the actor (old log-probs) or the reference.
            batch: a rollout batch.
            temperature: the rollout's temperature.
            micro_batch_size: rows per forward pass (bounds activation memory); None for all.
            calculate_entropy: also return entropies.

        Returns:
            (B, R) float32 log-probs, 0 at padding; with ``calculate_entropy`` a (log_probs,
            entropy) pair.
        """

        def fn(mb):
            return [t for t in self.log_probs(model, mb, temperature, calculate_entropy) if t is not None]

        parts = self.per_row(fn, batch, micro_batch_size)
        return tuple(parts) if calculate_entropy else parts[0]

    @torch.no_grad()
    def compute_sum_pi_squared(
        self, model, batch: dict[str, torch.Tensor], temperature: float = 1.0, micro_batch_size: int | None = None
    ) -> torch.Tensor:
        """The actor's sum_v pi_v^2 at each response token (:func:`response_sum_pi_squared`),
        without gradients; (B, R) float32, 0 at padding."""
        return self.per_row(lambda mb: [self.sum_pi_squared(model, mb, temperature)], batch, micro_batch_size)[0]

    @torch.no_grad()
    def compute_values(
        self, critic, batch: dict[str, torch.Tensor], micro_batch_size: int | None = None
    ) -> torch.Tensor:
        """The critic's values of a rollout, without gradients.

        Args:
            critic: a scalar-head model.
            batch: a rollout batch.
            micro_batch_size: rows per forward pass; None for all.

        Returns:
            (B, R) float32 values, ``values[:, t]`` = V(state before response token t), 0 at padding.
        """
        return self.per_row(lambda mb: [response_values(critic, mb)], batch, micro_batch_size)[0]


PLAIN = ForwardPasses()
compute_log_probs = PLAIN.compute_log_probs
compute_values = PLAIN.compute_values


@torch.no_grad()
def compute_scores(reward_model, batch: dict[str, torch.Tensor], micro_batch_size: int | None = None) -> torch.Tensor:
    """Reward-model scores, read at each sequence's last valid response token (its EOS if any).

    Args:
        reward_model: a scalar-head model.
        batch: a rollout batch; every row needs a valid response token.
        micro_batch_size: rows per forward pass; None for all.

    Returns:
        (B,) float32 scores.
    """
    return torch.cat([response_scores(reward_model, mb) for mb in micro_batches(batch, micro_batch_size)])
