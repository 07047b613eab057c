"""Router replay (verl 0.9's ``router_replay.mode`` R2 and R3) on Hugging Face mixture-of-experts models.

verl's Megatron patch (``RouterReplay.get_replay_topk`` in ``verl/utils/megatron/router_replay_patch.py``)
replaces the top-k experts by the recorded ones and gathers the router's scores at them; with
Megatron's softmax routing that is the softmax over all experts at the recorded experts,
renormalised where the model renormalises its top k. R2 records in the old-log-prob pass
(``RouterReplayHelper.is_r2_record_action``) and replays in the update; R3 replays the rollout's
routes in both (``align_r3_router_replay_data``: the last generated token has none).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from refppo.rollout.forward import ForwardPasses, response_log_probs
from refppo.rollout.generation import generate
from refppo.rollout.router_replay import ROUTERS, RouterReplay, Routing, replayed_weights, replaying_passes

# each router class's module and config class in transformers
ROUTER_MODELS = {
    "Qwen2MoeTopKRouter": ("qwen2_moe", "Qwen2MoeConfig"),
    "Qwen3MoeTopKRouter": ("qwen3_moe", "Qwen3MoeConfig"),
    "Qwen3NextTopKRouter": ("qwen3_next", "Qwen3NextConfig"),
    "OlmoeTopKRouter": ("olmoe", "OlmoeConfig"),
    "Qwen3_5MoeTopKRouter": ("qwen3_5_moe", "Qwen3_5MoeTextConfig"),
    "Qwen3VLMoeTextTopKRouter": ("qwen3_vl_moe", "Qwen3VLMoeTextConfig"),
    "MixtralTopKRouter": ("mixtral", "MixtralConfig"),
}


def tiny_moe(seed: int = 0) -> Qwen3MoeForCausalLM:
    """A two-layer Qwen3-MoE of 8 experts, 2 per token, its router weights random (they start at 0)."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=64,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "Qwen3MoeTopKRouter":
                module.weight.normal_(0, 1.0)
    return model


