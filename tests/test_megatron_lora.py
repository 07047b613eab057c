"""Megatron-Bridge's LoRA (verl's ``model.lora.*``) on Hugging Face models.

The reference is written here plainly: Megatron-Bridge's ``LoRA`` (``megatron/bridge/peft/lora.py``,
type ``lora``) puts one adapter on each of Megatron-Core's fused linear maps, so q, k and v share
one A and take their rows of one B, gate and up likewise, and all of a layer's experts share one
adapter per grouped linear. Each adapter adds alpha / rank x B A x; a model with its weights
replaced by W + alpha / rank x B[rows] A, computed here from the adapters' tensors, is the adapted
model, in its outputs and in the gradients of A and B (float64 throughout: its rounding, 2^-52 per
operation over a few thousand operations per logit, stays far below the 1e-9 tolerances).
"""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch
from _trainers import make_trainer
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from refppo.rollout.megatron_lora import (
    adapters,
    adapters_disabled,
    add_megatron_lora,
    init_adapter_weight,
    merge_megatron_lora,
    save_megatron_lora,
)
from refppo.rollout.models import is_lora, make_reference
from refppo.settings.config import MegatronLoraConfig
from refppo.settings.overrides import command_settings

SIZES = {
    "vocab_size": 40,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
MOE = {"moe_intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 2}
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(intermediate_size=24, **SIZES)),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=16, **MOE, **SIZES)),
    "qwen2_moe": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(shared_expert_intermediate_size=12, **MOE, **SIZES)),
}
RANK = 3
ALPHA = 5.0


def _model(name: str):
    """A float64 tiny model whose experts run transformers' eager loop (its grouped kernel has no float64)."""
    torch.manual_seed(0)
    model = MODELS[name]()
    model.config._experts_implementation = "eager"
    return model.double().eval()


def _lora(**settings) -> MegatronLoraConfig:
    """``model.lora`` at rank RANK and alpha ALPHA, with ``settings``."""
    return MegatronLoraConfig(rank=RANK, alpha=ALPHA, **settings)


def _adapted(name: str, init_b: str = "normal", groups: int = 1):
    """(the base model, a copy with Megatron's LoRA, B drawn at random so the adapters act; its
    experts' adapters in ``groups`` expert-parallel groups)."""
    base = _model(name)
    lora = _lora(lora_B_init_method=init_b, expert_model_parallel_size=groups)
    return base, add_megatron_lora(copy.deepcopy(base), lora)


