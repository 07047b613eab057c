"""refppo.guards.memory: the bytes-per-parameter and bytes-per-token arithmetic against measured tensors."""

import pytest
import torch

from refppo.accel.checkpointing import (
    checkpointed_activation_bytes,
    checkpointed_values_per_token,
    enable_gradient_checkpointing,
)
from refppo.guards.memory import (
    SYNTHETIC_RECORD_BYTES,
    PeakMeter,
    activation_bytes,
    activation_values_per_token,
    float32_values_per_token,
    held_bytes,
    param_count,
    rollout_bytes,
    state_bytes,
)
from refppo.rollout.forward import response_log_probs
from refppo.rollout.models import load_causal_lm, load_value_model, tiny_config
from refppo.rollout.prompts import build_batch, tokenize_prompts
from refppo.tasks import preference
from refppo.tasks.tokenizer import build_tokenizer

TOK = build_tokenizer()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_param_count_is_the_built_models(arch):
    config = tiny_config(TOK, arch=arch, hidden_size=48, num_hidden_layers=3)
    labels = config.num_labels
    assert param_count(config, value_head=True) == sum(p.numel() for p in load_value_model(config, TOK).parameters())
    assert config.num_labels == labels, "the caller's config is untouched"
    assert param_count(config) == sum(p.numel() for p in load_causal_lm(config, TOK).parameters())
    assert param_count(config) > param_count(config, value_head=True), "a one-output head replaces the vocabulary head"