def _batch(rows: int = 3, prompt: int = 5, response: int = 4, seed: int = 1) -> dict[str, torch.Tensor]:
    """A batch in refppo's layout, left-padded prompts and right-padded responses."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, 40, (rows, prompt), generator=generator)
    responses = torch.randint(1, 40, (rows, response), generator=generator)
    attention = torch.ones(rows, prompt + response, dtype=torch.long)
    attention[0, :2] = 0
    response_mask = torch.ones(rows, response, dtype=torch.long)
    response_mask[1, 2:] = 0
    attention[1, prompt + 2 :] = 0
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "position_ids": positions,
        "response_mask": response_mask,
    }


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_replaying_a_routers_own_experts_gives_its_own_weights(name):
    """The table's rules (renormalise, dtype) are each class's: replaying the experts a router chose
    gives back its weights bit for bit."""
    module_name, config_name = ROUTER_MODELS[name]
    module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    config = getattr(module, config_name, None) or getattr(importlib.import_module("transformers"), config_name)
    router = getattr(module, name)(config(hidden_size=16, num_experts=8, num_local_experts=8, num_experts_per_tok=3))
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
    logits, weights, experts = router(torch.randn(7, 16))
    renormalise, in_logits_dtype = ROUTERS[name]
    renormalise = getattr(router, renormalise) if isinstance(renormalise, str) else renormalise
    again = replayed_weights(logits, experts, renormalise, in_logits_dtype)
    assert again.dtype == weights.dtype and torch.equal(again, weights), name


def test_replayed_weights_are_the_softmax_at_the_given_experts():
    """Written out in float64: exp(l_e) / sum_j exp(l_j) at each given expert e, divided by their
    sum when renormalised."""
    torch.manual_seed(0)
    logits = torch.randn(5, 6, dtype=torch.float64)
    experts = torch.tensor([[0, 5], [1, 2], [3, 3], [4, 0], [2, 1]])
    plain = torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True)
    picked = torch.stack([plain[i, experts[i]] for i in range(5)])
    torch.testing.assert_close(replayed_weights(logits, experts, False, True), picked, rtol=1e-6, atol=0)
    renormed = picked / picked.sum(-1, keepdim=True)
    torch.testing.assert_close(replayed_weights(logits, experts, True, True), renormed, rtol=1e-6, atol=0)


def _experts_used(replay: RouterReplay) -> tuple[list, list]:
    """Hooks on the routers collecting the (N, k) experts each call returns, and its (logits,
    weights)."""
    experts = []
    weights = []

    def hook(module, args, output):
        weights.append((output[0].detach(), output[1].detach()))
        experts.append(output[2].detach())

    for router in replay.routers:
        router.register_forward_hook(hook)
    return experts, weights


def test_a_pass_replays_what_a_pass_recorded_after_the_weights_move():
    """R2: the experts recorded by micro-batches are laid out by row and column; replayed on the
    same weights they give the recorded pass's log-probs exactly, and after the routers move each
    router sends every token to the recorded experts, weighted by its own new softmax there."""
    model = tiny_moe()
    replay = RouterReplay(model)
    passes = replaying_passes(ForwardPasses(response_log_probs), replay)
    batch = _batch()
    with replay.recording():
        before = passes.compute_log_probs(model, batch | {"router_row": torch.arange(3)}, micro_batch_size=2)
    routes = replay.routes_of_passes(batch)
    assert routes.shape == (3, 9, 2, 2) and routes.dtype == torch.int16 and (routes >= 0).all()
    batch["routed_experts"] = routes
    with replay.replaying():
        torch.testing.assert_close(passes.compute_log_probs(model, batch, micro_batch_size=1), before, rtol=0, atol=0)
    with torch.no_grad():
        for router in replay.routers:
            router.weight.add_(torch.randn_like(router.weight))
    experts, weights = _experts_used(replay)
    native = passes.compute_log_probs(model, batch)
    native_experts = [e.clone() for e in experts]
    experts.clear()
    weights.clear()
    with replay.replaying():
        replayed = passes.compute_log_probs(model, batch)
    for layer, (used, (logits, given)) in enumerate(zip(experts, weights)):
        target = routes[:, :, layer].reshape(-1, 2).long()
        assert torch.equal(used, target), layer
        assert torch.equal(given, replayed_weights(logits, target, renormalise=True, in_logits_dtype=True)), layer
    assert any(not torch.equal(e, t) for e, t in zip(native_experts, experts)), "the moved routers choose otherwise"
    assert not torch.allclose(replayed, native)


def test_unrecorded_positions_route_as_the_model_does():
    model = tiny_moe()
    replay = RouterReplay(model)
    passes = replaying_passes(ForwardPasses(response_log_probs), replay)
    batch = _batch()
    native = passes.compute_log_probs(model, batch)
    batch["routed_experts"] = torch.full((3, 9, 2, 2), -1, dtype=torch.int16)
    with replay.replaying():
        torch.testing.assert_close(passes.compute_log_probs(model, batch), native, rtol=0, atol=0)
    batch["routed_experts"][:, :, :, :] = torch.tensor([6, 7], dtype=torch.int16)
    with replay.replaying():
        assert not torch.allclose(passes.compute_log_probs(model, batch), native)


def test_the_rollouts_routes_are_the_passes_but_the_last_token():
    """R3: the routes recorded while sampling (the prefill, then each token fed back) equal those
    of a full pass over the sampled batch at every position but the last response column."""
    model = tiny_moe()
    replay = RouterReplay(model)
    prompts = _batch()["prompts"]
    mask = torch.ones_like(prompts)
    mask[0, :2] = 0
    with replay.recording():
        batch = generate(model, prompts, mask, eos_token_id=39, pad_token_id=0, max_new_tokens=4, do_sample=False)
    rollout = replay.routes_of_rollout(batch)
    width = batch["input_ids"].shape[1]
    assert rollout.shape == (3, width, 2, 2) and (rollout[:, -1] == -1).all() and (rollout[:, :-1] >= 0).all()
    passes = replaying_passes(ForwardPasses(response_log_probs), replay)
    with replay.recording():
        passes.compute_log_probs(model, batch | {"router_row": torch.arange(3)})
    full = replay.routes_of_passes(batch)
    valid = batch["attention_mask"].bool()[:, :-1]
    assert torch.equal(rollout[:, :-1][valid], full[:, :-1][valid])


@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_sum_pi_squared_is_routed_as_the_old_log_probs(mode):
    """verl computes sum_pi_squared in the old-log-prob pass; refppo's second pass replays that
    pass's routing (R2: recorded in it; R3: the rollout's). Against one plain forward pass of the
    whole batch with every router sent to the same experts: the same log-probs and sum_v pi_v^2.
    Under R3 the rollout's routes (here drawn at random) differ from the routers' own choices."""
    model = tiny_moe()
    routing = Routing(model, mode)
    passes = routing.passes(ForwardPasses())
    batch = _batch()
    if mode == "R3":
        batch["routed_experts"] = torch.randint(0, 8, (3, 9, 2, 2), generator=torch.Generator().manual_seed(2))
        batch["routed_experts"] = batch["routed_experts"].to(torch.int16)
    with routing.old_log_prob_pass(batch) as routed:
        log_probs = passes.compute_log_probs(model, routed, 0.7, micro_batch_size=2)
    with routing.replaying():
        sum_pi_squared = passes.compute_sum_pi_squared(model, batch, 0.7, micro_batch_size=1)
    replay = routing.replay
    with torch.no_grad(), replay.replaying():
        replay.begin(batch)
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    mask = batch["response_mask"].bool()
    probs = (logits.logits[:, 4:-1].double() / 0.7).softmax(-1)
    expected_log_probs = probs.log().gather(-1, batch["responses"][..., None])[..., 0] * mask
    torch.testing.assert_close(log_probs.double(), expected_log_probs, rtol=0, atol=1e-5)
    torch.testing.assert_close(sum_pi_squared.double(), (probs**2).sum(-1) * mask, rtol=0, atol=1e-6)
    own_routing = passes.compute_sum_pi_squared(model, batch, 0.7)
    assert torch.allclose(own_routing, sum_pi_squared) == (mode == "R2")


def test_a_model_without_a_replayable_router_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    with pytest.raises(ValueError, match="needs a mixture-of-experts model: the model has no router"):
        RouterReplay(dense)

    class DeepseekV4TopKRouter(torch.nn.Module):  # a router of another rule
        pass

    moe = tiny_moe()
    moe.model.extra = DeepseekV4TopKRouter()
    with pytest.raises(ValueError, match="the model has DeepseekV4TopKRouter"):
        RouterReplay(moe)


def _moe_trainer(mode: str, extra: tuple[str, ...] = ()):
    """A GRPO trainer on a two-layer Qwen3-MoE actor with ``actor.router_replay=mode`` and the
    settings ``extra``: 8 prompts x 2 responses a step, two epochs of two mini-batches,
    micro-batches of 2 rows, a large rate so that the routing moves within an update."""
    from _trainers import RECORDS, TOK

    from refppo.settings.config import Config, apply_overrides
    from refppo.settings.validate import validate
    from refppo.training.trainer import PPOTrainer

    settings = [
        "data.train_batch_size=8", "data.max_response_length=4", "algorithm.adv_estimator=grpo", "rollout.n=2",
        "actor.ppo_mini_batch_size=4", "actor.ppo_epochs=2", "actor.ppo_micro_batch_size_per_gpu=2",
        "actor.optim.lr=0.05", f"actor.router_replay={mode}", "trainer.critic_warmup=0", *extra,
    ]  # fmt: skip
    config = validate(apply_overrides(Config(), settings))
    torch.manual_seed(0)
    model_config = Qwen3MoeConfig(
        vocab_size=len(TOK), hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=8, num_experts_per_tok=2,
        pad_token_id=TOK.pad_token_id, bos_token_id=TOK.bos_token_id, eos_token_id=TOK.eos_token_id,
    )  # fmt: skip
    actor = Qwen3MoeForCausalLM(model_config).eval()
    trainer = PPOTrainer(config, TOK, actor, None, RECORDS, RECORDS[:8], reward_fn=_varied_reward)
    return trainer, RECORDS[:8]


def _varied_reward(prompts, responses, records):
    """Scores that differ within most groups, so GRPO's advantages move the actor."""
    return torch.tensor([float(sum(map(ord, response)) % 3) for response in responses])


