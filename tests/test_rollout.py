import math
import os
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from _inputs import CHAT_TEMPLATES, attention_calls, chat_tokenizer
from _trainers import make_trainer

from refppo.models import add_lora, enable_gradient_checkpointing, load_causal_lm, load_value_model, tiny_config
from refppo.rollout import (
    DECODE_ATTENTION,
    StaticDecoder,
    _sequence_batch,
    _static_cache_class,
    cache_argument,
    compute_log_probs,
    compute_scores,
    compute_values,
    decode_attention,
    encode_prompts,
    generate,
    grouped_decode_attention,
    left_pad,
    micro_batches,
    position_ids_from_mask,
    response_log_probs,
    response_scores,
    response_values,
    sample_next_token,
    split_micro_batches,
    token_budget_micro_batches,
    tokenize_prompts,
    trim_padding,
)
from refppo.tasks.tokenizer import build_tokenizer

PROMPTS = ["12+34=", "7*8=", "999+1=", "hello, world:"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def models(tok):
    torch.manual_seed(0)
    config = tiny_config(tok)
    return load_causal_lm(config), load_value_model(config), load_value_model(config)


def _rollout(tok, actor, prompts=PROMPTS, **kw):
    ids, mask = tokenize_prompts(tok, prompts)
    kw = {"max_new_tokens": 12, "generator": torch.Generator().manual_seed(0), **kw}
    return generate(actor, ids, mask, tok.eos_token_id, tok.pad_token_id, **kw)


def _rows(batch):
    """Each row's unpadded prompt ids and valid response ids, as Python lists."""
    for i in range(batch["prompts"].shape[0]):
        prompt = batch["prompts"][i][batch["attention_mask"][i, : batch["prompts"].shape[1]].bool()].tolist()
        response = batch["responses"][i][batch["response_mask"][i].bool()].tolist()
        yield prompt, response


@pytest.mark.parametrize(
    "kw",
    [dict(temperature=1.0), dict(temperature=0.7, top_k=8, top_p=0.9, n=3), dict(temperature=1.3, do_sample=False)],
)
def test_first_ratio_is_one(tok, models, kw):
    """Recomputed old log-probs equal the rollout's (CPU float32), at any micro-batch size."""
    actor = models[0]
    batch = _rollout(tok, actor, **kw)
    for mbs in (None, 1, 5):
        old = compute_log_probs(actor, batch, kw["temperature"], micro_batch_size=mbs)
        assert (old - batch["rollout_log_probs"]).abs().max().item() <= 1e-5
    assert torch.all(batch["rollout_log_probs"][batch["response_mask"] == 0] == 0)


def test_a_trainable_actor_and_its_frozen_reference_give_equal_log_probs():
    """At step 0 the actor is its reference and every KL term must be exactly 0. torch picks the
    matrix-product path of a strided 3-D input by the weight's requires_grad, and MKL's AVX2
    kernels round the two paths differently, so the check runs with those kernels forced (a
    fresh process: MKL reads the setting when it loads; elsewhere the setting is ignored)."""
    code = """
import torch
from refppo.models import load_causal_lm, make_reference, tiny_config
from refppo.rollout import _sequence_batch, compute_log_probs
from refppo.tasks.tokenizer import build_tokenizer
tok = build_tokenizer()
torch.manual_seed(0)
actor = load_causal_lm(tiny_config(tok, hidden_size=128))
reference = make_reference(actor)
assert all(p.requires_grad for p in actor.parameters()) and not any(p.requires_grad for p in reference.parameters())
ids = torch.randint(5, len(tok), (6, 30))
mask = torch.ones_like(ids)
mask[:2, :3] = 0
batch = _sequence_batch(ids[:, :12], mask[:, :12], ids[:, 12:], torch.ones(6, 18, dtype=torch.long))
a, r = compute_log_probs(actor, batch, 1.0), compute_log_probs(reference, batch, 1.0)
print("equal" if torch.equal(a, r) else f"differ by {(a - r).abs().max().item():.1e}")
"""
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "equal"


def test_log_probs_values_scores_read_the_right_positions(tok, models):
    """Against a plain reference: each quantity from a forward pass over the unpadded prefix."""
    actor, critic, rm = models
    batch = _rollout(tok, actor, temperature=0.9)
    log_probs, entropy = compute_log_probs(actor, batch, 0.9, calculate_entropy=True)
    values, scores = compute_values(critic, batch), compute_scores(rm, batch)
    with torch.no_grad():
        for i, (prompt, response) in enumerate(_rows(batch)):
            for t, token in enumerate(response):
                prefix = torch.tensor([prompt + response[:t]])
                logits = actor(prefix).logits[0, -1].double() / 0.9
                logp = logits.log_softmax(-1)
                assert math.isclose(log_probs[i, t].item(), logp[token].item(), abs_tol=1e-5)
                ent = -(logp.exp() * logp).sum().item()
                assert math.isclose(entropy[i, t].item(), ent, abs_tol=1e-5)
                # V(state before token t): the critic's output at the last position of the prefix.
                assert math.isclose(values[i, t].item(), critic(prefix).logits[0, -1, 0].item(), abs_tol=1e-5)
            whole = torch.tensor([prompt + response])
            assert math.isclose(scores[i].item(), rm(whole).logits[0, -1, 0].item(), abs_tol=1e-5)
            width = batch["responses"].shape[1]
            assert torch.all(values[i, len(response) :] == 0) and len(response) <= width


def test_padding_invariance(tok, models):
    """One prompt, alone or padded inside batches of different widths: same greedy responses,
    log-probs, values and scores."""
    actor, critic, rm = models
    target = "7*8="
    layouts = [[target], [target, "1234567890+1234567890="], ["hello, world: 5+5=", "1=", target]]
    results = []
    for prompts in layouts:
        batch = _rollout(tok, actor, prompts=prompts, do_sample=False, max_new_tokens=10)
        i = prompts.index(target)
        results.append(
            dict(
                response=batch["responses"][i][batch["response_mask"][i].bool()],
                log_probs=compute_log_probs(actor, batch, 1.0)[i],
                values=compute_values(critic, batch)[i],
                score=compute_scores(rm, batch)[i],
            )
        )
    first = results[0]
    for other in results[1:]:
        assert torch.equal(other["response"], first["response"])
        n = len(first["response"])
        for key in ("log_probs", "values"):
            torch.testing.assert_close(other[key][:n], first[key][:n], rtol=0, atol=1e-5)
        torch.testing.assert_close(other["score"], first["score"], rtol=0, atol=1e-5)


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
    assert cache_argument(actor) == cache_argument(add_lora(load_causal_lm(tiny_config(tok)))) == ("cache" if renamed else "past_key_values")
    assert cache_argument(ScriptedLM(torch.zeros(1, 1, dtype=torch.long), len(tok))) == "past_key_values"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values", category=FutureWarning)
        for decoder in (None, StaticDecoder(actor, compile=False)):
            _rollout(tok, actor, max_new_tokens=3, decoder=decoder)
        _rollout(tok, add_lora(actor), max_new_tokens=3)


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
    batch = _rollout(tok, models[0], n=2, max_new_tokens=6)
    rows, width = 2 * len(PROMPTS), batch["responses"].shape[1]
    p = batch["prompts"].shape[1]
    assert batch["index"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert torch.equal(batch["prompts"][0], batch["prompts"][1])
    assert batch["input_ids"].shape == (rows, p + width)
    assert torch.equal(batch["input_ids"][:, p:], batch["responses"])
    assert torch.equal(batch["attention_mask"][:, p:], batch["response_mask"])
    for i, (prompt, response) in enumerate(_rows(batch)):
        n_valid = len(prompt) + len(response)
        pos = batch["position_ids"][i][batch["attention_mask"][i].bool()]
        assert pos.tolist() == list(range(n_valid))
        assert torch.all(batch["responses"][i, len(response) :] == tok.pad_token_id)


def test_same_generator_seed_same_rollout(tok, models):
    one = _rollout(tok, models[0], n=2)
    two = _rollout(tok, models[0], n=2)
    for key in one:
        assert torch.equal(one[key], two[key]), key


def test_sampling_filters_match_a_plain_reference():
    torch.manual_seed(0)
    logits = torch.randn(6, 40)
    gen = torch.Generator().manual_seed(0)
    for top_k, top_p in [(5, 1.0), (-1, 0.6), (10, 0.5), (1, 1.0)]:
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
            tokens, logp = sample_next_token(logits, 0.8, top_k, top_p, True, gen)
            for i, t in enumerate(tokens.tolist()):
                seen[i].add(t)
                assert math.isclose(logp[i].item(), math.log(probs[i, t].item()), abs_tol=1e-5)
        for i in range(6):
            assert seen[i] <= allowed[i]
            if len(allowed[i]) <= 3:
                assert seen[i] == allowed[i]
    greedy, _ = sample_next_token(logits, 1.0, do_sample=False)
    assert torch.equal(greedy, logits.argmax(-1))


def test_position_ids_and_micro_batches():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]]
    batch = {"a": torch.arange(7), "b": torch.arange(14).view(7, 2)}
    parts = list(micro_batches(batch, 3))
    assert [len(p["a"]) for p in parts] == [3, 3, 1]
    assert torch.equal(torch.cat([p["b"] for p in parts]), batch["b"])
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        list(micro_batches(batch, 0))


