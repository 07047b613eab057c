import math
from types import SimpleNamespace

import pytest
import torch
from _inputs import attention_calls, rollout
from _trainers import make_trainer

from refppo.accel.decoding import (
    DECODE_ATTENTION,
    StaticDecoder,
    _static_cache_class,
    decode_attention,
    grouped_decode_attention,
)
from refppo.rollout.forward import compute_log_probs
from refppo.rollout.generation import cache_argument
from refppo.rollout.models import add_lora, load_causal_lm, tiny_config


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_static_cache_decoding_equals_the_growing_cache(tok, arch):
    """The static-cache step (here eager: compiling it is the GPU test's job) samples the same
    tokens with the same log-probs, and a reused cache starts clean."""
    torch.manual_seed(0)
    actor = load_causal_lm(tiny_config(tok, arch))
    kw = dict(n=3, temperature=0.9, generator=torch.Generator().manual_seed(3))
    eager = rollout(tok, actor, **kw)
    decoder = StaticDecoder(actor, 32, compile=False)
    for _ in range(2):
        static = rollout(tok, decoder, **kw | {"generator": torch.Generator().manual_seed(3)})
        for key in eager:
            assert torch.equal(static[key], eager[key]) or key == "rollout_log_probs", key
        torch.testing.assert_close(static["rollout_log_probs"], eager["rollout_log_probs"], rtol=0, atol=1e-5)
    assert len(decoder._caches) == 1
    # Under bf16 autocast (as on CUDA) keys leave the rotary embedding in float32, values in bf16.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = rollout(tok, actor, do_sample=False, generator=None)
        static = rollout(tok, decoder, do_sample=False, generator=None)
    assert torch.equal(static["responses"], eager["responses"])
    torch.testing.assert_close(static["rollout_log_probs"], eager["rollout_log_probs"], rtol=0, atol=0.02)
    with pytest.raises(ValueError, match="33 tokens do not fit the decoder's 32 cache slots"):
        rollout(tok, StaticDecoder(actor, 32, compile=False), max_new_tokens=40, ignore_eos=True)


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
    torch.testing.assert_close(
        unmasked.double(), _plain_attention(query, key, value, torch.ones_like(mask), 0.3), rtol=0, atol=1e-5
    )


def _length_and_attention(layer, kwargs):
    return kwargs["hidden_states"].shape[1], layer.config._attn_implementation


def test_static_decoding_uses_the_grouped_attention_and_restores_the_model(tok):
    """Every attention call of generate through a StaticDecoder (the prompt and each new token)
    runs under the grouped decode attention, a LoRA actor's too; afterwards, or after an error
    inside, the model is back on SDPA. A model on eager attention is left alone."""
    torch.manual_seed(0)
    actor = load_causal_lm(tiny_config(tok))
    with attention_calls([actor], _length_and_attention) as calls:
        batch = rollout(tok, StaticDecoder(actor, 32, compile=False), max_new_tokens=5, ignore_eos=True)
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
        rollout(tok, StaticDecoder(lora, 32, compile=False), max_new_tokens=2)
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
        input_ids=torch.full((rows, 1), 5),
        attention_mask=torch.ones(rows, slots, dtype=torch.long),
        position_ids=torch.full((rows, 1), 2),
        cache_position=torch.tensor([2]),
        use_cache=True,
    )
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


@pytest.mark.gpu
def test_cuda_graph_decoding(tok):
    """A compiled static-cache decoder on CUDA: its responses' log-probs recomputed by a full
    forward pass agree to bf16 noise, and greedy decoding matches the eager decoder's."""
    torch.manual_seed(0)
    actor = load_causal_lm(tiny_config(tok, "qwen2"), device="cuda")
    decoder = StaticDecoder(actor, 32)
    for _ in range(2):  # the second call replays the recorded graphs
        batch = rollout(tok, decoder, n=4, generator=torch.Generator("cuda").manual_seed(0))
        diff = (compute_log_probs(actor, batch) - batch["rollout_log_probs"]).abs()[batch["response_mask"].bool()]
        assert diff.max().item() <= 0.05 and diff.mean().item() <= 0.01
    greedy = dict(do_sample=False, generator=None)
    eager, graphs = rollout(tok, actor, **greedy), rollout(tok, decoder, **greedy)
    same = (eager["responses"] == graphs["responses"]).all(dim=1).float().mean().item()
    assert same >= 0.75, f"only {same:.0%} of greedy responses match the eager decoder's"