def _update_targets(trainer, batch) -> list[torch.Tensor]:
    """Per router, the (N, k) experts the actor's update must use, in the order its forward passes
    run (epochs, mini-batches, micro-batches of consecutive rows; -1 where nothing was recorded)."""
    from refppo.training.update import minibatch_rows

    settings = trainer._update_settings("actor")
    routes = batch["routed_experts"]
    order = []
    for idx in minibatch_rows(len(routes), settings):
        for start in range(0, len(idx), settings.micro_rows):
            order.append(routes[idx[start : start + settings.micro_rows]])
    return [torch.cat([part[:, :, layer].reshape(-1, 2) for part in order]).long() for layer in range(2)]


DYNAMIC_SAMPLING = ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward")


SUM_PI_SQUARED = ("actor.calculate_sum_pi_squared=true",)


@pytest.mark.parametrize(("mode", "extra"), [("R2", ()), ("R3", ()), ("R3", DYNAMIC_SAMPLING), ("R3", SUM_PI_SQUARED)])
def test_the_update_routes_every_token_as_recorded(mode, extra):
    """The trainer's step: R2 records the routing in the old-log-prob pass, R3 in the rollout (all
    but the last response column; under dynamic sampling in each generation batch, joined as their
    tokens are); every forward pass of the actor's update then sends each recorded token to the
    recorded experts, although the routers moved (their native choices after the update differ)."""
    trainer, records = _moe_trainer(mode, extra)
    replay = trainer.routing.replay
    actions = []
    begin = replay.begin
    replay.begin = lambda mb: actions.append(replay.action) or begin(mb)
    timing = {}
    batch, _ = trainer.make_experience(records, timing)
    # the old-log-prob pass, one micro-batch (the reference's pass, with no KL here, does not run),
    # and with sum_pi_squared that pass too
    assert actions and set(actions) == {"record" if mode == "R2" else "replay"}, actions
    assert len(actions) == (2 if extra == SUM_PI_SQUARED else 1), actions
    routes = batch["routed_experts"]
    assert routes.shape == (16, batch["input_ids"].shape[1], 2, 2) and routes.dtype == torch.int16
    if mode == "R2":
        assert (routes >= 0).all()
    elif not extra:
        assert (routes[:, -1] == -1).all() and (routes[:, :-1] >= 0).all()
    experts, _ = _experts_used(trainer.routing.replay)
    trainer.update(batch, timing)
    targets = _update_targets(trainer, batch)
    for layer in range(2):
        used = torch.cat(experts[layer::2])
        recorded = targets[layer][:, :1] >= 0
        assert torch.equal(torch.where(recorded, targets[layer], used), used), layer
    experts.clear()
    trainer.accel.actor.compute_log_probs(trainer.actor, batch)  # no replay: the routers' own choices
    native = torch.cat(experts[0::2])
    recorded = routes[:, :, 0].reshape(-1, 2).long()
    kept = recorded[:, 0] >= 0
    assert not torch.equal(native[kept], recorded[kept]), "the update moved the routing it replayed"