def _ragged_batch(tok, rows=12):
    """Prompts of 2-13 characters and responses of 1-9 tokens (plus EOS), in the rollout layout."""
    from refppo.rollout import build_batch

    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 10, (rows,), generator=g).tolist()
    prompts = ["1" * (2 + (5 * i) % 12) + "=" for i in range(rows)]
    batch = build_batch(tok, prompts, ["7" * n for n in lengths])
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"]
    batch["index"] = torch.arange(rows)
    return batch


@pytest.mark.parametrize("budget", [30, 47, 64, 200, 10_000])
def test_token_budget_micro_batches_cover_every_row_within_the_budget(tok, budget):
    batch = _ragged_batch(tok)
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
    batch = _ragged_batch(tok)
    longest = int((batch["attention_mask"]).sum(-1).max())
    with pytest.raises(ValueError, match=f"has {longest} tokens, more than the micro-batch budget of {longest - 1}"):
        token_budget_micro_batches(batch, longest - 1)
    with pytest.raises(ValueError, match="a micro-batch is 4 rows or 64 tokens, not both"):
        split_micro_batches(batch, 4, 64)
    assert torch.equal(trim_padding(batch)["input_ids"], batch["input_ids"]), "the longest rows already fill the rectangle"


def test_token_budget_passes_equal_the_whole_batch(tok, models):
    """Log-probs, entropies and values from token-budget micro-batches (rows regrouped, padding cut)
    equal one pass over the whole batch, in the batch's order and width."""
    actor, critic, _ = models
    batch = _ragged_batch(tok)
    whole_lp, whole_ent = compute_log_probs(actor, batch, 0.7, calculate_entropy=True)
    lp, ent = compute_log_probs(actor, batch, 0.7, calculate_entropy=True, max_tokens=40)
    assert lp.shape == whole_lp.shape and ent.shape == whole_ent.shape
    assert torch.allclose(lp, whole_lp, atol=1e-5) and torch.allclose(ent, whole_ent, atol=1e-5)
    assert (lp[batch["response_mask"] == 0] == 0).all()
    values = compute_values(critic, batch, max_tokens=40)
    assert torch.allclose(values, compute_values(critic, batch), atol=1e-5)
    assert len(token_budget_micro_batches(batch, 40)) > 3, "a vacuous check: one micro-batch"


