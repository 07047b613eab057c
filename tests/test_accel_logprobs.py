import math

import pytest
import torch
from _inputs import attention_calls, rollout

from refppo.accel.logprobs import BlockLogProbs, check_fused_kernels, chunked_logprobs, fused_logprobs
from refppo.rollout.forward import response_log_probs
from refppo.rollout.models import load_causal_lm, tiny_config


def ref_log_softmax(row, temperature):
    """Plain float64 log-softmax of one list of logits."""
    z = [x / temperature for x in row]
    mx = max(z)
    lse = mx + math.log(sum(math.exp(x - mx) for x in z))
    return [x - lse for x in z]


@pytest.mark.parametrize("chunk_size", [1, 3, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_match_plain_loops(chunk_size, temperature):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen) * 3
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    logp, ent = chunked_logprobs(logits, labels, temperature, True, chunk_size)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == (3, 5)
    for i in range(3):
        for t in range(5):
            ls = ref_log_softmax(logits[i, t].tolist(), temperature)
            assert logp[i, t].item() == pytest.approx(ls[int(labels[i, t])], abs=1e-5)
            assert ent[i, t].item() == pytest.approx(-sum(math.exp(x) * x for x in ls), abs=1e-5)
    assert torch.equal(chunked_logprobs(logits, labels, temperature, False, chunk_size)[0], logp)


@pytest.mark.parametrize("chunk_size", [1, 4, None])
def test_gradients_match_float64_autograd(chunk_size):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 7, 13, generator=gen) * 2).requires_grad_()
    labels = torch.randint(0, 13, (2, 7), generator=gen)
    w1, w2 = torch.randn(2, 7, generator=gen), torch.randn(2, 7, generator=gen)
    logp, ent = chunked_logprobs(logits, labels, 0.8, True, chunk_size)
    ((logp * w1).sum() + (ent * w2).sum()).backward()

    x = logits.detach().double().requires_grad_()
    ls = torch.log_softmax(x / 0.8, dim=-1)
    ref_logp = ls.gather(-1, labels[..., None]).squeeze(-1)
    ref_ent = -(ls.exp() * ls).sum(-1)
    ((ref_logp * w1.double()).sum() + (ref_ent * w2.double()).sum()).backward()
    torch.testing.assert_close(logits.grad.double(), x.grad, atol=1e-5, rtol=1e-5)

    # Each output alone: the other output's gradient is zero (or, without entropy, absent).
    z1 = logits.detach().clone().requires_grad_()
    chunked_logprobs(z1, labels)[0].sum().backward()
    z2 = logits.detach().clone().requires_grad_()
    chunked_logprobs(z2, labels, calculate_entropy=True)[1].sum().backward()
    y = logits.detach().double().requires_grad_()
    ly = torch.log_softmax(y, dim=-1)
    g_logp = torch.autograd.grad(ly.gather(-1, labels[..., None]).sum(), y, retain_graph=True)[0]
    g_ent = torch.autograd.grad(-(ly.exp() * ly).sum(), y)[0]
    torch.testing.assert_close(z1.grad.double(), g_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(z2.grad.double(), g_ent, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_an_unused_output_costs_no_backward_work(monkeypatch, fused):
    """Entropy computed (for a log) but not in the loss: its gradient is never formed (the
    backward gets None, not zeros) and the log-probs' gradient is bit for bit the one without
    entropy; the other way round, the entropy's gradient alone matches float64 autograd."""
    import refppo.accel.logprobs as F

    seen = []
    plain = F._chunked_grads

    def spy(scaled, labels, grad_logp, grad_ent, *args):
        seen.append((grad_logp is None, grad_ent is None))
        return plain(scaled, labels, grad_logp, grad_ent, *args)

    monkeypatch.setattr(F, "_chunked_grads", spy)
    gen = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(2, 7, 6, generator=gen), torch.randn(13, 6, generator=gen)
    labels = torch.randint(0, 13, (2, 7), generator=gen)

    def grads(entropy: bool, use: int):
        x = (hidden if fused else hidden @ weight.T).detach().clone().requires_grad_()
        out = (
            fused_logprobs(x, weight, labels, 0.8, entropy, 3)
            if fused
            else chunked_logprobs(x, labels, 0.8, entropy, 3)
        )
        out[use].sum().backward()
        return x.grad

    without = grads(False, 0)
    with_unused_entropy = grads(True, 0)
    assert seen == [(False, True), (False, True)]
    assert torch.equal(with_unused_entropy, without)
    entropy_only = grads(True, 1)
    assert seen[-1] == (True, False)
    h = (hidden if fused else hidden @ weight.T).double().requires_grad_()
    ls = torch.log_softmax((h @ weight.double().T if fused else h) / 0.8, dim=-1)
    (ref,) = torch.autograd.grad(-(ls.exp() * ls).sum(), h)
    torch.testing.assert_close(entropy_only.double(), ref, atol=1e-5, rtol=1e-5)


def test_bf16_logits_give_float32_outputs_and_bf16_grads():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 9, generator=gen).bfloat16().requires_grad_()
    labels = torch.randint(0, 9, (4,), generator=gen)
    logp = chunked_logprobs(logits, labels)[0]
    assert logp.dtype == torch.float32
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref = torch.log_softmax(logits.detach().double(), -1).gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(logp.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk_size", [1, 4, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_logprobs_match_float64_autograd(chunk_size, temperature):
    """The LM head fused into the log-softmax: values and gradients (to the hidden states and to
    the head's weight) of a plain float64 log_softmax(hidden @ weight.T / temperature)."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 7, 6, generator=gen).requires_grad_()
    weight = torch.randn(13, 6, generator=gen).requires_grad_()
    labels = torch.randint(0, 13, (2, 7), generator=gen)
    w1, w2 = torch.randn(2, 7, generator=gen), torch.randn(2, 7, generator=gen)
    logp, ent = fused_logprobs(hidden, weight, labels, temperature, True, chunk_size)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == (2, 7)
    ((logp * w1).sum() + (ent * w2).sum()).backward()

    h, w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ls = torch.log_softmax(h @ w.T / temperature, dim=-1)
    ref_logp, ref_ent = ls.gather(-1, labels[..., None]).squeeze(-1), -(ls.exp() * ls).sum(-1)
    g_h, g_w = torch.autograd.grad(ref_logp.sum(), (h, w), retain_graph=True)
    ((ref_logp * w1.double()).sum() + (ref_ent * w2.double()).sum()).backward()
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden.grad.double(), h.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w.grad, atol=1e-5, rtol=1e-5)
    # Without entropy: the same log-probs, and the log-probs' gradient alone.
    h2, w2_ = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    fused_logprobs(h2, w2_, labels, temperature, False, chunk_size)[0].sum().backward()
    torch.testing.assert_close(h2.grad.double(), g_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w2_.grad.double(), g_w, atol=1e-5, rtol=1e-5)


def test_fused_logprobs_frozen_head_and_bf16():
    """A frozen head (a LoRA actor's) gets no gradient and the hidden states still get theirs;
    bf16 inputs give float32 log-probs equal to those of the bf16 logits, bf16 gradients."""
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(5, 8, generator=gen).requires_grad_()
    weight = torch.randn(9, 8, generator=gen)
    labels = torch.randint(0, 9, (5,), generator=gen)
    fused_logprobs(hidden, weight, labels, chunk_size=2)[0].sum().backward()
    h = hidden.detach().double().requires_grad_()
    torch.log_softmax(h @ weight.double().T, -1).gather(-1, labels[:, None]).sum().backward()
    torch.testing.assert_close(hidden.grad.double(), h.grad, atol=1e-5, rtol=1e-5)

    hb, wb = hidden.detach().bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    logp = fused_logprobs(hb, wb, labels, chunk_size=2)[0]
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, chunked_logprobs(hb.detach() @ wb.detach().T, labels)[0], atol=0, rtol=0)
    logp.sum().backward()
    assert hb.grad.dtype == wb.grad.dtype == torch.bfloat16
    h, w = hb.detach().double().requires_grad_(), wb.detach().double().requires_grad_()
    torch.log_softmax(h @ w.T, -1).gather(-1, labels[:, None]).sum().backward()
    torch.testing.assert_close(hb.grad.double(), h.grad, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(wb.grad.double(), w.grad, atol=2e-2, rtol=2e-2)


def test_fused_logprobs_under_autocast_use_its_dtype():
    """Under autocast (bf16 on CUDA; checked here with the CPU's) the head's products run in the
    autocast dtype, as the LM head's own would: the log-probs equal those of the autocast logits,
    the gradients keep the inputs' float32."""
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(6, 8, generator=gen).requires_grad_()
    weight = torch.randn(11, 8, generator=gen).requires_grad_()
    labels = torch.randint(0, 11, (6,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = fused_logprobs(hidden, weight, labels, chunk_size=4)[0]
        logits = hidden @ weight.T
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(fused, chunked_logprobs(logits.detach(), labels)[0], atol=0, rtol=0)
    assert (fused - fused_logprobs(hidden, weight, labels)[0]).abs().max() > 1e-4, "float32 would differ"
    fused.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32


def test_fused_logprobs_hold_no_whole_logits():
    """Peak memory of forward + backward: the fused version never holds (rows, vocab) logits,
    the LM head followed by the chunked log-softmax does (and their gradient)."""
    from refppo.guards.memory import PeakMeter

    gen = torch.Generator().manual_seed(5)
    rows, width, vocab = 2048, 16, 4096
    hidden = torch.randn(rows, width, generator=gen).requires_grad_()
    weight = torch.randn(vocab, width, generator=gen).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    logits_bytes = rows * vocab * 4
    peaks = {}
    for name, fn in {
        "head then log-softmax": lambda: chunked_logprobs(hidden @ weight.T, labels, chunk_size=32)[0],
        "fused": lambda: fused_logprobs(hidden, weight, labels, chunk_size=32)[0],
    }.items():
        hidden.grad = weight.grad = None
        with PeakMeter() as meter:
            fn().sum().backward()
        peaks[name] = meter.peak
    assert peaks["head then log-softmax"] >= 2 * logits_bytes  # the logits and their gradient
    assert peaks["fused"] < logits_bytes / 8, peaks


def test_compiled_blocks_match_float64_and_replace_the_eager_ones(compiled_kernel_calls):
    """compiled=True (torch.compile's kernels, as actor.use_torch_compile runs them): the
    log-probs, entropies and both gradients of a plain float64 log-softmax, over blocks with a
    remainder, for float32 and bf16 logits and through the fused head; every block goes through
    the compiled functions, and with compiled=False none does."""
    calls = compiled_kernel_calls
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(3, 5, 11, generator=gen) * 3).requires_grad_()
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    w1, w2 = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    logp, ent = chunked_logprobs(logits, labels, 0.7, True, 4, compiled=True)
    ((logp * w1).sum() + (ent * w2).sum()).backward()
    assert calls == ["forward"] * 4 + ["backward"] * 4, calls  # 15 rows in blocks of 4
    x = logits.detach().double().requires_grad_()
    ls = torch.log_softmax(x / 0.7, dim=-1)
    ref_logp, ref_ent = ls.gather(-1, labels[..., None]).squeeze(-1), -(ls.exp() * ls).sum(-1)
    ((ref_logp * w1.double()).sum() + (ref_ent * w2.double()).sum()).backward()
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits.grad.double(), x.grad, atol=1e-5, rtol=1e-5)

    calls.clear()
    eager = chunked_logprobs(logits.detach(), labels, 0.7, True, 4)
    assert calls == []
    torch.testing.assert_close(eager, (logp.detach(), ent.detach()), atol=1e-5, rtol=1e-5)

    # bf16 logits: float32 log-probs of the bf16 values, a bf16 gradient
    xb = logits.detach().bfloat16().requires_grad_()
    logp_b = chunked_logprobs(xb, labels, compiled=True)[0]
    logp_b.sum().backward()
    assert logp_b.dtype == torch.float32 and xb.grad.dtype == torch.bfloat16
    y = xb.detach().double().requires_grad_()
    ref_b = torch.log_softmax(y, -1).gather(-1, labels[..., None]).squeeze(-1)
    ref_b.sum().backward()
    torch.testing.assert_close(logp_b.double(), ref_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(xb.grad.double(), y.grad, atol=1e-2, rtol=1e-2)

    # through the fused head: the gradients of the hidden states and of the head's weight
    calls.clear()
    hidden = torch.randn(3, 5, 6, generator=gen).requires_grad_()
    weight = torch.randn(11, 6, generator=gen).requires_grad_()
    logp, ent = fused_logprobs(hidden, weight, labels, 0.7, True, 4, compiled=True)
    ((logp * w1).sum() + (ent * w2).sum()).backward()
    assert calls == ["forward"] * 4 + ["backward"] * 4, calls
    h, w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ls = torch.log_softmax(h @ w.T / 0.7, dim=-1)
    (
        (ls.gather(-1, labels[..., None]).squeeze(-1) * w1.double()).sum()
        + (-(ls.exp() * ls).sum(-1) * w2.double()).sum()
    ).backward()
    torch.testing.assert_close(hidden.grad.double(), h.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_compiled_blocks_on_cuda_match_float64():
    """compiled=True on CUDA (Triton kernels) with bf16 logits of a real vocabulary's width: the
    float32 log-probs and entropies of float64, and a bf16 gradient within bf16 rounding."""
    gen = torch.Generator().manual_seed(8)
    logits = (torch.randn(1000, 32000, generator=gen) * 2).bfloat16().cuda().requires_grad_()
    labels = torch.randint(0, 32000, (1000,), generator=gen).cuda()
    w = torch.randn(1000, generator=gen).cuda()
    logp, ent = chunked_logprobs(logits, labels, 0.7, True, compiled=True)
    ((logp * w).sum() + ent.sum()).backward()
    x = logits.detach().double().requires_grad_()
    ls = torch.log_softmax(x / 0.7, dim=-1)
    ref_logp, ref_ent = ls.gather(-1, labels[:, None]).squeeze(-1), -(ls.exp() * ls).sum(-1)
    ((ref_logp * w.double()).sum() + ref_ent.sum()).backward()
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-4, rtol=1e-4)
    assert logits.grad.dtype == torch.bfloat16
    assert float((logits.grad.double() - x.grad).norm() / x.grad.norm()) < 1e-2


def test_bad_hidden_inputs():
    h, w, y = torch.randn(2, 3, 4), torch.randn(7, 4), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="weight"):
        fused_logprobs(h, torch.randn(7, 5), y)
    with pytest.raises(ValueError, match="labels"):
        fused_logprobs(h, w, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        fused_logprobs(h, w, y, temperature=-1.0)


def _arch_models(tok):
    """Tiny causal LMs of every model type that may compute log-probs from hidden states."""
    from transformers import MistralConfig, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    from refppo.accel.logprobs import FUSED_KERNEL_MODEL_TYPES

    size = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
    )
    configs = [
        tiny_config(tok, "llama", 32, 1, 2, 1),
        tiny_config(tok, "qwen2", 32, 1, 2, 1, tie_word_embeddings=True),
        MistralConfig(**size),
        Qwen3Config(**size, head_dim=16),
        Qwen2MoeConfig(**size, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4),
        Qwen3MoeConfig(**size, head_dim=16, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2),
    ]
    assert sorted(c.model_type for c in configs) == sorted(FUSED_KERNEL_MODEL_TYPES)
    torch.manual_seed(0)
    return [load_causal_lm(c) for c in configs]


def test_fused_log_probs_equal_the_logits_path(tok, models):
    """model.use_fused_kernels: log-probs, entropies and every trainable parameter's gradient from
    the hidden states equal those from the logits, for each supported model type (a tied head
    included), a LoRA actor and its adapter-disabled reference."""
    from refppo.rollout.models import LoraDisabledReference, add_lora, make_reference

    batch = rollout(tok, models[0], temperature=0.9)
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
            log_probs_fn = BlockLogProbs(fused=True) if fused else response_log_probs
            logp, ent = log_probs_fn(model, batch, 0.9, True)
            grads = torch.autograd.grad((logp * 1.3 + ent).sum(), trained) if trained else ()
            out.append((logp.detach(), ent.detach(), *grads))
        assert len(out[0]) > 2 or isinstance(model, LoraDisabledReference)
        for a, b in zip(*out):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        lora_logp = BlockLogProbs(fused=True)(lora, batch)[0]
        ref_logp = BlockLogProbs(fused=True)(make_reference(lora), batch)[0]
    assert (lora_logp - ref_logp).abs().max() > 1e-3, "the reference must be the adapter-disabled model"


def test_fused_kernels_refuse_models_whose_logits_are_not_the_head(tok):
    """A model whose logits are rescaled or soft-capped after the LM head is refused, by name,
    and the trainer refuses it before any work."""
    from transformers import CohereConfig, Gemma2Config

    from refppo.settings.config import Config, apply_overrides
    from refppo.settings.validate import validate
    from refppo.training.trainer import PPOTrainer

    size = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        head_dim=16,
    )
    for config in (Gemma2Config(**size), CohereConfig(**size)):
        with pytest.raises(ValueError, match=f"the actor is '{config.model_type}'.*use_fused_kernels=false"):
            check_fused_kernels(load_causal_lm(config))
    config = validate(
        apply_overrides(Config(), ["model.use_fused_kernels=true", "algorithm.adv_estimator=grpo", "rollout.n=2"])
    )
    records = [{"prompt": "1+1="}] * 64
    with pytest.raises(ValueError, match="gemma2"):
        PPOTrainer(config, tok, load_causal_lm(Gemma2Config(**size)), None, records, records, reward_fn=lambda *a: None)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_block_log_probs_equal_the_plain_pass(tok, models, compiled, fused):
    """BlockLogProbs (chunked, compiled, from the hidden states) gives response_log_probs' log-probs,
    entropies and gradients to float rounding, 0 at padding."""
    actor = models[0]
    batch = rollout(tok, actor, temperature=0.9)
    out = []
    for fn in (response_log_probs, BlockLogProbs(compiled=compiled, fused=fused, chunk_elements=64 * len(tok))):
        logp, ent = fn(actor, batch, 0.9, True)
        grads = torch.autograd.grad((logp * 1.3 + ent).sum(), list(actor.parameters()))
        out.append((logp.detach(), ent.detach(), *grads))
    for a, b in zip(*out):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert (out[1][0][batch["response_mask"] == 0] == 0).all()


def test_block_passes_leave_cudnn_attention_out(tok, models):
    """The fused pass may be backpropagated too: its attention runs without cuDNN's kernel."""
    actor = models[0]
    batch = rollout(tok, actor)
    with attention_calls([actor], lambda *_: torch.backends.cuda.cudnn_sdp_enabled()) as seen:
        BlockLogProbs(fused=True)(actor, batch)
    assert seen == [False] * actor.config.num_hidden_layers
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.parametrize(
    "call, problem",
    [
        (lambda x, w, y: chunked_logprobs(x @ w.T, y, chunk_size=0), "chunk_size must be None or a whole number >= 1"),
        (lambda x, w, y: chunked_logprobs(x @ w.T, y, chunk_size=-1), "chunk_size must be None or a whole number"),
        (lambda x, w, y: chunked_logprobs(x @ w.T, y, chunk_size=2.0), "chunk_size must be None or a whole number"),
        (lambda x, w, y: chunked_logprobs(x @ w.T, y + 5), r"labels has an id outside \[0, 5\)"),
        (lambda x, w, y: chunked_logprobs((x @ w.T).fill_(math.nan), y), "picked from the logits contains NaN"),
        (lambda x, w, y: fused_logprobs(x, w, y, chunk_size=0), "chunk_size must be None or a whole number"),
        (lambda x, w, y: fused_logprobs(x, w, y + 5), r"labels has an id outside \[0, 5\)"),
        (lambda x, w, y: fused_logprobs(x, w, y.double()), "labels must be integer token ids"),
        (lambda x, w, y: fused_logprobs(x.to("meta"), w.to("meta"), y.to("meta")), "hidden is on the meta device"),
        (lambda x, w, y: fused_logprobs(x, w.to("meta"), y), "weight is on meta"),
        (lambda x, w, y: fused_logprobs(x, w, y, temperature=0.0), r"temperature must be in \[1e-6, inf\)"),
        (lambda x, w, y: fused_logprobs(x.fill_(math.inf), w, y), "picked from the logits contains NaN or inf"),
    ],
)
def test_bad_input_to_the_block_functions_is_a_value_error(call, problem):
    """The accelerated log-prob functions keep the core's promise: a ValueError naming the problem,
    never a torch error, uninitialised memory or a NaN."""
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 3, 4, generator=gen), torch.randn(5, 4, generator=gen)
    labels = torch.randint(0, 5, (2, 3), generator=gen)
    with pytest.raises(ValueError, match=problem):
        call(hidden, weight, labels)