def test_dynamic_samplings_joined_batches_keep_each_tokens_routes():
    """Generation batches of different prompt and response widths joined (verl's filter_groups
    concatenates theirs): each row's routes stay beside its tokens, the prompt part left-padded and
    the response part right-padded with -1, where nothing was recorded."""
    from refppo.rollout.prompts import sequence_batch
    from refppo.training.dynamic_sampling import join_batches

    torch.manual_seed(0)
    parts = []
    for rows, prompt, response in ((2, 3, 2), (1, 5, 4)):
        prompts = torch.randint(1, 9, (rows, prompt))
        responses = torch.randint(1, 9, (rows, response))
        part = sequence_batch(prompts, torch.ones_like(prompts), responses, torch.ones_like(responses))
        part["routed_experts"] = torch.randint(0, 8, (rows, prompt + response, 2, 2), dtype=torch.int16)
        parts.append(part)
    whole = join_batches(parts, pad_token_id=0)
    width, length = 5, 4
    assert whole["routed_experts"].shape == (3, width + length, 2, 2)
    row = 0
    for part in parts:
        prompt = part["prompts"].shape[1]
        response = part["responses"].shape[1]
        for i, routes in enumerate(part["routed_experts"]):
            expected = torch.full((width + length, 2, 2), -1, dtype=torch.int16)
            expected[width - prompt : width + response] = routes
            assert torch.equal(whole["routed_experts"][row], expected)
            assert torch.equal(whole["input_ids"][row, width - prompt : width + response], part["input_ids"][i])
            row += 1


def test_router_replay_refuses_what_it_cannot_record_or_replay():
    from refppo.settings.config import Config, apply_overrides
    from refppo.settings.validate import validate

    refusals = {
        ("R2", "algorithm.rollout_correction.bypass_mode=true"): "records the routing in the old-log-prob pass",
        ("R3", "rollout.cuda_graphs=true"): "needs rollout.cuda_graphs off",
        ("R2", "model.compile_layers=true"): "needs model.compile_layers off",
    }
    for (mode, setting), message in refusals.items():
        line = [f"actor.router_replay={mode}", setting, "algorithm.adv_estimator=grpo", "rollout.n=2"]
        with pytest.raises(ValueError, match=message):
            validate(apply_overrides(Config(), line))