def test_prompt_length_limit(tok):
    with pytest.raises(ValueError, match="prompt 1 has 7 tokens, more than max_prompt_length=5"):
        tokenize_prompts(tok, ["1+1=", "12+34="], max_prompt_length=5)
    ids, mask = tokenize_prompts(tok, ["1+1=", "12+34="], max_prompt_length=5, truncation="right")
    assert tok.decode(ids[1]) == "2+34="
    ids, _ = tokenize_prompts(tok, ["12+34="], max_prompt_length=5, truncation="left")
    assert tok.decode(ids[0]) == "<bos>12+3"
    with pytest.raises(ValueError, match="unknown truncation 'middle'"):
        tokenize_prompts(tok, ["1"], max_prompt_length=5, truncation="middle")


@pytest.mark.parametrize("template", CHAT_TEMPLATES)
def test_chat_prompts_are_encoded_as_verl_encodes_them(template):
    """A chat (verl's data format) goes through the chat template with the assistant's turn
    opened and gets no second BOS; a text keeps the tokenizer's own. Expected ids written out
    character by character, and equal to transformers' apply_chat_template(tokenize=True), which
    verl's rollout calls."""
    chat_tok = chat_tokenizer(template)
    vocab = chat_tok.get_vocab()
    chats = [[{"role": "user", "content": "abc"}], [{"role": "system", "content": "be brief"}, {"role": "user", "content": "d"}]]
    prompts = ["1+1=", chats[0], "7*8=", chats[1]]
    ids = encode_prompts(chat_tok, prompts)
    head = [vocab["<bos>"]] if template == "bos" else []
    chat_texts = ["user: abc.assistant:", "system: be brief.user: d.assistant:"]
    expected = [[vocab["<bos>"]] + [vocab[c] for c in text] for text in ("1+1=", "7*8=")]
    expected_chats = [head + [vocab[c] for c in text] for text in chat_texts]
    assert ids == [expected[0], expected_chats[0], expected[1], expected_chats[1]]
    for chat, seq in zip(chats, expected_chats):
        assert chat_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"] == seq
    batch_ids, mask = tokenize_prompts(chat_tok, prompts)
    assert [row[m.bool()].tolist() for row, m in zip(batch_ids, mask)] == ids
    with pytest.raises(ValueError, match="prompt 1 has 2[0-9] tokens, more than max_prompt_length=16"):
        tokenize_prompts(chat_tok, prompts, max_prompt_length=16)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([{"role": "user", "content": "abc"}], "prompt 1 is a chat, but the tokenizer has no chat template"),
        ({"role": "user", "content": "abc"}, "prompt 1 is one message, not a chat"),
        ([], "prompt 1 is neither a text nor a chat"),
        ([{"role": "user"}], "prompt 1 is neither a text nor a chat"),
        ([{"role": "user", "content": ["abc"]}], "prompt 1 is neither a text nor a chat"),
        (7, "prompt 1 is neither a text nor a chat"),
    ],
)
def test_prompts_that_are_neither_texts_nor_renderable_chats_are_refused(tok, prompt, message):
    with pytest.raises(ValueError, match=message):
        tokenize_prompts(tok, ["1+1=", prompt])


