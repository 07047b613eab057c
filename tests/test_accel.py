"""refppo.accel.select: which path the config picks on each device, and that a run with every
accelerated path a CPU can take gives the plain run's numbers."""

import pytest
import torch
from _tolerances import reordered
from _trainers import assert_same_steps, make_trainer

from refppo.accel import StaticDecoder, select
from refppo.accel.gae import packed_gae_advantage_return
from refppo.accel.logprobs import CHUNK_ELEMENTS, BlockLogProbs
from refppo.accel.token_budget import TokenBudgetPasses
from refppo.rollout.forward import ForwardPasses, response_log_probs
from refppo.settings.config import Config, apply_overrides
from refppo.settings.validate import validate

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _select(device, *overrides):
    return select(validate(apply_overrides(Config(), list(overrides))), device)


def test_the_plain_paths_on_a_cpu():
    accel = _select(CPU)
    assert accel.actor == accel.critic == ForwardPasses() and accel.actor.log_probs is response_log_probs
    assert accel.decoder(model := object(), 64) is model
    assert accel.adv_estimators == {}


def test_the_measured_faster_paths_on_cuda():
    accel = _select(CUDA)
    assert accel.actor.log_probs == BlockLogProbs(compiled=True, fused=False, chunk_elements=CHUNK_ELEMENTS["cuda"])
    assert accel.decoder is StaticDecoder and accel.adv_estimators == {"gae": packed_gae_advantage_return}
    off = _select(CUDA, "actor.use_torch_compile=false", "rollout.cuda_graphs=false")
    assert off.actor.log_probs == BlockLogProbs(compiled=False, chunk_elements=CHUNK_ELEMENTS["cuda"])
    assert off.decoder(model := object(), 64) is model
    for python_layers in ("actor.router_replay=R3", "model.lora.rank=4"):  # no graph captures their Python
        assert _select(CUDA, python_layers).decoder(model, 64) is model


@pytest.mark.parametrize(
    "overrides, log_probs",
    [
        (["actor.use_torch_compile=true"], BlockLogProbs(compiled=True)),
        (["model.use_fused_kernels=true"], BlockLogProbs(fused=True)),
        (["model.use_fused_kernels=true", "actor.use_torch_compile=true"], BlockLogProbs(compiled=True, fused=True)),
    ],
)
def test_options_on_a_cpu(overrides, log_probs):
    accel = _select(CPU, *overrides)
    assert accel.actor.log_probs == log_probs and accel.critic.log_probs == log_probs


def test_token_budgets_per_model():
    accel = _select(CPU, "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=300")
    assert accel.actor == TokenBudgetPasses(response_log_probs, max_tokens=300) and type(accel.critic) is ForwardPasses
    accel = _select(CPU, "critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=200")
    assert type(accel.actor) is ForwardPasses and accel.critic.max_tokens == 200


def test_every_cpu_path_at_once_gives_the_plain_run():
    """Compiled log-probs from the hidden states, token-budget micro-batches and activation
    checkpointing in both models: 3 steps, each from the plain run's weights, with the plain run's
    metrics and gradients to float32 rounding (the blocks and micro-batches sum in other orders)."""
    settings = ["algorithm.use_kl_in_reward=true", "actor.entropy_coeff=0.01", "data.max_response_length=6"]
    settings.append("actor.ppo_mini_batch_size=16")  # one optimiser step a model a step
    fast = [
        "actor.use_torch_compile=true",
        "model.use_fused_kernels=true",
        "actor.use_dynamic_bsz=true",
        "actor.ppo_max_token_len_per_gpu=40",
        "critic.use_dynamic_bsz=true",
        "critic.ppo_max_token_len_per_gpu=40",
        "model.enable_gradient_checkpointing=true",
        "critic.model.enable_gradient_checkpointing=true",
    ]
    plain, accelerated = make_trainer(settings), make_trainer([*settings, *fast])
    assert accelerated.accel != plain.accel
    # The longest sum: a log-softmax over the 50-token vocabulary, then a mean over a mini-batch's
    # 16 x 6 = 96 tokens (146 terms); the averaged values (log-probs, entropies, values) are < 10.
    assert_same_steps(plain, accelerated, steps=3, rel=reordered(50 + 96), scale=10)