def test_state_bytes_per_parameter():
    for precision in ("fp32", "bf16-mixed"):
        trained = state_bytes(1000, precision=precision)
        assert sum(trained.values()) == 16 * 1000, precision  # the classic 16 bytes per trained parameter
    assert state_bytes(1000, precision="bf16-mixed") == {"weights": 2000, "gradients": 2000, "optimizer": 12000}
    assert state_bytes(1000, trained=False) == {"weights": 2000, "gradients": 0, "optimizer": 0}
    assert state_bytes(1000, trained=False, precision="fp32")["weights"] == 4000
    with pytest.raises(ValueError, match="precision='fp16'"):
        state_bytes(1000, precision="fp16")
    # FSDP2 over 8 processes: each holds an eighth of each entry, the count padded to a multiple of 8
    assert state_bytes(1000, processes=8) == {k: v // 8 for k, v in state_bytes(1000).items()}
    assert state_bytes(1001, trained=False, processes=8)["weights"] == 126 * 2
    with pytest.raises(ValueError, match="processes=0"):
        state_bytes(1000, processes=0)


def test_held_bytes_of_a_trained_model_match_the_fp32_arithmetic():
    config = tiny_config(TOK, hidden_size=32)
    model = load_causal_lm(config, TOK)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
    optimizer.step()
    n = sum(p.numel() for p in model.parameters())
    assert held_bytes(model, optimizer) == state_bytes(n, precision="fp32")
    assert held_bytes(model) == {"weights": 4 * n, "gradients": 4 * n, "optimizer": 0}
    for p in model.parameters():
        p.requires_grad_(False)
    assert held_bytes(model)["gradients"] == 0


def test_peak_meter_counts_new_storages_once_and_frees_them():
    base = torch.ones(1000)
    with PeakMeter() as meter:
        a = torch.empty(1000)  # 4000 bytes
        view, _ = a[:10], base[:10]  # views: no new memory (of a tracked or of an outside tensor)
        base.add_(1)  # in place on an outside tensor: nothing new
        b = a * 2  # 4000 more
        assert meter.now == 8000
        del b
        assert meter.now == 4000
        c = torch.empty(250, dtype=torch.float64)  # 2000
    assert (meter.now, meter.peak) == (6000, 8000)
    del a, view, c


def _forward_kept(arch: str, padded: bool, dtype: torch.dtype, checkpointed: bool):
    """(bytes a training forward of a 3-layer model keeps beyond its logits, its config, ids):
    4 x 10 tokens, the first row left-padded if ``padded``."""
    config = tiny_config(TOK, arch=arch, hidden_size=64, num_hidden_layers=3)
    model = load_causal_lm(config, TOK).to(dtype)
    if checkpointed:
        enable_gradient_checkpointing(model)
        model.train()
    ids = torch.randint(4, len(TOK), (4, 10))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0 if padded else 1  # left padding in one row; an all-ones mask is no mask
    with PeakMeter() as meter:
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        kept = meter.now - logits.numel() * logits.element_size()  # the output is not an activation
        del logits
    return kept, config, ids


def _rotary(config, width: int, size: int) -> int:
    return 2 * width * (config.hidden_size // config.num_attention_heads) * size  # cos and sin, shared by the rows


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_arithmetic_matches_what_a_forward_pass_keeps(arch, padded, dtype):
    kept, config, ids = _forward_kept(arch, padded, dtype, checkpointed=False)
    assert config.num_key_value_heads < config.num_attention_heads, "grouped-query: k and v narrower than q"
    seq_len, size = (ids.shape[1] if padded else None), torch.finfo(dtype).bits // 8
    expected = activation_bytes(config, tokens=ids.numel(), logit_tokens=0, bytes_per_value=size, seq_len=seq_len)
    assert kept == expected + _rotary(config, ids.shape[1], size)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_checkpointed_forward_keeps_each_layers_input(arch, padded, dtype):
    """With activation checkpointing a training forward keeps each layer's input and the final
    norm's values, plus what every layer's checkpoint shares: the rotary tables, the positions
    and, with padding, the boolean mask."""
    kept, config, ids = _forward_kept(arch, padded, dtype, checkpointed=True)
    rows, width = ids.shape
    size = torch.finfo(dtype).bits // 8
    values, wide = checkpointed_values_per_token(config)
    assert values == config.num_hidden_layers * config.hidden_size + 3 * config.hidden_size + 1
    # the rotary tables, int64 positions, and a bool per (query, key) with padding
    shared = _rotary(config, width, size) + width * 8 + (rows * width * width if padded else 0)
    assert kept == ids.numel() * (values * size + wide * (4 - size)) + shared


def test_a_mask_adds_the_copied_key_value_heads_and_the_mask_per_layer():
    config = tiny_config(TOK, hidden_size=64, num_hidden_layers=3)
    head_dim = config.hidden_size // config.num_attention_heads
    copies = 2 * (config.num_attention_heads - config.num_key_value_heads) * head_dim
    extra = activation_values_per_token(config, seq_len=10) - activation_values_per_token(config)
    assert extra == config.num_hidden_layers * (copies + 10)
    with pytest.raises(ValueError, match="seq_len=0"):
        activation_values_per_token(config, seq_len=0)
    with pytest.raises(ValueError, match="bytes_per_value=3"):
        activation_bytes(config, tokens=8, logit_tokens=0, bytes_per_value=3)


def test_bf16_weights_keep_the_norms_inputs_and_the_log_sum_exp_in_float32():
    config = tiny_config(TOK, hidden_size=64, num_hidden_layers=3)
    h, heads, norms = config.hidden_size, config.num_attention_heads, 2 * config.num_hidden_layers + 1
    assert float32_values_per_token(config) == norms * (h + 1) + config.num_hidden_layers * heads
    half, full = (activation_bytes(config, tokens=1, logit_tokens=0, bytes_per_value=b) for b in (2, 4))
    assert full == 4 * activation_values_per_token(config)
    assert half == 2 * activation_values_per_token(config) + 2 * float32_values_per_token(config)


def _peak_of_an_update(model, batch) -> PeakMeter:
    """The meter of an actor update's second step (Adam's state exists from the first on, as
    between the steps of a run)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def update():
        log_probs, _ = response_log_probs(model, batch)
        (-log_probs.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    update()
    with PeakMeter() as meter:
        update()
    return meter


def test_an_update_peaks_between_the_activations_and_the_activations_plus_gradients():
    config = tiny_config(TOK, hidden_size=64)
    model = load_causal_lm(config, TOK)
    batch = build_batch(TOK, [f"{i}+{2 * i}=" for i in range(8)], [str(3 * i) for i in range(8)])
    meter = _peak_of_an_update(model, batch)
    rows, width = batch["responses"].shape
    tokens, seq_len = batch["input_ids"].numel(), batch["input_ids"].shape[1]  # a padded batch: it carries a mask
    act = activation_bytes(config, tokens, logit_tokens=rows * (width + 1), bytes_per_value=4, seq_len=seq_len)
    grads = held_bytes(model)["gradients"]
    # the backward pass frees activations while it creates gradients: the peak has all of one and part of the other
    assert act < meter.peak < act + grads, (meter.peak, act, grads)
    assert meter.now == 0, "nothing allocated in the update outlives it"


def test_a_checkpointed_update_peaks_near_the_layers_inputs_and_one_layer():
    """With activation checkpointing an update's peak lies between the layers' inputs plus the
    larger of one recomputed layer and the vocabulary rows (freed before the first
    recomputation), and the arithmetic's sum of all three plus the gradients and the gradient
    passed between two layers; without checkpointing the activations alone exceed that."""
    config = tiny_config(TOK, hidden_size=64, num_hidden_layers=4)
    model = load_causal_lm(config, TOK)
    enable_gradient_checkpointing(model)
    model.train()
    batch = build_batch(TOK, [f"{i}+{2 * i}=" for i in range(100, 164)], [str(3 * i) for i in range(100, 164)])
    meter = _peak_of_an_update(model, batch)
    rows, width = batch["responses"].shape
    tokens, seq_len = batch["input_ids"].numel(), batch["input_ids"].shape[1]
    act = {
        False: activation_bytes(config, tokens, rows * (width + 1), bytes_per_value=4, seq_len=seq_len),
        True: checkpointed_activation_bytes(config, tokens, rows * (width + 1), bytes_per_value=4, seq_len=seq_len),
    }
    inputs = tokens * checkpointed_values_per_token(config)[0] * 4
    layer = checkpointed_activation_bytes(config, tokens, 0, bytes_per_value=4, seq_len=seq_len) - inputs
    rows_bytes = rows * (width + 1) * config.vocab_size * 4
    assert act[True] == inputs + layer + rows_bytes
    bound = act[True] + held_bytes(model)["gradients"] + tokens * config.hidden_size * 4
    assert inputs + max(layer, rows_bytes) < meter.peak < bound < act[False], (meter.peak, act, bound)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_rollout_needs_at_least_its_estimate_and_not_much_more(arch):
    """rollout_bytes is a lower bound of generate's peak (the refusal of an impossible size never
    refuses a possible one), and within 4x of it: transformers' dynamic cache grows by
    concatenation, so its last step holds the old and the new cache at once (3x measured)."""
    from refppo.rollout.generation import generate

    config = tiny_config(TOK, arch=arch, hidden_size=64, num_hidden_layers=2)
    model = load_causal_lm(config, TOK)
    prompts = ["1+2=", "34+5=", "6+78=", "9+0="] * 4
    ids, mask = tokenize_prompts(TOK, prompts)
    new = 12
    with torch.no_grad(), PeakMeter() as meter:
        generate(model, ids, mask, TOK.eos_token_id, TOK.pad_token_id, new, ignore_eos=True)
    estimate = rollout_bytes(config, len(prompts), ids.shape[1], new)
    assert estimate <= meter.peak <= 4 * estimate, (estimate, meter.peak)


@pytest.mark.parametrize(
    "make", [lambda n: preference.make_comparisons(n, seed=1), lambda n: preference.make_sft_examples(n, seed=1)]
)
def test_the_synthetic_records_take_about_their_estimate(make):
    """SYNTHETIC_RECORD_BYTES bounds the peak of making the preference task's records, and is not
    loose by more than 2x (a refusal it makes is of a size that would not fit)."""
    import tracemalloc

    n = 5000
    tracemalloc.start()
    records = make(n)
    peak = tracemalloc.get_traced_memory()[1] / n
    tracemalloc.stop()
    assert len(records) == n
    assert SYNTHETIC_RECORD_BYTES / 2 <= peak <= SYNTHETIC_RECORD_BYTES, peak
