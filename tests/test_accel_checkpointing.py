from collections import Counter

import pytest
import torch
from _inputs import attention_calls, rollout

from refppo.accel.checkpointing import enable_gradient_checkpointing
from refppo.rollout.forward import response_log_probs, response_values
from refppo.rollout.models import add_lora, load_causal_lm, load_value_model, tiny_config


def test_checkpointed_recomputation_leaves_cudnn_attention_out(tok):
    """With activation checkpointing the backward pass recomputes each layer's attention outside
    the forward's context: that recomputation leaves cuDNN's kernel out too, for the actor and
    the critic alike."""
    torch.manual_seed(0)
    config = tiny_config(tok)
    actor, critic = load_causal_lm(config), load_value_model(config)
    batch = rollout(tok, actor)
    for model in (actor, critic):
        enable_gradient_checkpointing(model)
        model.train()
    log_probs, _ = response_log_probs(actor, batch)
    values = response_values(critic, batch)
    with attention_calls([actor, critic], lambda *_: torch.backends.cuda.cudnn_sdp_enabled()) as seen:
        (log_probs.sum() + values.sum()).backward()
    assert seen == [False] * 2 * config.num_hidden_layers, "every layer recomputed, none with cuDNN"
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.parametrize("kind", ["causal LM", "LoRA actor", "scalar head"])
def test_gradient_checkpointing_recomputes_each_layer_for_the_same_gradients(tok, kind):
    """enable_gradient_checkpointing: a backward pass recomputes each decoder layer's forward
    (two calls per layer), the gradients equal the plain model's bit for bit, and a pass in eval
    mode runs each layer once."""

    def build():
        torch.manual_seed(0)
        config = tiny_config(tok, num_hidden_layers=2)
        model = load_value_model(config) if kind == "scalar head" else load_causal_lm(config)
        return add_lora(model, r=4) if kind == "LoRA actor" else model

    ids = torch.tensor([[0, 0, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    mask = (ids != 0).long()  # a padded row: the passes carry a mask
    grads, calls = [], []
    for checkpointed in (False, True):
        model = build()
        if checkpointed:
            enable_gradient_checkpointing(model)
        model.train()
        with attention_calls([model], lambda layer, _: id(layer)) as trained:
            model(input_ids=ids, attention_mask=mask, use_cache=False).logits.square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        model.eval()
        with torch.no_grad(), attention_calls([model], lambda layer, _: id(layer)) as evaluated:
            model(input_ids=ids, attention_mask=mask, use_cache=False)
        calls.append([sorted(Counter(seen).values()) for seen in (trained, evaluated)])  # calls per layer
    assert calls == [[[1, 1], [1, 1]], [[2, 2], [1, 1]]]
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_gradient_checkpointing_refused_by_a_model_without_it(tok):
    model = load_causal_lm(tiny_config(tok))
    model.supports_gradient_checkpointing = False
    with pytest.raises(
        ValueError, match=r"critic.model.enable_gradient_checkpointing=true, but LlamaForCausalLM does not support"
    ):
        enable_gradient_checkpointing(model, "critic.model.enable_gradient_checkpointing")
