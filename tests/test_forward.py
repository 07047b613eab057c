import math
import os
import subprocess
import sys

import pytest
import torch
from _inputs import attention_calls, rollout, row_tokens

from refppo.accel.checkpointing import enable_gradient_checkpointing
from refppo.rollout.forward import (
    compute_log_probs,
    compute_scores,
    compute_values,
    micro_batches,
    response_log_probs,
    response_scores,
    response_values,
)
from refppo.rollout.models import load_causal_lm, tiny_config
from refppo.rollout.prompts import sequence_batch

FILTERED = dict(temperature=0.7, top_k=8, top_p=0.9, n=3)


@pytest.mark.parametrize(
    "kw",
    [dict(temperature=1.0), dict(FILTERED, logprobs_mode="raw_logprobs"), dict(temperature=1.3, do_sample=False)],
)
def test_first_ratio_is_one(tok, models, kw):
    """Recomputed old log-probs equal the rollout's (CPU float32), at any micro-batch size: with
    top-k and top-p, the rollout's raw_logprobs (its default, processed_logprobs, are renormalised
    over the kept tokens, as vLLM's: never below the recomputed ones, and above where a token was cut)."""
    actor = models[0]
    batch = rollout(tok, actor, **kw)
    for mbs in (None, 1, 5):
        old = compute_log_probs(actor, batch, kw["temperature"], micro_batch_size=mbs)
        assert (old - batch["rollout_log_probs"]).abs().max().item() <= 1e-5
    assert torch.all(batch["rollout_log_probs"][batch["response_mask"] == 0] == 0)
    if "logprobs_mode" in kw:
        processed = rollout(tok, actor, **FILTERED)
        old = compute_log_probs(actor, processed, FILTERED["temperature"])
        gap = (processed["rollout_log_probs"] - old)[processed["response_mask"] == 1]
        assert gap.min().item() >= -1e-5 and gap.max().item() > 1e-3


def test_a_trainable_actor_and_its_frozen_reference_give_equal_log_probs():
    """At step 0 the actor is its reference and every KL term must be exactly 0. torch picks the
    matrix-product path of a strided 3-D input by the weight's requires_grad, and MKL's AVX2
    kernels round the two paths differently, so the check runs with those kernels forced (a
    fresh process: MKL reads the setting when it loads; elsewhere the setting is ignored)."""
    code = """
import torch
from refppo.rollout.models import load_causal_lm, make_reference, tiny_config
from refppo.rollout.forward import compute_log_probs
from refppo.rollout.prompts import sequence_batch
from refppo.tasks.tokenizer import build_tokenizer
tok = build_tokenizer()
torch.manual_seed(0)
actor = load_causal_lm(tiny_config(tok, hidden_size=128))
reference = make_reference(actor)
assert all(p.requires_grad for p in actor.parameters()) and not any(p.requires_grad for p in reference.parameters())
ids = torch.randint(5, len(tok), (6, 30))
mask = torch.ones_like(ids)
mask[:2, :3] = 0
batch = sequence_batch(ids[:, :12], mask[:, :12], ids[:, 12:], torch.ones(6, 18, dtype=torch.long))
a, r = compute_log_probs(actor, batch, 1.0), compute_log_probs(reference, batch, 1.0)
print("equal" if torch.equal(a, r) else f"differ by {(a - r).abs().max().item():.1e}")
"""
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "equal"


def test_log_probs_values_scores_read_the_right_positions(tok, models):
    """Against a plain reference: each quantity from a forward pass over the unpadded prefix."""
    actor, critic, rm = models
    batch = rollout(tok, actor, temperature=0.9)
    log_probs, entropy = compute_log_probs(actor, batch, 0.9, calculate_entropy=True)
    values, scores = compute_values(critic, batch), compute_scores(rm, batch)
    with torch.no_grad():
        for i, (prompt, response) in enumerate(row_tokens(batch)):
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
        batch = rollout(tok, actor, prompts=prompts, do_sample=False, max_new_tokens=10)
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


def test_micro_batches_are_consecutive_row_slices():
    batch = {"a": torch.arange(7), "b": torch.arange(14).view(7, 2)}
    parts = micro_batches(batch, 3)
    assert [len(p["a"]) for p in parts] == [3, 3, 1]
    assert torch.equal(torch.cat([p["b"] for p in parts]), batch["b"])
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        micro_batches(batch, 0)


def test_a_response_without_a_valid_token_has_no_score(tok, models):
    batch = rollout(tok, models[0], prompts=["1+1="])
    batch["response_mask"] = torch.zeros_like(batch["response_mask"])
    with pytest.raises(ValueError, match="nothing to score"):
        compute_scores(models[2], batch)


def test_trainable_passes_leave_cudnn_attention_out(tok, models):
    """Every forward pass that may be backpropagated (log-probs, values, scores) runs
    its attention with cuDNN's kernel disabled (its backward's NaN, pytorch/pytorch#196678), and
    the setting is restored after."""
    actor, critic, reward_model = models
    batch = rollout(tok, actor)
    with attention_calls(models, lambda *_: torch.backends.cuda.cudnn_sdp_enabled()) as seen:
        response_log_probs(actor, batch)
        response_values(critic, batch)
        response_scores(reward_model, batch)
    layers = actor.config.num_hidden_layers
    assert seen == [False] * 3 * layers
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_ragged_batch_gets_finite_gradients_on_cuda(tok, checkpointed):
    """A left-padded batch 320 = 2 x 128 + 64 tokens wide, where cuDNN's attention backward
    returns NaN (pytorch/pytorch#196678): every gradient is finite and agrees with the float32
    CPU gradient to bf16 noise, with activation checkpointing (whose recomputation runs in the
    backward pass) too."""
    torch.manual_seed(0)
    config = tiny_config(
        tok, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512
    )
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
    batch = sequence_batch(prompts, prompt_mask, responses, response_mask)
    grads = []
    for model in (cpu, gpu):
        log_probs, _ = response_log_probs(model, {k: v.to(model.device) for k, v in batch.items()})
        log_probs.sum().backward()
        grads.append(torch.cat([p.grad.flatten().float().cpu() for p in model.parameters()]))
    assert torch.isfinite(grads[1]).all(), f"{int((~torch.isfinite(grads[1])).sum())} non-finite gradient entries"
    relative = float((grads[1] - grads[0]).norm() / grads[0].norm())
    assert relative < 3e-2, relative
