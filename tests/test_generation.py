import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from _inputs import PROMPTS, rollout, row_tokens

from refppo.accel.decoding import StaticDecoder
from refppo.rollout.forward import compute_log_probs, compute_values
from refppo.rollout.generation import cache_argument, generate, row_uniforms, sample_next_token
from refppo.rollout.models import add_lora, load_causal_lm, load_value_model, tiny_config
from refppo.rollout.prompts import left_pad, tokenize_prompts


class ScriptedLM(torch.nn.Module):
    """Emits script[row, step] at each step (greedy), whatever the input."""

    def __init__(self, script, vocab):
        super().__init__()
        self.script, self.vocab, self.prompt_width = script, vocab, None
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    @property
    def device(self):
        return self.anchor.device

    def forward(self, input_ids, attention_mask, position_ids, use_cache, past_key_values=None, logits_to_keep=0):
        if past_key_values is None:
            self.prompt_width = attention_mask.shape[1]
        step = attention_mask.shape[1] - self.prompt_width
        logits = torch.full((input_ids.shape[0], 1, self.vocab), -10.0)
        logits[torch.arange(input_ids.shape[0]), 0, self.script[:, step]] = 10.0
        return SimpleNamespace(logits=logits, past_key_values="cache")


def test_generate_names_the_cache_as_the_installed_transformers_does(tok):
    """transformers 5.24 renamed the KV cache argument and output to ``cache`` (its old name
    ``past_key_values`` warns, and is to go in 5.40): decoding, plain, LoRA or over a static cache,
    raises no such warning, and a model that takes ``past_key_values`` (ScriptedLM) gets it."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    torch.manual_seed(0)
    actor = load_causal_lm(tiny_config(tok))
    renamed = "cache" in CausalLMOutputWithPast.__dataclass_fields__
    assert (
        cache_argument(actor)
        == cache_argument(add_lora(load_causal_lm(tiny_config(tok))))
        == ("cache" if renamed else "past_key_values")
    )
    assert cache_argument(ScriptedLM(torch.zeros(1, 1, dtype=torch.long), len(tok))) == "past_key_values"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values", category=FutureWarning)
        for model in (actor, StaticDecoder(actor, 32, compile=False)):
            rollout(tok, model, max_new_tokens=3)
        rollout(tok, add_lora(actor), max_new_tokens=3)


def test_eos_and_padding_rules(tok):
    eos, pad = tok.eos_token_id, tok.pad_token_id
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    script = torch.tensor(
        [
            [eos, a, a, a, a, a],  # EOS at step 0: 1 valid token
            [a, b, a, eos, b, b],  # EOS at step 3: 4 valid tokens
            [a, a, a, a, a, a],  # never: truncated
            [b, eos, eos, a, a, a],  # only the first EOS counts
        ]
    )
    model = ScriptedLM(script, len(tok))
    ids, mask = left_pad([[1, 5], [1], [1, 6, 7], [1, 8]], pad)
    batch = generate(model, ids, mask, eos, pad, max_new_tokens=5, do_sample=False)
    assert batch["response_mask"].sum(1).tolist() == [1, 4, 5, 2]
    assert batch["is_truncated"].tolist() == [False, False, True, False]
    assert batch["responses"].tolist() == [
        [eos, pad, pad, pad, pad],
        [a, b, a, eos, pad],
        [a, a, a, a, a],
        [b, eos, pad, pad, pad],
    ]
    # Fixed-length mode: every slot is valid, EOS or not; a row without EOS is still marked.
    fixed = generate(model, ids, mask, eos, pad, max_new_tokens=5, do_sample=False, ignore_eos=True)
    assert fixed["response_mask"].sum(1).tolist() == [5, 5, 5, 5]
    assert fixed["responses"].tolist() == script[:, :5].tolist()
    assert fixed["is_truncated"].tolist() == [False, False, True, False]
    # Decoding stops as soon as every row is done.
    short = generate(model, ids[:1], mask[:1], eos, pad, max_new_tokens=5, do_sample=False)
    assert short["responses"].shape == (1, 1)
    # Several EOS ids: any of them ends a response.
    multi = generate(model, ids, mask, [eos, b], pad, max_new_tokens=5, do_sample=False)
    assert multi["response_mask"].sum(1).tolist() == [1, 2, 5, 1]


def test_batch_layout(tok, models):
    batch = rollout(tok, models[0], n=2, max_new_tokens=6)
    rows, width = 2 * len(PROMPTS), batch["responses"].shape[1]
    p = batch["prompts"].shape[1]
    assert batch["index"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert torch.equal(batch["prompts"][0], batch["prompts"][1])
    assert batch["input_ids"].shape == (rows, p + width)
    assert torch.equal(batch["input_ids"][:, p:], batch["responses"])
    assert torch.equal(batch["attention_mask"][:, p:], batch["response_mask"])
    for i, (prompt, response) in enumerate(row_tokens(batch)):
        n_valid = len(prompt) + len(response)
        pos = batch["position_ids"][i][batch["attention_mask"][i].bool()]
        assert pos.tolist() == list(range(n_valid))
        assert torch.all(batch["responses"][i, len(response) :] == tok.pad_token_id)


def test_same_generator_seed_same_rollout(tok, models):
    one = rollout(tok, models[0], n=2)
    two = rollout(tok, models[0], n=2)
    for key in one:
        assert torch.equal(one[key], two[key]), key


def test_sampling_filters_match_a_plain_reference():
    torch.manual_seed(0)
    logits = torch.randn(6, 40)
    gen = torch.Generator().manual_seed(0)
    for top_k, top_p in [(5, 1.0), (-1, 0.6), (10, 0.5), (1, 1.0), (-1, 1e-300)]:
        probs = (logits.double() / 0.8).softmax(-1)
        allowed = []
        for row in probs:
            order = row.argsort(descending=True).tolist()
            if top_k > 0:
                order = order[:top_k]
            kept, mass = [], 0.0
            total = sum(row[j].item() for j in order)
            for j in order:  # nucleus over the top-k renormalised distribution
                if mass >= top_p:
                    break
                kept.append(j)
                mass += row[j].item() / total
            allowed.append(set(kept))
        seen = [set() for _ in range(6)]
        for _ in range(200):
            uniform = torch.rand(6, generator=gen)
            tokens, logp = sample_next_token(logits, 0.8, top_k, top_p, True, uniform, "raw_logprobs")
            processed_tokens, processed = sample_next_token(logits, 0.8, top_k, top_p, True, uniform)
            assert torch.equal(tokens, processed_tokens), "the mode changes what is recorded, not what is drawn"
            for i, t in enumerate(tokens.tolist()):
                seen[i].add(t)
                # raw: the full distribution's; processed (verl's default, vLLM's): renormalised over the kept tokens
                assert math.isclose(logp[i].item(), math.log(probs[i, t].item()), abs_tol=1e-5)
                kept_mass = sum(probs[i, j].item() for j in allowed[i])
                assert math.isclose(processed[i].item(), math.log(probs[i, t].item() / kept_mass), abs_tol=1e-5)
        for i in range(6):
            assert seen[i] <= allowed[i]
            if len(allowed[i]) <= 3:
                assert seen[i] == allowed[i]
    greedy, _ = sample_next_token(logits, 1.0, do_sample=False)
    assert torch.equal(greedy, logits.argmax(-1))


def test_the_recorded_log_prob_is_vllms_processed_one_by_default():
    """verl 0.9 asks vLLM for ``processed_logprobs`` (``rollout.logprobs_mode``'s default in
    ``verl/workers/config/rollout.py``, ``RolloutConfig``): the log-prob of the temperature-scaled
    distribution after top-k and top-p, renormalised over the kept tokens. Logits (2, 1, 0.5, 0, -1)
    at temperature 0.7 with top_p 0.8 keep the first two tokens; without a filter the modes agree."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    first = torch.zeros(1)  # a uniform number of 0 draws the most likely token
    scaled = [x / 0.7 for x in (2.0, 1.0, 0.5, 0.0, -1.0)]
    full = math.log(math.exp(scaled[0]) / sum(math.exp(x) for x in scaled))
    nucleus = math.log(math.exp(scaled[0]) / sum(math.exp(x) for x in scaled[:2]))
    token, processed = sample_next_token(logits, 0.7, top_p=0.8, uniform=first)
    _, raw = sample_next_token(logits, 0.7, top_p=0.8, uniform=first, logprobs_mode="raw_logprobs")
    assert token.item() == 0
    assert processed.item() == pytest.approx(nucleus, abs=1e-6) and raw.item() == pytest.approx(full, abs=1e-6)
    assert nucleus - full > 0.1, "a vacuous check: the nucleus holds nearly all the mass"
    _, unfiltered = sample_next_token(logits, 0.7, uniform=first)
    _, unfiltered_raw = sample_next_token(logits, 0.7, uniform=first, logprobs_mode="raw_logprobs")
    assert torch.equal(unfiltered, unfiltered_raw)
    with pytest.raises(ValueError, match="logprobs_mode"):
        sample_next_token(logits, 0.7, logprobs_mode="raw_logits")


