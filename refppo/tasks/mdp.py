"""A token-level MDP small enough to solve exactly (chapters 1-4).

The "language model" is a table of logits, one row per state. A state is the response so far
(the prompt is empty); an action is the next token from a tiny vocabulary; EOS or the length
limit ends the episode; the only reward is a sequence score at the end, as in RLHF. With
3 tokens and horizon 4 there are 15 states, so V, Q and advantages follow exactly by backward
induction, and every complete response can be enumerated with its probability.

Shapes: ``logits`` (num_states, vocab); sampled batches are response-only (n, horizon) as in
the rest of refppo, with ``state_ids[i, t]`` the state before token t.
"""

from __future__ import annotations

import itertools

import torch

from refppo.functional import logprobs_from_logits


class TokenMDP:
    """Responses of up to ``horizon`` tokens over ``vocab``; the last token of vocab is EOS.

    The score of a finished response counts the positions where it matches ``target`` and adds
    1 when it is exactly ``target`` followed by EOS. Default: target "a b a", best response
    "a b a <eos>" with score 4.
    """

    def __init__(self, vocab=("a", "b", "<eos>"), horizon: int = 4, target=("a", "b", "a")):
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        self.vocab = tuple(vocab)
        self.eos = len(self.vocab) - 1
        self.horizon = horizon
        self.target = tuple(self.vocab.index(tok) for tok in target)
        # Non-terminal states: every prefix without EOS shorter than the horizon.
        self.states = [p for n in range(horizon) for p in itertools.product(range(self.eos), repeat=n)]
        self.index = {s: i for i, s in enumerate(self.states)}

    @property
    def num_states(self) -> int:
        return len(self.states)

    @property
    def num_actions(self) -> int:
        return len(self.vocab)

    def decode(self, tokens) -> str:
        """Token ids -> text, e.g. 'a b a <eos>'."""
        return " ".join(self.vocab[int(t)] for t in tokens)

    def score(self, response) -> float:
        """Sequence score of a finished response (token ids, EOS included if emitted)."""
        body = [int(t) for t in response if int(t) != self.eos]
        matches = sum(1 for x, y in zip(body, self.target) if x == y)
        exact = tuple(body) == self.target and len(response) > len(body)
        return float(matches + exact)

    def next_state(self, state: int, action: int) -> int:
        """Index of the state after ``action``, or -1 when the episode ends."""
        prefix = self.states[state] + (action,)
        if action == self.eos or len(prefix) == self.horizon:
            return -1
        return self.index[prefix]

    def exact_values(
        self, probs: torch.Tensor, gamma: float = 1.0, step_reward: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """V(s) and Q(s, a) of the policy ``probs`` by backward induction, in float64.

        r(s, a) is the final score when a ends the episode, plus ``step_reward[s, a]`` if given
        (e.g. -beta * KL per token). V(s) = sum_a pi(a|s) Q(s, a), Q(s, a) = r(s, a) + gamma V(s').

        Args:
            probs: (num_states, vocab) action probabilities.
            gamma: discount in [0, 1].
            step_reward: optional (num_states, vocab) extra reward per step.

        Returns:
            V: (num_states,), Q: (num_states, vocab).
        """
        probs = probs.double()
        V = torch.zeros(self.num_states, dtype=torch.float64)
        Q = torch.zeros(self.num_states, self.num_actions, dtype=torch.float64)
        for s in reversed(range(self.num_states)):  # longer prefixes come later in self.states
            for a in range(self.num_actions):
                nxt = self.next_state(s, a)
                r = self.score(self.states[s] + (a,)) if nxt < 0 else 0.0
                if step_reward is not None:
                    r += float(step_reward[s, a])
                Q[s, a] = r + (gamma * V[nxt] if nxt >= 0 else 0.0)
            V[s] = (probs[s] * Q[s]).sum()
        return V, Q

    def responses(self) -> dict[str, torch.Tensor]:
        """Every possible complete response, as a batch (see ``sample`` for the keys)."""
        done = [
            self.states[s] + (a,)
            for s in range(self.num_states)
            for a in range(self.num_actions)
            if self.next_state(s, a) < 0
        ]
        return self._batch(sorted(done, key=lambda seq: (len(seq), seq)))

    def sample(self, logits: torch.Tensor, n: int, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Sample ``n`` responses from the tabular policy softmax(logits).

        Args:
            logits: (num_states, vocab).
            n: number of responses.
            generator: torch random generator.

        Returns:
            dict with responses (n, H) long (right-padded with EOS), response_mask (n, H) float
            (1 through the first EOS), state_ids (n, H) long (state before each token, 0 on
            padding), scores (n,) float64.
        """
        probs = torch.softmax(logits.detach().float(), dim=-1)
        seqs = []
        for _ in range(n):
            s = 0
            seq = []
            while s >= 0:
                a = int(torch.multinomial(probs[s], 1, generator=generator))
                seq.append(a)
                s = self.next_state(s, a)
            seqs.append(tuple(seq))
        return self._batch(seqs)

    def _batch(self, seqs) -> dict[str, torch.Tensor]:
        n = len(seqs)
        H = self.horizon
        responses = torch.full((n, H), self.eos, dtype=torch.long)
        mask = torch.zeros(n, H)
        state_ids = torch.zeros(n, H, dtype=torch.long)
        for i, seq in enumerate(seqs):
            responses[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1.0
            for t in range(len(seq)):
                state_ids[i, t] = self.index[seq[:t]]
        scores = torch.tensor([self.score(seq) for seq in seqs], dtype=torch.float64)
        return {"responses": responses, "response_mask": mask, "state_ids": state_ids, "scores": scores}

    def log_probs(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """log pi(a_t | s_t) of the batch's tokens under softmax(logits): (n, H) float32.

        The table lookup ``logits[state_ids]`` plays the model's forward pass; gradients flow.
        """
        return logprobs_from_logits(logits[batch["state_ids"]], batch["responses"])
