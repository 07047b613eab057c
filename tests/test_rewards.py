import math

import pytest
import torch
from _inputs import batches, make_mask
from hypothesis import given
from hypothesis import strategies as st

from refppo.rewards import apply_kl_penalty, apply_missing_eos_penalty, clip_reward, place_score_on_last_token


@given(batches(), st.sampled_from(["ragged", "holes", "full"]))
def test_score_sits_on_last_valid_token(b, kind):
    gen, batch, length, _ = b
    mask = make_mask(kind, batch, length, gen)
    scores = torch.randn(batch, generator=gen, dtype=torch.float64)
    out = place_score_on_last_token(scores, mask)
    for i in range(batch):
        last = max(t for t in range(length) if mask[i, t] == 1)
        for t in range(length):
            assert out[i, t].item() == (scores[i].item() if t == last else 0.0)


def test_score_placement_bad_input():
    with pytest.raises(ValueError, match="emptiest row"):
        place_score_on_last_token(torch.ones(2), torch.tensor([[1.0, 0], [0, 0]]))
    with pytest.raises(ValueError, match="scores contains NaN"):
        place_score_on_last_token(torch.tensor([float("nan")]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="scores has 3 rows"):
        place_score_on_last_token(torch.ones(3), torch.ones(2, 2))


@given(batches(), st.sampled_from(["kl", "low_var_kl", "abs"]), st.floats(0.0, 0.5))
def test_kl_in_reward_matches_formula(b, est, beta):
    gen, batch, length, kind = b
    mask = make_mask(kind, batch, length, gen)
    scores = torch.randn(batch, length, generator=gen, dtype=torch.float64) * mask
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    ref = old + torch.randn(batch, length, generator=gen, dtype=torch.float64) * 0.3
    rewards, current_kl = apply_kl_penalty(scores, old, ref, mask, beta, est)

    def k(o, r):
        x = o - r
        return x if est == "kl" else abs(x) if est == "abs" else math.expm1(-x) + x

    per_seq = []
    for i in range(batch):
        kls = [k(old[i, t].item(), ref[i, t].item()) for t in range(length)]
        n = sum(mask[i].tolist())
        per_seq.append(sum(kl * m for kl, m in zip(kls, mask[i].tolist())) / (n + 1e-8))
        for t in range(length):
            expect = scores[i, t].item() - beta * kls[t] * mask[i, t].item()
            assert rewards[i, t].item() == pytest.approx(expect, abs=1e-12)
    assert current_kl.item() == pytest.approx(sum(per_seq) / batch, abs=1e-9)


def test_deepspeed_chat_compute_rewards_in_a_few_lines():
    # 003.8: deepspeed-chat's compute_rewards (kl_ctl 0.1, clip_reward_value 5), written plainly
    # with its start / ends indexing over prompt + response, against refppo's pieces.
    gen = torch.Generator().manual_seed(0)
    prompt_len, resp_len, batch = 3, 5, 4
    log_probs = -torch.rand(batch, prompt_len - 1 + resp_len, generator=gen, dtype=torch.float64)
    ref_log_probs = log_probs + 0.2 * torch.randn(batch, prompt_len - 1 + resp_len, generator=gen, dtype=torch.float64)
    reward_score = torch.tensor([7.0, -0.5, 2.0, -9.0], dtype=torch.float64)
    action_mask = torch.ones(batch, prompt_len - 1 + resp_len)
    action_mask[1, -2:] = 0
    action_mask[2, -4:] = 0
    ds = (-0.1 * (log_probs - ref_log_probs)).tolist()
    start = prompt_len - 1
    ends = [start + int(action_mask[j, start:].sum()) for j in range(batch)]
    for j in range(batch):
        ds[j][ends[j] - 1] += max(min(reward_score[j].item(), 5.0), -5.0)

    # refppo: response-only tensors, three calls.
    mask = action_mask[:, start:]
    scores = place_score_on_last_token(clip_reward(reward_score, 5.0), mask)
    rewards, _ = apply_kl_penalty(scores, log_probs[:, start:], ref_log_probs[:, start:], mask, kl_coef=0.1)
    for j in range(batch):
        for t in range(resp_len):
            if mask[j, t] == 1:
                assert rewards[j, t].item() == pytest.approx(ds[j][start + t], abs=1e-12)


def test_clip_and_missing_eos_penalty():
    assert clip_reward(torch.tensor([-7.0, 0.3, 9.0]), 5.0).tolist() == [-5.0, 0.30000001192092896, 5.0]
    out = apply_missing_eos_penalty(torch.tensor([1.0, 1.0]), torch.tensor([True, False]), 2.0)
    assert out.tolist() == [-1.0, 1.0]
    with pytest.raises(ValueError, match="clip_reward_value"):
        clip_reward(torch.zeros(2), 0.0)
    with pytest.raises(ValueError, match="penalty"):
        apply_missing_eos_penalty(torch.zeros(2), torch.zeros(2, dtype=torch.bool), -1.0)
    with pytest.raises(ValueError, match="kl_coef"):
        apply_kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), -0.1)
    with pytest.raises(ValueError, match="old_log_probs contains NaN"):
        apply_kl_penalty(torch.zeros(1, 2), torch.full((1, 2), float("nan")), torch.zeros(1, 2), torch.ones(1, 2), 0.1)
