"""Megatron's router losses on a verl Megatron line: read as verl 0.9 turns them on, refused on a
mixture-of-experts actor (refppo implements neither), nothing on a dense one (it has no router).

verl 0.9's ``MegatronEngine._build_tf_config`` (``verl/workers/engine/megatron/transformer_impl.py``)
builds Megatron-Bridge's provider with ``moe_router_load_balancing_type="none"`` and then the line's
``override_transformer_config``, so the load-balancing loss runs only where the line gives its type;
the deprecated mbridge (``vanilla_mbridge=true``) keeps the model's loss (``aux_loss``, the model's
``router_aux_loss_coef``) with the overrides on top; verl's MindSpeed engine passes ``mcore_kwargs``
to Megatron through mbridge too. Megatron-Core's z-loss runs wherever ``moe_z_loss_coeff`` is set.
"""

from __future__ import annotations

import sys

import pytest
import torch
from test_verl_names import chat_model  # noqa: F401  (a fixture)
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from refppo.rollout.models import check_router_losses, is_mixture_of_experts
from refppo.settings.overrides import command_settings

MEGATRON = "+actor_rollout_ref.actor.megatron.override_transformer_config."
MINDSPEED = "+actor_rollout_ref.actor.mindspeed.mcore_kwargs."


VANILLA = "actor_rollout_ref.actor.megatron.vanilla_mbridge=True"
AUX_TYPE = "moe_router_load_balancing_type"


@pytest.mark.parametrize(
    ("line", "aux", "z_loss"),
    [
        # Megatron-Bridge: the load-balancing loss is off whatever its coefficient, the z-loss on
        ([f"{MEGATRON}moe_aux_loss_coeff=0.01", f"{MEGATRON}moe_z_loss_coeff=0.001"], 0.0, 1e-3),
        ([f"{MEGATRON}{AUX_TYPE}=aux_loss"], None, 0.0),
        ([f"{MEGATRON}{AUX_TYPE}=aux_loss", f"{MEGATRON}moe_aux_loss_coeff=0.01"], 0.01, 0.0),
        # mbridge: the model's own loss, its coefficient the line's or the model's
        ([VANILLA], None, 0.0),
        ([VANILLA, f"{MEGATRON}{AUX_TYPE}='none'"], 0.0, 0.0),
        (
            ["model_engine=mindspeed", f"{MINDSPEED}{AUX_TYPE}=aux_loss", f"{MINDSPEED}moe_aux_loss_coeff=0.001"],
            1e-3,
            0.0,
        ),
        # FSDP's engine adds none (its loss is the policy loss on the logits)
        (["model_engine=dp"], 0.0, 0.0),
    ],
)
def test_a_line_turns_the_router_losses_on_as_verl_does(line, aux, z_loss):
    engine = [] if any(item.startswith("model_engine=") for item in line) else ["model_engine=megatron"]
    config, notes = command_settings("ppo", [*engine, *line])
    assert (config.actor.moe_aux_loss_coeff, config.actor.moe_z_loss_coeff) == (aux, z_loss)
    if aux != 0:
        assert any("Megatron's router load-balancing loss" in note for note in notes)
    if z_loss:
        assert any("Megatron's router z-loss" in note for note in notes)


def _models():
    torch.manual_seed(0)
    sizes = {"vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, **sizes))
    dense = LlamaForCausalLM(LlamaConfig(intermediate_size=24, **sizes))
    return moe, dense


def test_a_mixture_of_experts_actor_refuses_them_and_a_dense_one_has_none():
    moe, dense = _models()
    assert is_mixture_of_experts(moe) and not is_mixture_of_experts(dense)
    with pytest.raises(ValueError, match="actor.moe_aux_loss_coeff=null \\(the model's own\\) on a mixture-of-experts"):
        check_router_losses(moe, aux_coeff=None, z_coeff=0.0)
    with pytest.raises(ValueError, match="actor.moe_z_loss_coeff=0.001 on a mixture-of-experts model: refppo does not"):
        check_router_losses(moe, aux_coeff=0.0, z_coeff=0.001)
    check_router_losses(moe, aux_coeff=0.0, z_coeff=0.0)
    check_router_losses(dense, aux_coeff=None, z_coeff=0.001)


def test_refppo_ppo_refuses_them_for_a_mixture_of_experts_actor_before_any_write(
    chat_model,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
):
    """The check runs on the loaded actor, before the run folder exists."""
    from transformers import AutoTokenizer

    from refppo.runs.cli import entry

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "moe")
    tokenizer.save_pretrained(tmp_path / "moe")
    out = tmp_path / "run"
    argv = ["refppo", "ppo", f"model.path={tmp_path / 'moe'}", f"trainer.output_dir={out}", "trainer.critic_warmup=0"]
    quick = ["trainer.total_training_steps=1", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4"]
    quick += ["data.max_response_length=4", "trainer.progress_bar=false"]
    monkeypatch.setattr(sys, "argv", [*argv, *quick, "actor.moe_z_loss_coeff=0.001"])
    assert entry() == 2
    assert "refppo: error: actor.moe_z_loss_coeff=0.001 on a mixture-of-experts model" in capsys.readouterr().err
    assert not out.exists()
