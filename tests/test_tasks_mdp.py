import math

import pytest
import torch

from refppo.tasks.mdp import TokenMDP


def test_structure_and_scores():
    mdp = TokenMDP()
    assert mdp.num_states == 15 and mdp.num_actions == 3
    assert mdp.score([0, 1, 0, 2]) == 4.0  # "a b a <eos>": 3 matches + exact
    assert mdp.score([0, 1, 0, 0]) == 3.0  # truncated: no exact bonus
    assert mdp.score([2]) == 0.0
    assert mdp.next_state(0, 2) == -1 and mdp.next_state(mdp.index[(0, 1, 0)], 0) == -1
    with pytest.raises(ValueError, match="horizon"):
        TokenMDP(horizon=0)


def test_exact_values_match_enumeration_and_bellman():
    mdp = TokenMDP()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(mdp.num_states, 3, generator=gen)
    probs = torch.softmax(logits, -1)
    gamma = 0.9
    V, Q = mdp.exact_values(probs, gamma)
    # Enumerate every response: V(root) = sum_y P(y) * gamma^(len-1) * score(y).
    batch = mdp.responses()
    logp = mdp.log_probs(logits, batch).double() * batch["response_mask"]
    p = logp.sum(-1).exp()
    assert p.sum().item() == pytest.approx(1.0, abs=1e-6)
    lengths = batch["response_mask"].sum(-1)
    expect = (p * gamma ** (lengths - 1) * batch["scores"]).sum().item()
    assert V[0].item() == pytest.approx(expect, abs=1e-6)
    # Bellman: V(s) = sum_a pi(a|s) [r(s,a) + gamma V(s')], checked one state at a time.
    for s in range(mdp.num_states):
        total = 0.0
        for a in range(3):
            nxt = mdp.next_state(s, a)
            target = mdp.score(mdp.states[s] + (a,)) if nxt < 0 else gamma * V[nxt].item()
            assert Q[s, a].item() == pytest.approx(target, abs=1e-12)
            total += probs[s, a].item() * target
        assert V[s].item() == pytest.approx(total, abs=1e-9)


def test_samples_have_the_batch_conventions():
    mdp = TokenMDP()
    gen = torch.Generator().manual_seed(1)
    batch = mdp.sample(torch.zeros(mdp.num_states, 3), 500, gen)
    mask, resp = batch["response_mask"], batch["responses"]
    for i in range(500):
        n = int(mask[i].sum())
        toks = resp[i, :n].tolist()
        assert all(t != mdp.eos for t in toks[:-1])  # EOS only at the end
        assert n == mdp.horizon or toks[-1] == mdp.eos
        assert batch["scores"][i].item() == mdp.score(toks)
    # Uniform policy: P(first token is EOS) = 1/3.
    assert (resp[:, 0] == mdp.eos).float().mean().item() == pytest.approx(1 / 3, abs=0.06)
    # Monte-Carlo mean score approaches the exact V(root).
    V, _ = mdp.exact_values(torch.full((mdp.num_states, 3), 1 / 3))
    assert batch["scores"].mean().item() == pytest.approx(V[0].item(), abs=0.1)


def test_log_probs_flow_gradients_to_the_table():
    mdp = TokenMDP()
    logits = torch.zeros(mdp.num_states, 3, requires_grad=True)
    batch = mdp.responses()
    lp = mdp.log_probs(logits, batch)
    assert torch.allclose(lp[batch["response_mask"] == 1], torch.tensor(math.log(1 / 3)))
    (lp * batch["response_mask"]).sum().backward()
    assert logits.grad.abs().sum() > 0
