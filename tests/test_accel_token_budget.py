import pytest
import torch
from _inputs import ragged_batch

from refppo.accel.token_budget import TokenBudgetPasses, token_budget_micro_batches
from refppo.rollout.forward import compute_log_probs, compute_values


@pytest.mark.parametrize("budget", [30, 47, 64, 200, 10_000])
def test_token_budget_micro_batches_cover_every_row_within_the_budget(tok, budget):
    batch = ragged_batch(tok)
    width_p, width_r = batch["prompts"].shape[1], batch["responses"].shape[1]
    parts = token_budget_micro_batches(batch, budget)
    seen = torch.cat([idx for idx, _ in parts])
    assert sorted(seen.tolist()) == list(range(12)), "every row exactly once"
    for idx, mb in parts:
        rows, width = mb["input_ids"].shape
        assert rows * width <= budget
        p, r = mb["prompts"].shape[1], mb["responses"].shape[1]
        assert width == p + r and mb["response_mask"].shape[1] == r == mb["advantages"].shape[1]
        # the cut columns were padding in every row of the micro-batch, and nothing valid was cut
        full = {k: v[idx] for k, v in batch.items()}
        assert full["attention_mask"][:, : width_p - p].sum() == 0 and full["response_mask"][:, r:].sum() == 0
        assert torch.equal(mb["input_ids"], full["input_ids"][:, width_p - p : width_p + r])
        assert torch.equal(mb["advantages"], full["advantages"][:, :r]) and torch.equal(mb["index"], full["index"])
        assert mb["attention_mask"][:, 0].any() and mb["response_mask"][:, -1].any(), "no all-padding column is left"
    if budget == 10_000:
        assert len(parts) == 1 and parts[0][1]["input_ids"].shape[1] <= width_p + width_r
    if budget == 30:
        assert len(parts) > 3


def test_token_budget_errors(tok):
    batch = ragged_batch(tok)
    longest = int((batch["attention_mask"]).sum(-1).max())
    with pytest.raises(ValueError, match=f"has {longest} tokens, more than the micro-batch budget of {longest - 1}"):
        token_budget_micro_batches(batch, longest - 1)
    with pytest.raises(ValueError, match="a micro-batch is 4 rows or 64 tokens, not both"):
        TokenBudgetPasses(max_tokens=64).micro_batches(batch, 4)


def test_token_budget_passes_equal_the_whole_batch(tok, models):
    """Log-probs, entropies and values from token-budget micro-batches (rows regrouped, padding cut)
    equal one pass over the whole batch, in the batch's order and width."""
    actor, critic, _ = models
    batch = ragged_batch(tok)
    whole_lp, whole_ent = compute_log_probs(actor, batch, 0.7, calculate_entropy=True)
    budget = TokenBudgetPasses(max_tokens=40)
    lp, ent = budget.compute_log_probs(actor, batch, 0.7, calculate_entropy=True)
    assert lp.shape == whole_lp.shape and ent.shape == whole_ent.shape
    assert torch.allclose(lp, whole_lp, atol=1e-5) and torch.allclose(ent, whole_ent, atol=1e-5)
    assert (lp[batch["response_mask"] == 0] == 0).all()
    values = budget.compute_values(critic, batch)
    assert torch.allclose(values, compute_values(critic, batch), atol=1e-5)
    assert len(token_budget_micro_batches(batch, 40)) > 3, "a vacuous check: one micro-batch"