def test_bad_input(tok, models):
    actor = models[0]
    eos, pad = tok.eos_token_id, tok.pad_token_id
    with pytest.raises(ValueError, match="the prompt list is empty"):
        tokenize_prompts(tok, [])
    with pytest.raises(ValueError, match="one string"):
        tokenize_prompts(tok, "1+1=")
    with pytest.raises(ValueError, match="sequence 0 has no tokens"):
        left_pad([[]], pad)
    ids, mask = tokenize_prompts(tok, ["1+1=", "12+34="])
    with pytest.raises(ValueError, match="pad_token_id 2 is an EOS id"):
        generate(actor, ids, mask, [eos], eos, 4)
    with pytest.raises(ValueError, match="left-padded"):
        generate(actor, ids, mask.flip(1), eos, pad, 4)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        generate(actor, ids, mask, eos, pad, 4, temperature=0)
    with pytest.raises(ValueError, match="top_p must be in"):
        generate(actor, ids, mask, eos, pad, 4, top_p=1.5)
    with pytest.raises(ValueError, match="max_new_tokens and n must be >= 1"):
        generate(actor, ids, mask, eos, pad, 0)
    with pytest.raises(ValueError, match="the prompt batch is empty"):
        generate(actor, ids[:0], mask[:0], eos, pad, 4)
    batch = _rollout(tok, actor, prompts=["1+1="])
    batch["response_mask"] = torch.zeros_like(batch["response_mask"])
    with pytest.raises(ValueError, match="nothing to score"):
        compute_scores(models[2], batch)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_static_cache_decoding_equals_the_growing_cache(tok, arch):
    """The static-cache step (here eager: compiling it is the GPU test's job) samples the same
    tokens with the same log-probs, and a reused cache starts clean."""
    torch.manual_seed(0)
    actor = load_causal_lm(tiny_config(tok, arch))
    kw = dict(n=3, temperature=0.9, generator=torch.Generator().manual_seed(3))
    eager = _rollout(tok, actor, **kw)
    decoder = StaticDecoder(actor, compile=False)
    for _ in range(2):
        static = _rollout(tok, actor, decoder=decoder, **kw | {"generator": torch.Generator().manual_seed(3)})
        for key in eager:
            assert torch.equal(static[key], eager[key]) or key == "rollout_log_probs", key
        torch.testing.assert_close(static["rollout_log_probs"], eager["rollout_log_probs"], rtol=0, atol=1e-5)
    assert len(decoder._caches) == 1
    with pytest.raises(ValueError, match="the decoder was built for another model"):
        _rollout(tok, load_causal_lm(tiny_config(tok, arch)), decoder=decoder)
    # Under bf16 autocast (as on CUDA) keys leave the rotary embedding in float32, values in bf16.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = _rollout(tok, actor, do_sample=False, generator=None)
        static = _rollout(tok, actor, do_sample=False, generator=None, decoder=decoder)
    assert torch.equal(static["responses"], eager["responses"])
    torch.testing.assert_close(static["rollout_log_probs"], eager["rollout_log_probs"], rtol=0, atol=0.02)