def test_inverse_cdf_sampling_draws_each_token_with_its_probability():
    """Every token's frequency over 40,000 draws is its probability within 4 standard errors; a
    uniform number of 0 draws the first token with probability above 0, and one just below 1 the
    last."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, generator=gen) * 2
    logits[1, 0] = -float("inf")  # probability 0: never drawn
    probs = logits.double().softmax(-1)
    draws = 40_000
    counts = torch.zeros(3, 7, dtype=torch.float64)
    for u in torch.rand(draws, 3, generator=gen):
        tokens, _ = sample_next_token(logits, uniform=u)
        counts[torch.arange(3), tokens] += 1
    frequency = counts / draws
    assert frequency[1, 0] == 0
    assert ((frequency - probs).abs() <= 4 * (probs * (1 - probs) / draws).sqrt() + 1e-12).all(), (frequency, probs)
    first, _ = sample_next_token(logits, uniform=torch.zeros(3))
    last, _ = sample_next_token(logits, uniform=torch.full((3,), 1 - 1e-7))
    assert first.tolist() == [0, 1, 0] and last.tolist() == [6, 6, 6]


def test_a_rows_samples_do_not_depend_on_the_rest_of_the_batch(tok, models):
    """With row_uniforms, a prompt sampled as row 2 of a batch of four, or alone as row 2, gets the
    same response: its numbers follow its index, not its neighbours (several processes rely on it)."""
    actor = models[0]
    ids, mask = tokenize_prompts(tok, PROMPTS)
    whole = generate(
        actor, ids, mask, tok.eos_token_id, tok.pad_token_id, 10, uniforms=row_uniforms(0, 3, range(4), 10)
    )
    alone_ids, alone_mask = tokenize_prompts(tok, PROMPTS[2:3])
    alone = generate(
        actor, alone_ids, alone_mask, tok.eos_token_id, tok.pad_token_id, 10, uniforms=row_uniforms(0, 3, [2], 10)
    )
    n = int(alone["response_mask"].sum())
    assert torch.equal(alone["responses"][0, :n], whole["responses"][2, :n]) and n > 1
    assert not torch.equal(row_uniforms(0, 3, [2], 10), row_uniforms(0, 4, [2], 10)), "another step, other numbers"
    assert not torch.equal(row_uniforms(0, 3, [2], 10), row_uniforms(0, 3, [2], 10, stream=1)), "another stream"


def test_bad_input(tok, models):
    actor = models[0]
    eos, pad = tok.eos_token_id, tok.pad_token_id
    ids, mask = tokenize_prompts(tok, ["1+1=", "12+34="])
    with pytest.raises(ValueError, match="pad_token_id 2 is an EOS id"):
        generate(actor, ids, mask, [eos], eos, 4)
    with pytest.raises(ValueError, match="left-padded"):
        generate(actor, ids, mask.flip(1), eos, pad, 4)
    with pytest.raises(ValueError, match=r"temperature must be in \[1e-6, inf\)"):
        generate(actor, ids, mask, eos, pad, 4, temperature=0)
    with pytest.raises(ValueError, match="top_p must be in"):
        generate(actor, ids, mask, eos, pad, 4, top_p=1.5)
    with pytest.raises(ValueError, match="max_new_tokens and n must be >= 1"):
        generate(actor, ids, mask, eos, pad, 0)
    with pytest.raises(ValueError, match="the prompt batch is empty"):
        generate(actor, ids[:0], mask[:0], eos, pad, 4)


@pytest.mark.gpu
def test_cuda_bf16_invariants(tok):
    """On CUDA the forward passes autocast to bf16: the first ratio is 1 up to bf16 noise
    (decode-with-cache and full-sequence kernels round differently), padding invariance holds
    to the same tolerance, and log-probs stay float32."""
    torch.manual_seed(0)
    config = tiny_config(tok)
    actor = load_causal_lm(config, device="cuda")
    critic = load_value_model(config, device="cuda")
    batch = rollout(tok, actor, n=4, generator=torch.Generator("cuda").manual_seed(0), temperature=0.8)
    assert batch["responses"].is_cuda and batch["rollout_log_probs"].dtype == torch.float32
    old = compute_log_probs(actor, batch, 0.8, micro_batch_size=3)
    assert old.dtype == torch.float32
    diff = (old - batch["rollout_log_probs"]).abs()[batch["response_mask"].bool()]
    assert diff.max().item() <= 0.05 and diff.mean().item() <= 0.01
    values = compute_values(critic, batch)
    assert values.dtype == torch.float32 and values.is_cuda
    alone = rollout(tok, actor, prompts=["7*8="], do_sample=False, generator=None)
    padded = rollout(tok, actor, prompts=["hello, world: 5+5=", "7*8="], do_sample=False, generator=None)
    # bf16 rounding may flip a near-tie argmax; compare the common prefix, which must be non-empty.
    same = (alone["responses"][0] == padded["responses"][1][: alone["responses"].shape[1]]).long().cumprod(0)
    n = int(same.sum())
    assert n >= 1
    lp_alone = compute_log_probs(actor, alone, 1.0)[0, :n]
    lp_padded = compute_log_probs(actor, padded, 1.0)[1, :n]
    torch.testing.assert_close(lp_padded, lp_alone, rtol=0, atol=0.05)
