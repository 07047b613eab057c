"""SFT and reward-model training (refppo.training.sft, refppo.training.reward_model)."""

import math

import pytest
import torch

from refppo.rollout.forward import compute_scores
from refppo.rollout.models import load_causal_lm, load_value_model, tiny_config
from refppo.rollout.prompts import build_batch
from refppo.tasks import preference
from refppo.tasks.tokenizer import build_tokenizer
from refppo.training.reward_model import bradley_terry_loss, center_reward_model, train_reward_model
from refppo.training.sft import sft_loss, train_sft

TOK = build_tokenizer()


def _config():
    return tiny_config(TOK, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


def test_build_batch_layout():
    batch = build_batch(TOK, ["1+1=", "12+30="], ["2", "42"])
    assert batch["responses"].tolist() == [
        [TOK.convert_tokens_to_ids("2"), TOK.eos_token_id, TOK.pad_token_id],
        TOK.convert_tokens_to_ids(["4", "2"]) + [TOK.eos_token_id],
    ]
    assert batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 1, 0]


def test_sft_loss_is_the_mean_response_nll():
    torch.manual_seed(0)
    model = load_causal_lm(_config())
    prompts, responses = ["1+1=", "12+30="], ["2", "42"]
    loss = sft_loss(model, build_batch(TOK, prompts, responses))
    total, count = 0.0, 0
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            ids = TOK(p)["input_ids"] + TOK(r, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
            n_prompt = len(TOK(p)["input_ids"])
            logp = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
            for t in range(n_prompt, len(ids)):  # response tokens and EOS, never prompt tokens
                total -= logp[t - 1, ids[t]].item()
                count += 1
    assert math.isclose(loss.item(), total / count, rel_tol=1e-5)


def test_train_sft_learns_the_examples():
    torch.manual_seed(0)
    model = load_causal_lm(_config())
    examples = [(f"{a}+1=", str(a + 1)) for a in range(10)]
    history = train_sft(model, TOK, examples, steps=60, batch_size=10, lr=1e-2)
    assert history[-1]["sft/loss"] < 0.2 * history[0]["sft/loss"]
    assert not model.training


def test_bradley_terry_loss_against_a_plain_reference():
    gen = torch.Generator().manual_seed(0)
    chosen, rejected = (
        torch.randn(50, generator=gen, dtype=torch.float64),
        torch.randn(50, generator=gen, dtype=torch.float64),
    )
    loss, acc = bradley_terry_loss(chosen, rejected)
    ref = sum(-math.log(1 / (1 + math.exp(-(c - r)))) for c, r in zip(chosen.tolist(), rejected.tolist())) / 50
    assert math.isclose(loss.item(), ref, rel_tol=1e-12)
    assert math.isclose(acc.item(), sum(c > r for c, r in zip(chosen.tolist(), rejected.tolist())) / 50, rel_tol=1e-6)
    try:
        bradley_terry_loss(chosen, rejected[:3])
        raise AssertionError("expected a ValueError")
    except ValueError as e:
        assert "matching (P,)" in str(e)


def test_reward_model_learns_the_gold_preferences_and_centres():
    torch.manual_seed(0)
    rm = load_value_model(_config())
    pairs = preference.make_comparisons(400, seed=0, noise=0.05)
    history = train_reward_model(rm, TOK, pairs, steps=120, batch_size=32, lr=3e-3)
    assert sum(h["rm/accuracy"] for h in history[-10:]) / 10 > sum(h["rm/accuracy"] for h in history[:10]) / 10 + 0.1
    held = preference.make_comparisons(200, seed=1, noise=1e-6)  # noiseless held-out labels
    p, c, r = zip(*held)
    sc = compute_scores(rm, build_batch(TOK, list(p), list(c)))
    sr = compute_scores(rm, build_batch(TOK, list(p), list(r)))
    held_acc = (sc > sr).float().mean().item()
    assert held_acc > 0.6, held_acc  # chance is 0.5 (sd 0.035 over 200 pairs)
    prompts, responses = zip(*preference.make_sft_examples(64, seed=5))
    center_reward_model(rm, TOK, list(prompts), list(responses))
    assert abs(compute_scores(rm, build_batch(TOK, list(prompts), list(responses))).mean().item()) < 1e-5


def test_centring_scores_a_few_samples_at_a_time():
    """A reward model trained on a file centres on its training responses: tens of thousands of
    sequences, which one forward pass would not hold. Centring scores ``batch_size`` at a time, to
    the same shift (float32 scores, so 1e-6 of their size)."""
    torch.manual_seed(0)
    rm = load_value_model(_config())
    prompts, responses = zip(*preference.make_sft_examples(150, seed=5))
    whole = compute_scores(rm, build_batch(TOK, list(prompts), list(responses))).double().mean().item()
    rows = []
    forward = rm.forward
    rm.forward = lambda *args, **kwargs: rows.append(kwargs["input_ids"].shape[0]) or forward(*args, **kwargs)
    shift = center_reward_model(rm, TOK, list(prompts), list(responses), batch_size=64)
    assert rows == [64, 64, 22]
    assert shift == pytest.approx(-whole, abs=1e-6 * max(1.0, abs(whole)))
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="batch_size must be a whole number >= 1"):
            center_reward_model(rm, TOK, list(prompts), list(responses), batch_size=bad)
    with pytest.raises(ValueError, match="matching prompts and responses, got 150 and 149"):
        center_reward_model(rm, TOK, list(prompts), list(responses)[1:])