def _merged_weights(model) -> dict[str, torch.Tensor]:
    """The base weights plus each adapter, written out: q, k, v take rows of one B after one A,
    gate and up likewise, every expert the whole of its layer's adapter (autograd reaches A and B)."""
    weights = {}
    for name, module in model.named_modules():
        for part in ("self_attn", "mlp", "mlp.shared_expert"):
            if not name.endswith(part) or not hasattr(module, "q_proj" if part == "self_attn" else "gate_proj"):
                continue
            fused = (
                {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",)}
                if part == "self_attn"
                else {"linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
            )
            for megatron, projections in fused.items():
                adapter = getattr(module, f"{megatron}_lora")
                row = 0
                for projection in projections:
                    weight = getattr(module, projection).weight
                    b = adapter.linear_out[row : row + weight.shape[0]]
                    weights[f"{name}.{projection}.weight"] = weight + ALPHA / RANK * b @ adapter.linear_in
                    row += weight.shape[0]
        if name.endswith("mlp.experts"):  # the experts of an expert-parallel group share its adapter
            for megatron, param in (("linear_fc1", "gate_up_proj"), ("linear_fc2", "down_proj")):
                groups = getattr(module, f"{megatron}_lora")
                experts = getattr(module, param).chunk(len(groups))
                merged = [w + ALPHA / RANK * g.linear_out @ g.linear_in for w, g in zip(experts, groups, strict=True)]
                weights[f"{name}.{param}"] = torch.cat(merged)
    return weights


def _logits(model, ids, weights=None):
    """Logits of ``model`` on ``ids``, with ``weights`` in place of its own where given."""
    if weights is None:
        return model(ids).logits
    return torch.func.functional_call(model, weights, (ids,)).logits


# (model, expert-parallel size): Megatron-Bridge 0.5 gives each expert-parallel rank its own adapter
CASES = [("llama", 1), ("qwen3_moe", 1), ("qwen3_moe", 2), ("qwen2_moe", 1), ("qwen2_moe", 4)]


@pytest.mark.parametrize(("name", "groups"), CASES)
def test_the_adapted_model_is_its_weights_plus_megatrons_fused_adapters(name, groups):
    """Outputs and the gradients of every A and B equal the base model with the merged weights
    written out here, in float64; without its adapters the model is the base model, bit for bit."""
    base, model = _adapted(name, groups=groups)
    ids = torch.randint(0, SIZES["vocab_size"], (3, 7))
    logits = _logits(model, ids)
    merged = _merged_weights(model)
    expected = _logits(base, ids, merged)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-9)
    assert (logits - _logits(base, ids)).abs().max() > 1e-3  # the adapters act
    with adapters_disabled(model):
        assert torch.equal(_logits(model, ids), _logits(base, ids))

    targets = torch.randn_like(logits)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad((logits * targets).sum(), params)
    expected_grads = torch.autograd.grad((_logits(base, ids, _merged_weights(model)) * targets).sum(), params)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    assert all(g.abs().sum() > 0 for g in grads)


def _megatron_parameter_count(config, groups: int) -> int:
    """Megatron-Bridge's LoRA parameters, counted from the shapes of its fused maps: per layer
    rank x (in + out) for linear_qkv, linear_proj, linear_fc1 and linear_fc2, the experts' once per
    expert-parallel group."""
    h = config.hidden_size
    head = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q = config.num_attention_heads * head
    kv = config.num_key_value_heads * head
    per_layer = RANK * (h + q + 2 * kv) + RANK * (q + h)
    inner = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    per_layer += groups * (RANK * (h + 2 * inner) + RANK * (inner + h))
    shared = getattr(config, "shared_expert_intermediate_size", 0)
    if shared:
        per_layer += RANK * (h + 2 * shared) + RANK * (shared + h)
    return config.num_hidden_layers * per_layer


@pytest.mark.parametrize(("name", "groups"), CASES)
def test_only_megatrons_adapters_train(name, groups):
    """One A per fused map (per expert-parallel group for the experts), never one per projection or
    per expert: the trainable parameters are exactly Megatron's count, and the base weights are frozen."""
    base, model = _adapted(name, groups=groups)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == _megatron_parameter_count(model.config, groups)
    assert {id(p) for p in trainable} == {id(p) for a in adapters(model) for p in a.parameters()}


def test_a_subset_of_targets_adapts_those_maps_only():
    """``model.lora.target_modules`` names Megatron's maps; the others keep their weights."""
    base = _model("qwen3_moe")
    model = add_megatron_lora(copy.deepcopy(base), _lora(target_modules=("linear_qkv",)))
    names = {name.rpartition(".")[0].rpartition(".")[2] for name, p in model.named_parameters() if p.requires_grad}
    assert names == {"linear_qkv_lora"}


@pytest.mark.parametrize("method", ["xavier", "kaiming", "normal", "zero"])
@pytest.mark.parametrize(("shards", "dim"), [(1, 0), (4, 0), (4, 1)])
def test_initialisations_are_megatron_bridges(method, shards, dim):
    """Megatron-Bridge's rules, on a (64, 1024) matrix, each tensor-parallel shard on its own (its
    fans the shard's): Xavier normal (std sqrt(2 / (fan in + fan out))), Kaiming uniform with
    a = sqrt(5) (bound 1 / sqrt(fan in)), N(0, 0.2^2), zeros. The standard deviation of a shard's
    16,384 draws or more is within 3.5% of its value (5 standard errors: 0.55% each, or less)."""
    torch.manual_seed(0)
    weight = torch.empty(64, 1024, dtype=torch.float64)
    init_adapter_weight(weight, method, shards=shards, dim=dim)
    for part in weight.chunk(shards, dim=dim):
        fan_out, fan_in = part.shape
        std = {"xavier": math.sqrt(2 / (fan_in + fan_out)), "kaiming": 1 / math.sqrt(3 * fan_in), "normal": 0.2}
        if method == "zero":
            assert torch.equal(part, torch.zeros_like(part))
            continue
        assert abs(part.std().item() / std[method] - 1) < 0.035
        if method == "kaiming":
            assert part.abs().max() <= 1 / math.sqrt(fan_in)


def test_tensor_parallel_shards_split_a_by_rank_or_by_input():
    """Under a tensor-parallel size of 2, A of a column-parallel map (linear_qkv, linear_fc1) is split
    by rank, so its Kaiming bound stays 1 / sqrt(hidden); A of a row-parallel map (linear_proj,
    linear_fc2) by input, so each half's bound is sqrt(2) / sqrt(input); and a size that does not
    split is refused."""
    torch.manual_seed(0)
    lora = MegatronLoraConfig(rank=4, alpha=ALPHA, lora_A_init_method="kaiming", tensor_model_parallel_size=2)
    model = add_megatron_lora(_model("llama"), lora)
    attention = model.model.layers[0].self_attn
    mlp = model.model.layers[0].mlp
    hidden = SIZES["hidden_size"]
    assert attention.linear_qkv_lora.linear_in.abs().max() <= 1 / math.sqrt(hidden)
    assert mlp.linear_fc1_lora.linear_in.abs().max() <= 1 / math.sqrt(hidden)
    for a in (attention.linear_proj_lora.linear_in, mlp.linear_fc2_lora.linear_in):
        half = a.shape[1] // 2
        assert 1 / math.sqrt(a.shape[1]) < a.abs().max() <= 1 / math.sqrt(half)
    with pytest.raises(ValueError, match="an adapter's rank 3 does not split over Megatron's tensor-parallel size 2"):
        add_megatron_lora(_model("llama"), _lora(tensor_model_parallel_size=2))
    with pytest.raises(ValueError, match="expert_model_parallel_size=3 does not divide a layer's 4 experts"):
        add_megatron_lora(_model("qwen3_moe"), _lora(expert_model_parallel_size=3))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_with_b_at_zero_the_adapted_model_starts_as_the_model(name):
    base, model = _adapted(name, init_b="zero")
    ids = torch.randint(0, SIZES["vocab_size"], (2, 5))
    assert torch.equal(_logits(model, ids), _logits(base, ids))


@pytest.mark.parametrize(("name", "groups"), CASES)
def test_merging_gives_a_plain_model_of_the_same_outputs(name, groups, tmp_path):
    """The merged model has the base model's weights and no adapter, hook or patched forward of its
    own (another's, here on the LM head, stays); the saved adapters hold every A and B under their
    names in the model."""
    base, model = _adapted(name, groups=groups)
    patched = types.MethodType(type(model.lm_head).forward, model.lm_head)
    model.lm_head.forward = patched
    ids = torch.randint(0, SIZES["vocab_size"], (2, 6))
    logits = _logits(model, ids).detach()
    expected = {k: v.detach() for k, v in _merged_weights(model).items()}
    save_megatron_lora(model, tmp_path)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "megatron_lora.safetensors")
    assert saved.keys() == {name for name, p in model.named_parameters() if p.requires_grad}
    merge_megatron_lora(model)
    assert not is_lora(model) and not adapters(model)
    assert model.state_dict().keys() == base.state_dict().keys()
    for key, value in expected.items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=1e-12)
    assert all(not m._forward_hooks and "forward" not in vars(m) for m in model.modules() if m is not model.lm_head)
    assert model.lm_head.forward is patched
    torch.testing.assert_close(_logits(model, ids), logits, rtol=0, atol=1e-9)


