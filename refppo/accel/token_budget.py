"""Micro-batches of a token budget (``actor.use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu``,
likewise ``critic.*``): rows of similar length share a micro-batch, each cut to its own longest
prompt and response, so the same memory bound wastes less compute on padding. The numbers do
not change (the gradient is the whole mini-batch's either way). Figures: ``benchmarks/README.md``
(token-budget micro-batches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refppo.rollout.forward import ForwardPasses


def cut(batch: dict[str, torch.Tensor], prompt_keep: int, response_keep: int) -> dict[str, torch.Tensor]:
    """The batch with its prompts cut to their last ``prompt_keep`` columns and its responses to
    their first ``response_keep``: a model's outputs on the valid tokens do not change (padding is
    masked out of attention) when those columns are only padding, only their cost.

    Args:
        batch: a rollout batch (``prompts`` (B, P), the full-sequence tensors (B, P + R), per-token
            tensors (B, R), per-row tensors (B,)).
        prompt_keep, response_keep: the widths kept.

    Returns:
        The same keys, P and R cut.
    """
    width_p = batch["prompts"].shape[1]
    width_r = batch["responses"].shape[1]
    cut = width_p - prompt_keep
    keep = response_keep
    out = {}
    for key, value in batch.items():
        if key == "prompts":
            out[key] = value[:, cut:]
        elif value.dim() >= 2 and value.shape[1] == width_p + width_r:
            out[key] = value[:, cut : width_p + keep]
        elif value.dim() >= 2 and value.shape[1] == width_r:
            out[key] = value[:, :keep]
        else:
            out[key] = value
    return out


def token_budget_micro_batches(
    batch: dict[str, torch.Tensor], max_tokens: int
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Rows grouped into micro-batches of at most ``max_tokens`` tokens each, padding included,
    each trimmed of its all-padding columns (verl's ``use_dynamic_bsz`` with
    ``ppo_max_token_len_per_gpu``, for a model that runs on padded rectangles).

    Rows are taken longest first, and a micro-batch grows while rows x (longest prompt + longest
    response) stays within the budget, so rows of similar length share a micro-batch and little
    compute goes to padding: a budget bounds activation memory whatever the lengths.

    Args:
        batch: a rollout batch (see :func:`trim_padding`).
        max_tokens: the most (rows x width) tokens in one micro-batch.

    Returns:
        [(row indices (b,) int64, micro-batch dict)], every row in exactly one micro-batch.

    Raises:
        ValueError: a single row has more than ``max_tokens`` tokens.
    """
    width_p = batch["prompts"].shape[1]
    prompt_len = batch["attention_mask"][:, :width_p].sum(-1).tolist()
    response_len = batch["response_mask"].sum(-1).clamp(min=1).tolist()
    order = sorted(range(len(prompt_len)), key=lambda i: -(prompt_len[i] + response_len[i]))
    groups = [[]]  # each group's rows
    widths = [(0, 0)]  # each group's longest (prompt, response)
    for i in order:
        grown = (max(widths[-1][0], prompt_len[i]), max(widths[-1][1], response_len[i]))
        if groups[-1] and (len(groups[-1]) + 1) * sum(grown) > max_tokens:
            groups.append([])
            widths.append((0, 0))
            grown = (prompt_len[i], response_len[i])
        if sum(grown) > max_tokens:
            raise ValueError(f"row {i} has {sum(grown)} tokens, more than the micro-batch budget of {max_tokens}")
        groups[-1].append(i)
        widths[-1] = grown
    device = batch["response_mask"].device
    indices = [torch.tensor(sorted(g), dtype=torch.long, device=device) for g in groups]
    # The widths are known on the host already: cut without reading the masks again (no host sync).
    return [(idx, cut({k: v[idx] for k, v in batch.items()}, *width)) for idx, width in zip(indices, widths)]


@dataclass(frozen=True)
class TokenBudgetPasses(ForwardPasses):
    """:class:`refppo.rollout.forward.ForwardPasses` whose micro-batches hold at most ``max_tokens`` tokens
    (:func:`token_budget_micro_batches`) instead of a row count."""

    max_tokens: int = 16384

    def micro_batches(self, batch: dict[str, torch.Tensor], rows: int | None) -> list[tuple[torch.Tensor | None, dict]]:
        """[(row indices (b,), micro-batch dict)] of at most ``max_tokens`` tokens each; ``rows``
        must be None (a micro-batch is a row count or a token budget, not both)."""
        if rows is not None:
            raise ValueError(f"a micro-batch is {rows} rows or {self.max_tokens} tokens, not both")
        return token_budget_micro_batches(batch, self.max_tokens)
