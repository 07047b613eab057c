"""refppo.accel.compiled_layers: compiled decoder layers give the eager layers' log-probs, values
and gradients, one graph serves every layer, and generation keeps the eager forward."""

from types import SimpleNamespace

import pytest
import torch
import torch._dynamo.utils
from _inputs import ragged_batch, rollout
from _tolerances import reordered
from _trainers import assert_same_steps, make_trainer

from refppo.accel import StaticDecoder, compiled_models
from refppo.accel.compiled_layers import CompiledForward, compile_layers, eager_layers
from refppo.rollout.forward import response_log_probs, response_values
from refppo.rollout.models import add_lora, load_causal_lm, load_value_model, make_reference, tiny_config
from refppo.settings.config import Config, apply_overrides
from refppo.settings.validate import validate


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _pair(tok, kind):
    """Two copies of one model of ``kind``, 3 layers."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        config = tiny_config(tok, num_hidden_layers=3)
        model = load_value_model(config) if kind == "scalar head" else load_causal_lm(config)
        if kind == "LoRA actor":
            model = add_lora(model, r=4)
            for name, p in model.named_parameters():  # LoRA's B starts at 0: give it a gradient to compare
                if "lora_B" in name:
                    torch.nn.init.normal_(p, std=0.1)
        models.append(model)
    return models


def _pass(model, batch):
    out = response_values(model, batch) if hasattr(model, "score") else response_log_probs(model, batch)[0]
    return out * batch["response_mask"]


@pytest.mark.parametrize("kind", ["causal LM", "LoRA actor", "scalar head"])
def test_compiled_layers_give_the_eager_outputs_and_gradients(tok, kind):
    """A ragged batch's log-probs (or values) and every gradient equal the eager model's to
    float32 rounding; each layer runs compiled."""
    eager, compiled = _pair(tok, kind)
    compile_layers(compiled)
    for model in (eager, compiled):
        model.train()
    batch = ragged_batch(tok)
    a, b = _pass(eager, batch), _pass(compiled, batch)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    a.square().sum().backward()
    b.square().sum().backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        if p.requires_grad:  # float32 rounding, relative to the gradient's norm (fused sums reorder)
            assert (q.grad - p.grad).norm() <= 1e-5 * p.grad.norm(), name
    layers = compiled.base_model.model.model.layers if kind == "LoRA actor" else compiled.model.layers
    assert all(isinstance(layer.forward, CompiledForward) for layer in layers)


def test_one_graph_serves_every_layer_and_generation_stays_eager(tok):
    """The layers of a model share one compiled graph per kind of pass;
    ``generate`` (a KV cache) traces nothing and samples what the eager model samples; and
    :func:`eager_layers` undoes the compilation."""
    torch.manual_seed(0)
    actor = load_causal_lm(tiny_config(tok, num_hidden_layers=4))
    plain_samples = rollout(tok, actor)
    reference = make_reference(actor)
    compile_layers(actor, reference, None)
    batch = ragged_batch(tok)
    before = _graphs()
    # a user's limit of one graph per function: the layers' graphs are not held to it, nor is it changed
    with torch._dynamo.config.patch(recompile_limit=1), torch.no_grad():
        response_log_probs(actor, batch)
        response_log_probs(reference, batch)
        assert torch._dynamo.config.recompile_limit == 1
    # the frozen reference's weights need no gradient: one graph for it, one for the actor's 4 layers
    assert _graphs() - before == 2, "one graph per model, not one per layer"
    before = _graphs()
    samples = rollout(tok, actor)
    assert _graphs() == before, "generation traced nothing"
    assert torch.equal(samples["responses"], plain_samples["responses"])
    eager_layers(actor, reference)
    assert all("forward" not in layer.__dict__ for layer in actor.model.layers)


def test_a_model_without_decoder_layers_is_refused():
    with pytest.raises(ValueError, match="no decoder layers at .model.layers"):
        compile_layers(torch.nn.Linear(2, 2))


def test_a_ppo_run_with_compiled_layers_gives_the_plain_run():
    """model.compile_layers=true compiles the actor's, reference's and critic's layers, and 3 steps,
    each from the plain run's weights, give its metrics and gradients to float32 rounding."""
    settings = ["algorithm.use_kl_in_reward=true", "actor.entropy_coeff=0.01", "data.max_response_length=6"]
    settings.append("actor.ppo_mini_batch_size=16")  # one optimiser step a model a step
    plain, compiled = make_trainer(settings), make_trainer([*settings, "model.compile_layers=true"])
    for model in (compiled.actor, compiled.reference, compiled.critic):
        assert all(isinstance(layer.forward, CompiledForward) for layer in model.model.layers)
    assert all("forward" not in layer.__dict__ for layer in plain.actor.model.layers)
    # Fused kernels sum a layer's products and norms in other orders: the longest chain is a
    # 32-wide hidden state, a 50-token log-softmax and a mean over 96 tokens (as in test_accel).
    assert_same_steps(plain, compiled, steps=3, rel=reordered(32 + 50 + 96), scale=10)