def test_a_model_without_megatrons_projections_is_refused_unchanged():
    """Phi-3 fuses q, k and v into one qkv_proj and gate and up into one gate_up_proj: none of the
    separate projections refppo adapts as Megatron's fused maps. GPT-2 keeps its layers elsewhere."""
    model = Phi3ForCausalLM(Phi3Config(intermediate_size=24, pad_token_id=0, **SIZES))
    with pytest.raises(ValueError, match="model.lora.target_modules: layer 0's attention has no q_proj"):
        add_megatron_lora(model, _lora())
    with pytest.raises(ValueError, match="layer 0's mlp is Phi3MLP, neither a gated MLP"):
        add_megatron_lora(model, _lora(target_modules=("linear_fc2",)))
    assert all(p.requires_grad for p in model.parameters()) and not adapters(model)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0))
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no decoder layers at .model.layers"):
        add_megatron_lora(gpt2, _lora())
    with pytest.raises(ValueError, match=r"model.lora.target_modules=\['linear_q'\]: refppo adapts linear_qkv"):
        add_megatron_lora(_model("llama"), _lora(target_modules=("linear_q",)))
    with pytest.raises(ValueError, match="model.lora.rank=0: an adapter has rank >= 1"):
        add_megatron_lora(_model("llama"), MegatronLoraConfig(rank=0))
    with pytest.raises(ValueError, match="model.lora init method 'ones': Megatron-Bridge's are xavier"):
        add_megatron_lora(_model("llama"), _lora(lora_B_init_method="ones"))


def test_a_ppo_step_trains_the_adapters_and_the_reference_is_the_base_model():
    """Two steps move every adapter and no base weight; the reference is the actor with its
    adapters off, the policy the steps started from."""
    adapt = lambda actor: add_megatron_lora(actor, MegatronLoraConfig(rank=4, alpha=8))  # noqa: E731
    trainer = make_trainer(["algorithm.use_kl_in_reward=true"], adapt=adapt)
    actor = trainer.actor
    frozen = {name: p.detach().clone() for name, p in actor.named_parameters() if not p.requires_grad}
    trained = {name: p.detach().clone() for name, p in actor.named_parameters() if p.requires_grad}
    start = copy.deepcopy(actor)
    for _ in range(2):
        trainer.train_step()
    now = dict(actor.named_parameters())
    assert all(torch.equal(now[name], value) for name, value in frozen.items())
    assert all(not torch.equal(now[name], value) for name, value in trained.items() if "linear_out" in name)
    assert is_lora(actor) and make_reference(actor).actor is actor
    ids = torch.randint(0, 10, (2, 6))
    with adapters_disabled(start):
        expected = start(ids).logits
    assert torch.equal(trainer.reference(ids).logits, expected)
    assert not torch.equal(actor(ids).logits, expected)