def _plain_attention(query, key, value, mask, scale):
    """float64 attention, one query head at a time, head h reading key/value head h // G."""
    batch, heads, length, _ = query.shape
    groups = heads // key.shape[1]
    out = torch.zeros(batch, length, heads, value.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            scores = query[b, h].double() @ key[b, h // groups].double().T * scale
            scores = scores.masked_fill(~mask[b, 0], -math.inf)
            out[b, :, h] = scores.softmax(dim=-1) @ value[b, h // groups].double()
    return out


@pytest.mark.parametrize("length", [1, 3])
def test_grouped_decode_attention_equals_plain_attention(length):
    """Query heads folded into their key/value head's rows (one-token queries), or handed to
    transformers' SDPA (longer ones, or no mask): the same attention as head-by-head float64
    arithmetic, with a boolean mask, the equivalent additive one, or none."""
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, slots, dim = 3, 6, 2, 9, 8
    query = torch.randn(batch, heads, length, dim, generator=g)
    key, value = torch.randn(2, batch, kv_heads, slots, dim, generator=g)
    mask = torch.rand(batch, 1, length, slots, generator=g) < 0.7
    mask[..., 0] = True  # every query attends to something
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=False)
    expected = _plain_attention(query, key, value, mask, 0.3)
    additive = torch.zeros(mask.shape).masked_fill(~mask, -math.inf)
    for attention_mask in (mask, additive):
        out, weights = grouped_decode_attention(module, query, key, value, attention_mask, scaling=0.3)
        assert out.shape == (batch, length, heads, dim) and weights is None
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)
    unmasked, _ = grouped_decode_attention(module, query, key, value, None, scaling=0.3)
    torch.testing.assert_close(unmasked.double(), _plain_attention(query, key, value, torch.ones_like(mask), 0.3), rtol=0, atol=1e-5)




def _length_and_attention(layer, kwargs):
    return kwargs["hidden_states"].shape[1], layer.config._attn_implementation


def test_generate_decodes_with_the_grouped_attention_and_restores_the_model(tok):
    """Every attention call of generate (the prompt and each new token) runs under the grouped
    decode attention, a LoRA actor's too; afterwards, or after an error inside, the model is back
    on SDPA. A model on eager attention is left alone."""
    torch.manual_seed(0)
    actor = load_causal_lm(tiny_config(tok))
    with attention_calls([actor], _length_and_attention) as calls:
        batch = _rollout(tok, actor, max_new_tokens=5, ignore_eos=True)
    layers = actor.config.num_hidden_layers
    assert [length for length, _ in calls] == [batch["prompts"].shape[1]] * layers + [1] * 4 * layers
    assert {name for _, name in calls} == {DECODE_ATTENTION}
    assert actor.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"), decode_attention(actor):
        raise RuntimeError("boom")
    assert actor.config._attn_implementation == "sdpa"
    eager = load_causal_lm(tiny_config(tok, attn_implementation="eager"))
    with decode_attention(eager):
        assert eager.config._attn_implementation == "eager"
    lora = add_lora(actor)
    with attention_calls([lora], _length_and_attention) as calls:
        _rollout(tok, lora, max_new_tokens=2)
    assert calls and {name for _, name in calls} == {DECODE_ATTENTION}
    assert actor.config._attn_implementation == "sdpa"


def test_compiled_decoding_reads_the_cache_without_copying_heads(tok):
    """Traced by torch.compile (as the CUDA-graph decoder is), a decoding step's attention gets
    the cache's 2 key/value heads, not copies for the 4 query heads that transformers' own SDPA
    path makes under compilation; its logits equal the uncompiled step's."""
    torch.manual_seed(0)
    actor = load_causal_lm(tiny_config(tok))
    rows, slots = 3, 8
    key_heads = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.target is torch.nn.functional.scaled_dot_product_attention:
                key_heads.append(node.args[1].meta["example_value"].shape[1])
        return gm

    step = torch.compile(actor, backend=backend, fullgraph=True, dynamic=False)
    inputs = dict(
        input_ids=torch.full((rows, 1), 5), attention_mask=torch.ones(rows, slots, dtype=torch.long),
        position_ids=torch.full((rows, 1), 2), cache_position=torch.tensor([2]), use_cache=True,
    )  # fmt: skip
    logits = []
    for model in (step, actor):
        cache = _static_cache_class()(config=actor.config, max_cache_len=slots)
        with torch.no_grad(), decode_attention(actor):
            logits.append(model(**{cache_argument(actor): cache}, **inputs).logits)
    assert key_heads == [actor.config.num_key_value_heads] * actor.config.num_hidden_layers
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)


