import pytest
import torch
from transformers import PreTrainedTokenizerFast

from refppo.rollout.layers import decoder_layers
from refppo.rollout.models import (
    LoraDisabledReference,
    add_lora,
    init_value_head,
    load_causal_lm,
    load_value_model,
    make_reference,
    prepare_tokenizer,
    tiny_config,
)
from refppo.tasks.tokenizer import build_tokenizer

ARCHS = ["llama", "qwen2"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _ids(tok, text="12+34="):
    return torch.tensor([tok(text)["input_ids"]])


@pytest.mark.parametrize("arch", ARCHS)
def test_save_and_load_round_trip(tok, tmp_path, arch):
    torch.manual_seed(0)
    actor = load_causal_lm(tiny_config(tok, arch))
    actor.save_pretrained(tmp_path / "actor")
    back = load_causal_lm(tmp_path / "actor")
    x = _ids(tok)
    assert type(back) is type(actor)
    assert torch.equal(back(x).logits, actor(x).logits)
    assert back.config.vocab_size == len(tok)

    rm = load_value_model(tiny_config(tok, arch))
    rm.save_pretrained(tmp_path / "rm")
    rm_back = load_value_model(tmp_path / "rm")
    assert rm(x).logits.shape == (1, x.shape[1], 1)
    back_state = rm_back.state_dict()
    assert all(torch.equal(v, back_state[k]) for k, v in rm.state_dict().items())
    torch.testing.assert_close(rm_back(x).logits, rm(x).logits, rtol=0, atol=1e-6)


def test_critic_from_sft_model_and_from_reward_model(tok, tmp_path):
    torch.manual_seed(0)
    sft = load_causal_lm(tiny_config(tok, hidden_size=256, num_attention_heads=4))
    sft.save_pretrained(tmp_path / "sft")
    critic = load_value_model(tmp_path / "sft")
    # The backbone is the SFT model's; the head is new: N(0, 1/sqrt(hidden + 1)), bias 0.
    for name, p in sft.model.named_parameters():
        assert torch.equal(p, critic.model.get_parameter(name)), name
    w = critic.score.weight
    assert w.shape == (1, 256)
    assert abs(w.std().item() * (256 + 1) ** 0.5 - 1) < 0.25
    assert torch.equal(critic.score.bias, torch.zeros(1))

    # A critic initialised from a reward model keeps the trained head.
    with torch.no_grad():
        critic.score.weight.add_(1.0)
        critic.score.bias.fill_(0.5)
    critic.save_pretrained(tmp_path / "rm")
    from_rm = load_value_model(tmp_path / "rm")
    assert torch.equal(from_rm.score.weight, critic.score.weight)
    assert torch.equal(from_rm.score.bias, critic.score.bias)


def test_init_value_head_statistics(tok):
    torch.manual_seed(1)
    model = load_value_model(tiny_config(tok, hidden_size=256))
    stds = []
    for _ in range(20):
        init_value_head(model)
        stds.append(model.score.weight.std().item())
        assert model.score.bias.abs().max().item() == 0.0
    assert abs(sum(stds) / len(stds) * 257**0.5 - 1) < 0.05


@pytest.mark.parametrize("arch", ARCHS)
def test_dropout_is_off_even_when_the_config_asks_for_it(tok, arch):
    torch.manual_seed(0)
    config = tiny_config(tok, arch, attention_dropout=0.5)
    for model in (load_causal_lm(config), load_value_model(config)):
        assert model.config.attention_dropout == 0.0
        assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
        model.train()
        x = _ids(tok)
        assert torch.equal(model(x).logits, model(x).logits)
    assert config.attention_dropout == 0.5  # the caller's config is not modified


def test_lora_reference_is_the_base_model_exactly(tok):
    torch.manual_seed(0)
    base = load_causal_lm(tiny_config(tok))
    base_copy = load_causal_lm(tiny_config(tok))
    base_copy.load_state_dict(base.state_dict())
    actor = add_lora(base, r=4)
    ref = make_reference(actor)
    assert isinstance(ref, LoraDisabledReference)
    trainable = [p for p in actor.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in actor.named_parameters() if p.requires_grad)
    opt = torch.optim.SGD(trainable, lr=0.5)
    x = _ids(tok)
    for _ in range(2):
        opt.zero_grad()
        actor(x).logits.logsumexp(-1).mean().backward()
        opt.step()
    with torch.no_grad():
        assert not torch.allclose(actor(x).logits, base_copy(x).logits, atol=1e-3)  # the adapter moved
        assert torch.equal(ref(input_ids=x).logits, base_copy(x).logits)
        assert not torch.allclose(actor(x).logits, base_copy(x).logits, atol=1e-3)  # and is back on


def test_separate_reference_is_a_frozen_copy(tok):
    torch.manual_seed(0)
    actor = load_causal_lm(tiny_config(tok))
    ref = make_reference(actor)
    assert ref is not actor and not ref.training
    assert all(not p.requires_grad for p in ref.parameters())
    with torch.no_grad():
        next(actor.parameters()).add_(1.0)
    assert not torch.equal(next(actor.parameters()), next(ref.parameters()))
    assert make_reference(actor, dtype=torch.bfloat16).dtype == torch.bfloat16


def _tokenizer_without_pad():
    core = build_tokenizer()._tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")


def test_tokenizer_without_pad_gets_one_and_models_grow(tok):
    raw = _tokenizer_without_pad()
    assert raw.pad_token_id is None
    raw.add_special_tokens({"pad_token": "<pad>"})  # "<pad>" exists in the vocabulary: no growth
    assert raw.pad_token_id == 0

    raw = _tokenizer_without_pad()
    before = len(raw)
    prepare_tokenizer(raw, pad_token="<mypad>")
    assert len(raw) == before + 1 and raw.pad_token == "<mypad>" and raw.padding_side == "left"
    assert raw.pad_token_id != raw.eos_token_id
    model = load_causal_lm(tiny_config(tok), tokenizer=raw)  # config built for the old vocabulary
    assert model.get_input_embeddings().num_embeddings == len(raw)
    assert model.get_output_embeddings().out_features == len(raw)


def test_tokenizer_bad_input():
    raw = _tokenizer_without_pad()
    raw.pad_token = "<eos>"
    with pytest.raises(ValueError, match="pad token '<eos>' is its EOS token"):
        prepare_tokenizer(raw)
    raw = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer()._tokenizer, pad_token="<pad>")
    with pytest.raises(ValueError, match="no eos_token"):
        prepare_tokenizer(raw)


def test_unknown_model_path_and_arch(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="no model folder at .*nowhere.*never downloads: for a hub id"):
        load_causal_lm(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no model folder"):
        load_value_model("some-org/some-model")
    with pytest.raises(ValueError, match="unknown tiny model arch 'gpt9'; valid: llama, qwen2"):
        tiny_config(tok, "gpt9")


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_layers_are_the_backbones_layers_of_a_causal_lm_and_a_scalar_head_model(tok, arch):
    actor = load_causal_lm(tiny_config(tok, arch))
    critic = load_value_model(tiny_config(tok, arch))
    for model in (actor, critic):
        layers = decoder_layers(model, needed_by="a test")
        assert len(layers) == model.config.num_hidden_layers
        assert all(a is b for a, b in zip(layers, model.base_model.layers))


def test_a_model_without_decoder_layers_is_refused_naming_what_needs_them():
    with pytest.raises(ValueError, match=r"^model.compile_layers: Linear has no decoder layers at .model.layers$"):
        decoder_layers(torch.nn.Linear(2, 2), needed_by="model.compile_layers")