@pytest.mark.parametrize("key", ["model.enable_gradient_checkpointing", "critic.model.enable_gradient_checkpointing"])
def test_compiled_layers_with_checkpointing_are_refused(key):
    with pytest.raises(ValueError, match=f"model.compile_layers=true cannot compile the layers that {key}=true"):
        validate(apply_overrides(Config(), ["model.compile_layers=true", f"{key}=true"]))


@pytest.mark.gpu
def test_compiled_layers_on_cuda(tok):
    """On CUDA under autocast: a ragged batch's log-probs and gradients agree with the eager
    layers' to bf16 noise, and a CUDA-graph decoder over compiled layers (whose cached passes stay
    eager) decodes greedily what the eager model decodes."""
    torch.manual_seed(0)
    config = tiny_config(tok, "qwen2", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    eager, compiled = load_causal_lm(config, device="cuda"), load_causal_lm(config, device="cuda")
    compiled.load_state_dict(eager.state_dict())
    compile_layers(compiled)
    batch = {k: v.cuda() for k, v in ragged_batch(tok).items()}
    grads = []
    for model in (eager, compiled):
        model.train()
        log_probs, _ = response_log_probs(model, batch)
        (log_probs * batch["response_mask"]).sum().backward()
        grads.append(torch.cat([p.grad.flatten().float() for p in model.parameters()]))
        model.eval()
    assert (grads[1] - grads[0]).norm() <= 2e-2 * grads[0].norm()
    greedy = dict(do_sample=False, generator=None)
    plain, graphs = rollout(tok, eager, **greedy), rollout(tok, StaticDecoder(compiled, 32), **greedy)
    same = (plain["responses"] == graphs["responses"]).all(dim=1).float().mean().item()
    assert same >= 0.75, f"only {same:.0%} of greedy responses match the eager model's"


def test_which_models_compile():
    """compiled_models: all four with model.compile_layers=true; a checkpointed model's layers,
    everything under torchrun, and everything on a CPU by default stay eager."""
    actor, reference, critic, reward_model = (SimpleNamespace(device=torch.device("cpu")) for _ in range(4))
    models = (actor, reference, critic, reward_model)

    def chosen(*overrides, distributed=False):
        config = apply_overrides(Config(), ["model.compile_layers=true", *overrides])  # unvalidated combinations
        return {id(m) for m in compiled_models(config, *models, distributed=distributed) if m is not None}

    assert chosen() == {id(m) for m in models}
    assert chosen("model.enable_gradient_checkpointing=true") == {id(critic), id(reward_model)}
    assert chosen("critic.model.enable_gradient_checkpointing=true") == {id(actor), id(reference), id(reward_model)}
    # layers that run in Python: the routers under router replay, Megatron's experts adapters
    assert chosen("actor.router_replay=R2") == chosen("model.lora.rank=4") == {id(critic), id(reward_model)}
    assert chosen(distributed=True) == set() and chosen("model.compile_layers=null") == set()