def test_verl_reads_megatrons_lora_on_its_megatron_engines_only():
    """verl 0.9's Megatron engines build Megatron-Bridge's LoRA from ``model.lora`` (get_peft_cls in
    ``verl/workers/config/megatron_peft.py``) and never read PEFT's ``model.lora_rank``; its FSDP
    engine trains PEFT's and leaves ``model.lora`` to the rollout server, which would then expect
    an adapter the actor does not train."""
    megatron = ["model_engine=megatron", "actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.alpha=16"]
    config, notes = command_settings("ppo", [*megatron, "actor_rollout_ref.model.lora.lora_A_init_method=kaiming"])
    assert (config.model.lora.rank, config.model.lora.alpha, config.model.lora.lora_A_init_method) == (8, 16, "kaiming")
    config, notes = command_settings("ppo", ["model_engine=megatron", "actor_rollout_ref.model.lora_rank=8"])
    assert config.model.lora_rank == 0 and config.model.lora.rank == 0
    note = "actor_rollout_ref.model.lora_rank=8 is not read: verl's megatron actor trains Megatron's LoRA"
    assert any(n.startswith(note) for n in notes)
    with pytest.raises(ValueError, match="lora.rank=8 with the actor's strategy fsdp: verl trains Megatron's LoRA"):
        command_settings("ppo", ["actor_rollout_ref.model.lora.rank=8"])


def test_megatrons_parallel_sizes_shape_the_adapters_on_a_lora_line_only():
    """Megatron-Bridge 0.5 (verl 0.9's) builds the adapters under the actor engine's parallel sizes
    (``ParallelLinearAdapter``: an experts adapter per expert-parallel rank, A and B initialised per
    tensor-parallel shard): on a Megatron LoRA line they are taken, on any other line noted as the
    engine's; the reference's copies are the engine's either way."""
    sizes = {"tensor_model_parallel_size": "2", "expert_model_parallel_size": "4", "expert_tensor_parallel_size": "1"}
    given = [f"actor_rollout_ref.actor.megatron.{k}={v}" for k, v in sizes.items()]
    reference = "actor_rollout_ref.ref.megatron.expert_model_parallel_size=4"
    config, notes = command_settings(
        "ppo", ["model_engine=megatron", "actor_rollout_ref.model.lora.rank=8", *given, reference]
    )
    assert {k: str(getattr(config.model.lora, k)) for k in sizes} == sizes
    assert f"{reference} is a setting of verl's engine: it has no effect in refppo" in notes
    config, notes = command_settings("ppo", ["model_engine=megatron", *given])
    assert config.model.lora == MegatronLoraConfig()
    assert f"{given[1]} is a setting of verl's engine: it has no effect in refppo" in notes


@pytest.mark.parametrize(
    ("settings", "refusal"),
    [
        (["model.lora.rank=4", "model.lora_rank=4"], r"model.lora.rank=4 \(Megatron's LoRA\) with PEFT's"),
        (["model.lora.alpha=8"], "model.lora.alpha is read only with model.lora.rank > 0"),
        (["model.lora.rank=4", "model.lora.target_modules=[linear_q]"], "'linear_q' is not one of linear_qkv"),
        (["model.lora.rank=4", "model.lora.lora_B_init_method=ones"], "'ones' is not one of xavier"),
        (["model.lora.rank=4", "actor_rollout_ref.model.lora.dropout=0.1"], "does not implement LoRA dropout"),
        (["actor_rollout_ref.model.lora.type=dora"], "does not implement Megatron-Bridge's other adapters"),
        (["model.lora.rank=4", "model.compile_layers=true"], "model.lora.rank=4 needs model.compile_layers off"),
        (["model.lora.rank=4", "rollout.cuda_graphs=true"], "model.lora.rank=4 needs rollout.cuda_graphs off"),
        (["actor_rollout_ref.model.lora.adapter_path=/a"], "does not implement starting from a saved Megatron"),
    ],
)
def test_settings_megatrons_lora_lacks_are_refused_by_name(settings, refusal):
    with pytest.raises(ValueError, match=refusal):
        command_settings("ppo", settings)