def test_cuda_graphs_refused_off_cuda(tok):
    with pytest.raises(ValueError, match="rollout.cuda_graphs=true needs the actor on a CUDA device"):
        make_trainer(["rollout.cuda_graphs=true"])


def test_trainable_passes_leave_cudnn_attention_out(tok, models):
    """Every forward pass that may be backpropagated (log-probs, fused or not, values, scores) runs
    its attention with cuDNN's kernel disabled (its backward's NaN, pytorch/pytorch#196678), and
    the setting is restored after."""
    actor, critic, reward_model = models
    batch = _rollout(tok, actor)
    with attention_calls(models, lambda *_: torch.backends.cuda.cudnn_sdp_enabled()) as seen:
        response_log_probs(actor, batch)
        response_log_probs(actor, batch, fused=True)
        response_values(critic, batch)
        response_scores(reward_model, batch)
    layers = actor.config.num_hidden_layers
    assert seen == [False] * 4 * layers
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_checkpointed_recomputation_leaves_cudnn_attention_out(tok):
    """With activation checkpointing the backward pass recomputes each layer's attention outside
    the forward's context: that recomputation leaves cuDNN's kernel out too, for the actor and
    the critic alike."""
    torch.manual_seed(0)
    config = tiny_config(tok)
    actor, critic = load_causal_lm(config), load_value_model(config)
    batch = _rollout(tok, actor)
    for model in (actor, critic):
        enable_gradient_checkpointing(model)
        model.train()
    log_probs, _ = response_log_probs(actor, batch)
    values = response_values(critic, batch)
    with attention_calls([actor, critic], lambda *_: torch.backends.cuda.cudnn_sdp_enabled()) as seen:
        (log_probs.sum() + values.sum()).backward()
    assert seen == [False] * 2 * config.num_hidden_layers, "every layer recomputed, none with cuDNN"
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_ragged_batch_gets_finite_gradients_on_cuda(tok, checkpointed):
    """A left-padded batch 320 = 2 x 128 + 64 tokens wide, where cuDNN's attention backward
    returns NaN (pytorch/pytorch#196678): every gradient is finite and agrees with the float32
    CPU gradient to bf16 noise, with activation checkpointing (whose recomputation runs in the
    backward pass) too."""
    torch.manual_seed(0)
    config = tiny_config(tok, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    cpu = load_causal_lm(config)
    gpu = load_causal_lm(config, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    if checkpointed:
        enable_gradient_checkpointing(gpu)
        gpu.train()
    g = torch.Generator().manual_seed(0)
    pads, lengths = torch.tensor([0, 40, 10, 60, 5, 33, 20, 50]), torch.tensor([256, 8, 100, 200, 64, 17, 250, 130])
    prompt_mask = (torch.arange(64) >= pads[:, None]).long()
    response_mask = (torch.arange(256) < lengths[:, None]).long()
    prompts = torch.randint(4, len(tok), (8, 64), generator=g).masked_fill(prompt_mask == 0, tok.pad_token_id)
    responses = torch.randint(4, len(tok), (8, 256), generator=g).masked_fill(response_mask == 0, tok.pad_token_id)
    batch = _sequence_batch(prompts, prompt_mask, responses, response_mask)
    grads = []
    for model in (cpu, gpu):
        log_probs, _ = response_log_probs(model, {k: v.to(model.device) for k, v in batch.items()})
        log_probs.sum().backward()
        grads.append(torch.cat([p.grad.flatten().float().cpu() for p in model.parameters()]))
    assert torch.isfinite(grads[1]).all(), f"{int((~torch.isfinite(grads[1])).sum())} non-finite gradient entries"
    relative = float((grads[1] - grads[0]).norm() / grads[0].norm())
    assert relative < 3e-2, relative


@pytest.mark.gpu
def test_cuda_graph_decoding(tok):
    """A compiled static-cache decoder on CUDA: its responses' log-probs recomputed by a full
    forward pass agree to bf16 noise, and greedy decoding matches the eager decoder's."""
    torch.manual_seed(0)
    actor = load_causal_lm(tiny_config(tok, "qwen2"), device="cuda")
    decoder = StaticDecoder(actor)
    for _ in range(2):  # the second call replays the recorded graphs
        batch = _rollout(tok, actor, n=4, decoder=decoder, generator=torch.Generator("cuda").manual_seed(0))
        diff = (compute_log_probs(actor, batch) - batch["rollout_log_probs"]).abs()[batch["response_mask"].bool()]
        assert diff.max().item() <= 0.05 and diff.mean().item() <= 0.01
    greedy = dict(do_sample=False, generator=None)
    eager, graphs = _rollout(tok, actor, **greedy), _rollout(tok, actor, decoder=decoder, **greedy)
    same = (eager["responses"] == graphs["responses"]).all(dim=1).float().mean().item()
    assert same >= 0.75, f"only {same:.0%} of greedy responses match the eager decoder's"


@pytest.mark.gpu
def test_cuda_bf16_invariants(tok):
    """On CUDA the forward passes autocast to bf16: the first ratio is 1 up to bf16 noise
    (decode-with-cache and full-sequence kernels round differently), padding invariance holds
    to the same tolerance, and log-probs stay float32."""
    torch.manual_seed(0)
    config = tiny_config(tok)
    actor = load_causal_lm(config, device="cuda")
    critic = load_value_model(config, device="cuda")
    batch = _rollout(tok, actor, n=4, generator=torch.Generator("cuda").manual_seed(0), temperature=0.8)
    assert batch["responses"].is_cuda and batch["rollout_log_probs"].dtype == torch.float32
    old = compute_log_probs(actor, batch, 0.8, micro_batch_size=3)
    assert old.dtype == torch.float32
    diff = (old - batch["rollout_log_probs"]).abs()[batch["response_mask"].bool()]
    assert diff.max().item() <= 0.05 and diff.mean().item() <= 0.01
    values = compute_values(critic, batch)
    assert values.dtype == torch.float32 and values.is_cuda
    alone = _rollout(tok, actor, prompts=["7*8="], do_sample=False, generator=None)
    padded = _rollout(tok, actor, prompts=["hello, world: 5+5=", "7*8="], do_sample=False, generator=None)
    # bf16 rounding may flip a near-tie argmax; compare the common prefix, which must be non-empty.
    same = (alone["responses"][0] == padded["responses"][1][: alone["responses"].shape[1]]).long().cumprod(0)
    n = int(same.sum())
    assert n >= 1
    lp_alone = compute_log_probs(actor, alone, 1.0)[0, :n]
    lp_padded = compute_log_probs(actor, padded, 1.0)[1, :n]
    torch.testing.assert_close(lp_padded, lp_alone, rtol=0, atol=0.05)


def _arch_models(tok):
    """Tiny causal LMs of every model type that may compute log-probs from hidden states."""
    from transformers import MistralConfig, Qwen3Config

    from refppo.models import FUSED_KERNEL_MODEL_TYPES

    size = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                vocab_size=len(tok), pad_token_id=tok.pad_token_id)  # fmt: skip
    configs = [tiny_config(tok, "llama", 32, 1, 2, 1), tiny_config(tok, "qwen2", 32, 1, 2, 1, tie_word_embeddings=True),
               MistralConfig(**size), Qwen3Config(**size, head_dim=16)]  # fmt: skip
    assert sorted(c.model_type for c in configs) == sorted(FUSED_KERNEL_MODEL_TYPES)
    torch.manual_seed(0)
    return [load_causal_lm(c) for c in configs]


def test_fused_log_probs_equal_the_logits_path(tok, models):
    """model.use_fused_kernels: log-probs, entropies and every trainable parameter's gradient from
    the hidden states equal those from the logits, for each supported model type (a tied head
    included), a LoRA actor and its adapter-disabled reference."""
    from refppo.models import LoraDisabledReference, add_lora, check_fused_kernels, make_reference

    batch = _rollout(tok, models[0], temperature=0.9)
    lora = add_lora(_arch_models(tok)[0], r=4)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # a trained adapter: actor and reference differ
    for model in [*_arch_models(tok), lora, make_reference(lora)]:
        check_fused_kernels(model)
        trained = [] if isinstance(model, LoraDisabledReference) else [p for p in model.parameters() if p.requires_grad]
        out = []
        for fused in (False, True):
            logp, ent = response_log_probs(model, batch, 0.9, calculate_entropy=True, fused=fused)
            grads = torch.autograd.grad((logp * 1.3 + ent).sum(), trained) if trained else ()
            out.append((logp.detach(), ent.detach(), *grads))
        assert len(out[0]) > 2 or isinstance(model, LoraDisabledReference)
        for a, b in zip(*out):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        lora_logp = response_log_probs(lora, batch, fused=True)[0]
        ref_logp = response_log_probs(make_reference(lora), batch, fused=True)[0]
    assert (lora_logp - ref_logp).abs().max() > 1e-3, "the reference must be the adapter-disabled model"


def test_fused_kernels_refuse_models_whose_logits_are_not_the_head(tok):
    """A model whose logits are rescaled or soft-capped after the LM head is refused, by name,
    and the trainer refuses it before any work."""
    from transformers import CohereConfig, Gemma2Config

    from refppo.config import Config, apply_overrides, validate
    from refppo.models import check_fused_kernels
    from refppo.trainer import PPOTrainer

    size = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                vocab_size=len(tok), pad_token_id=tok.pad_token_id, head_dim=16)  # fmt: skip
    for config in (Gemma2Config(**size), CohereConfig(**size)):
        with pytest.raises(ValueError, match=f"the actor is '{config.model_type}'.*use_fused_kernels=false"):
            check_fused_kernels(load_causal_lm(config))
    config = validate(apply_overrides(Config(), ["model.use_fused_kernels=true", "algorithm.adv_estimator=grpo", "rollout.n=2"]))
    records = [{"prompt": "1+1="}] * 64
    with pytest.raises(ValueError, match="gemma2"):
        PPOTrainer(config, tok, load_causal_lm(Gemma2Config(**size)), None, records, records, reward_fn=lambda *a: None)
