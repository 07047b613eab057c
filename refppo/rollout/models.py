"""The four RLHF models (ch 5, 6) from Hugging Face classes.

- actor and reference: ``AutoModelForCausalLM``;
- critic and reward model: the same backbone with a scalar head
  (``AutoModelForTokenClassification`` with one label, as verl does), one value per position.

Every loader takes a local folder saved with ``save_pretrained`` (a real checkpoint) or a
``transformers`` config (the tiny models of the tests and chapters); both go through the
same code. Dropout is off in all four models, so a forward pass is a deterministic function of
the weights and the PPO ratio of an unchanged policy is exactly 1.
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)
from transformers.utils import logging as hf_logging

from refppo.guards.checks import check_choice
from refppo.guards.model_folder import OFFLINE
from refppo.rollout.megatron_lora import adapters_disabled, has_megatron_lora

TINY_ARCHS = {"llama": LlamaConfig, "qwen2": Qwen2Config}


def tiny_config(
    tokenizer,
    arch: str = "llama",
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 256,
    **overrides,
) -> PretrainedConfig:
    """A small Llama- or Qwen2-style config whose vocabulary and special ids match ``tokenizer``.

    Args:
        tokenizer: a Hugging Face tokenizer (e.g. ``refppo.tasks.tokenizer.build_tokenizer()``).
        arch: "llama" or "qwen2".
        hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
            max_position_embeddings: the usual ``transformers`` fields; the MLP is 4x wide.
        **overrides: any other config field.

    Returns:
        A ``LlamaConfig`` or ``Qwen2Config`` with untied embeddings.
    """
    check_choice("tiny model arch", arch, TINY_ARCHS)
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    return TINY_ARCHS[arch](**{**fields, **overrides})


def prepare_tokenizer(tokenizer, pad_token: str = "<pad>"):
    """Make a tokenizer fit the batch conventions: a pad token distinct from EOS, left padding.

    A tokenizer without a pad token gets ``pad_token`` added (load the models with
    ``tokenizer=`` so their embeddings grow to match). A pad token equal to EOS is refused:
    ``response_mask`` ends at the first EOS, so padding that reads as EOS would be
    indistinguishable from a real end of response.

    Args:
        tokenizer: a Hugging Face tokenizer with an EOS token.
        pad_token: the text of the pad token to add when there is none.

    Returns:
        The same tokenizer, modified in place.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token; set tokenizer.eos_token before training")
    if tokenizer.pad_token_id is None:
        tokenizer.add_special_tokens({"pad_token": pad_token})
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError(
            f"the tokenizer's pad token {tokenizer.pad_token!r} is its EOS token: padding after a "
            "response would look like an end of response. Give it a distinct pad token, e.g. "
            f"tokenizer.pad_token = None; prepare_tokenizer(tokenizer) adds {pad_token!r}"
        )
    tokenizer.padding_side = "left"
    return tokenizer


@contextlib.contextmanager
def _quiet_transformers():
    """Silence load reports and progress bars (an expected missing head is not news)."""
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _config_without_dropout(
    source: str | os.PathLike | PretrainedConfig, trust_remote_code: bool = False, **fields
) -> PretrainedConfig:
    """The source's config (a copy) with every dropout probability set to 0 and ``fields`` set;
    ``trust_remote_code`` lets a folder's own configuration code run (config.json's auto_map)."""
    if isinstance(source, PretrainedConfig):
        config = copy.deepcopy(source)
    else:
        path = os.fspath(source)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"no model folder at {path!r}; {OFFLINE} (or pass a transformers config)")
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    for name, value in config.to_dict().items():
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
            setattr(config, name, 0.0)
    config.classifier_dropout = 0.0  # token-classification heads default to 0.1 otherwise
    for name, value in fields.items():
        setattr(config, name, value)
    return config


def _build(
    auto_cls, source, config: PretrainedConfig, tokenizer, device, dtype, trust_remote_code: bool = False
) -> tuple[PreTrainedModel, set]:
    """Instantiate ``auto_cls`` from a folder or a config (the folder's own model code run only with
    ``trust_remote_code``); returns (model, keys not in the checkpoint)."""
    with _quiet_transformers():
        if isinstance(source, PretrainedConfig):
            model = auto_cls.from_config(config, trust_remote_code=trust_remote_code)
            missing = None
        else:
            model, info = auto_cls.from_pretrained(
                os.fspath(source), config=config, output_loading_info=True, trust_remote_code=trust_remote_code
            )
            missing = set(info["missing_keys"])
    if tokenizer is not None and len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # a pad token was added
    model = model.to(device=device, dtype=dtype).eval()
    if missing is not None:
        _check_finite(model, source)
    return model, missing


def _check_finite(model: PreTrainedModel, source) -> None:
    """Refuse a checkpoint whose weights hold NaN or inf (a diverged run's): it would load, then
    fail at the first step's checks once the run folder exists. One host sync for all tensors."""
    names, params = zip(*model.named_parameters())
    finite = torch.stack([torch.isfinite(p).all() for p in params]).tolist()
    bad = [name for name, ok in zip(names, finite) if not ok]
    if bad:
        raise ValueError(
            f"model folder {os.fspath(source)}: {len(bad)} of its {len(names)} weight tensors hold NaN or inf "
            f"({bad[0]}{', ...' if len(bad) > 1 else ''}); the checkpoint is broken: train or save it again"
        )


def load_causal_lm(
    source: str | os.PathLike | PretrainedConfig,
    tokenizer=None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """The actor or the reference: a causal LM with dropout off, in eval mode.

    Args:
        source: a local folder written by ``save_pretrained``, or a config (fresh random weights).
        tokenizer: if given, the embeddings grow to ``len(tokenizer)`` when it is larger.
        device: where the weights live.
        dtype: weight dtype; float32 for trained models (on CUDA, forward passes autocast to
            bf16, see :func:`refppo.rollout.device.autocast`), bf16 is fine for a frozen reference on CUDA.
        trust_remote_code: run the folder's own Python code (its config.json's ``auto_map``), as
            ``model.trust_remote_code`` allows; transformers refuses such a folder without it.

    Returns:
        A ``PreTrainedModel`` whose forward gives logits (batch, seq, vocab). A folder whose
        weights hold NaN or inf is refused (ValueError).
    """
    config = _config_without_dropout(source, trust_remote_code)
    return _build(AutoModelForCausalLM, source, config, tokenizer, device, dtype, trust_remote_code)[0]


# The attribute transformers' *ForTokenClassification models keep their head in: Llama, Qwen2,
# Mistral, ... use score; GPT-2, BERT, ... classifier. A family that names it otherwise goes here.
VALUE_HEAD_NAMES = ("score", "classifier")


def value_head_name(model: PreTrainedModel) -> str:
    """The attribute holding the scalar head (a Linear: hidden -> 1) of a critic or reward model."""
    for name in VALUE_HEAD_NAMES:
        if isinstance(getattr(model, name, None), torch.nn.Linear):
            return name
    raise ValueError(
        f"{type(model).__name__} has no Linear head named {' or '.join(VALUE_HEAD_NAMES)}: add its name to "
        "VALUE_HEAD_NAMES"
    )


def value_head(model: PreTrainedModel) -> torch.nn.Linear:
    """The scalar head of a critic or reward model: weight (1, hidden), bias (1,)."""
    return getattr(model, value_head_name(model))


def init_value_head(model: PreTrainedModel) -> None:
    """Initialise the scalar head: weight ~ N(0, 1/sqrt(hidden+1)), bias 0, so unit-scale hidden
    states give scores of order 1 (OpenRLHF's std is 1/(hidden+1), and TRL's value head takes
    nn.Linear's own initialisation)."""
    head = value_head(model)
    with torch.no_grad():
        head.weight.normal_(mean=0.0, std=1.0 / (head.in_features + 1) ** 0.5)
        if head.bias is not None:
            head.bias.zero_()


def load_value_model(
    source: str | os.PathLike | PretrainedConfig,
    tokenizer=None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    require_head: bool = False,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """The critic or the reward model: a causal-LM backbone with a scalar head, dropout off.

    ``source`` may be a reward-model folder (its head is loaded, e.g. a critic initialised from
    the reward model), a causal-LM folder such as the SFT model (the backbone is loaded and the
    head freshly initialised by :func:`init_value_head`), or a config (all fresh).

    Args:
        source: a local folder written by ``save_pretrained``, or a config.
        tokenizer: if given, the embeddings grow to ``len(tokenizer)`` when it is larger.
        device: where the weights live.
        dtype: weight dtype.
        require_head: refuse a source without a trained head (a reward model must have one:
            a random head would score noise).
        trust_remote_code: as :func:`load_causal_lm`'s (the folder's code must define an
            ``AutoModelForTokenClassification``).

    Returns:
        A model whose forward gives ``logits`` of shape (batch, seq, 1): one scalar per position.
        A folder whose weights hold NaN or inf is refused (ValueError).
    """
    config = _config_without_dropout(source, trust_remote_code, num_labels=1)
    model, missing = _build(
        AutoModelForTokenClassification, source, config, tokenizer, device, dtype, trust_remote_code
    )
    if missing is None or f"{value_head_name(model)}.weight" in missing:
        if require_head:
            raise ValueError(
                f"{source} holds no trained scalar head (an ordinary language model?); a reward model "
                "must have one: train it with `refppo rm` and point reward_model.model.path at <rm run>/model"
            )
        init_value_head(model)
    return model


# config fields that count a mixture-of-experts model's routed experts (Qwen-MoE, Mixtral, DeepSeek, ...)
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def is_mixture_of_experts(model) -> bool:
    """Whether a model's config (or its text model's) counts routed experts."""
    config = model.config
    configs = [config, getattr(config, "text_config", None)]
    return any(getattr(c, name, None) for c in configs if c is not None for name in EXPERT_COUNTS)


def check_router_losses(model, aux_coeff: float | None, z_coeff: float) -> None:
    """Refuse Megatron's router losses (``actor.moe_aux_loss_coeff``, ``actor.moe_z_loss_coeff``,
    which a verl Megatron line turns on) for a mixture-of-experts model: refppo implements neither.
    A dense model has no router, so no such loss: nothing to refuse.

    Args:
        model: the actor, before any adapter.
        aux_coeff: the load-balancing loss's coefficient (None: the model's own).
        z_coeff: the z-loss's coefficient.
    """
    if not is_mixture_of_experts(model):
        return
    if aux_coeff is None or aux_coeff > 0:
        shown = "null (the model's own)" if aux_coeff is None else aux_coeff
        raise ValueError(
            f"actor.moe_aux_loss_coeff={shown} on a mixture-of-experts model: refppo does not implement Megatron's "
            "router load-balancing loss, which verl's Megatron engine adds where its line turns it on "
            "(moe_router_load_balancing_type, vanilla_mbridge); give it 0"
        )
    if z_coeff > 0:
        raise ValueError(
            f"actor.moe_z_loss_coeff={z_coeff} on a mixture-of-experts model: refppo does not implement Megatron's "
            "router z-loss, which verl's Megatron engine adds where its line gives moe_z_loss_coeff; give it 0"
        )


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """Eval mode and no gradients: for the reward model and a separate reference."""
    model.eval()
    model.requires_grad_(False)
    return model


def add_lora(model: PreTrainedModel, r: int = 8, lora_alpha: int = 16, target_modules="all-linear"):
    """Wrap a causal LM in a peft LoRA adapter (dropout 0); only the adapter is trainable.

    The adapter starts as the identity (peft initialises its B matrix to 0), so the wrapped
    model and its adapter-disabled self are the same policy until the first update.

    Args:
        model: a causal LM from :func:`load_causal_lm`.
        r, lora_alpha: the adapter rank and scale.
        target_modules: peft's selector; "all-linear" adapts every linear layer but the LM head.

    Returns:
        A ``peft.PeftModel``.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules, lora_dropout=0.0)
    return get_peft_model(model, config)


def load_lora_adapter(model: PreTrainedModel, path: str):
    """A causal LM under a saved peft LoRA adapter, trainable (verl 0.9's ``lora_adapter_path``:
    ``PeftModel.from_pretrained(..., is_trainable=True)`` in ``FSDPEngine._build_lora_module``),
    with its dropout off as every refppo model's.

    Args:
        model: the base model the adapter was trained on, from :func:`load_causal_lm`.
        path: the adapter's folder (``adapter_config.json`` and its weights).

    Returns:
        A ``peft.PeftModel``; its adapter-disabled self is ``model``.
    """
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(model, path, is_trainable=True)
    for module in adapted.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return adapted


def adapters_off(model):
    """``with adapters_off(model):`` a LoRA model (PEFT's or Megatron's) runs as its base model."""
    if has_megatron_lora(model):
        return adapters_disabled(model)
    return model.disable_adapter()


class LoraDisabledReference:
    """The reference policy of a LoRA actor: the actor itself with its adapter switched off.

    verl's ``ref_in_actor``: the frozen base weights are the SFT model, so the reference costs
    no second copy in memory, only a second forward pass.
    """

    def __init__(self, actor):
        self.actor = actor

    def __call__(self, *args, **kwargs):
        with adapters_off(self.actor):
            return self.actor(*args, **kwargs)

    @property
    def device(self) -> torch.device:
        return self.actor.device


def base_model(model):
    """The Hugging Face model under a LoRA adapter or an adapter-disabled reference (or the model)."""
    if isinstance(model, LoraDisabledReference):
        model = model.actor
    return model.get_base_model() if is_peft(model) else model


def is_peft(model) -> bool:
    """True for a peft-wrapped model."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


def is_lora(model) -> bool:
    """True for a model under a LoRA adapter: PEFT's (``model.lora_rank``) or Megatron's (``model.lora.rank``)."""
    return is_peft(model) or has_megatron_lora(model)


def make_reference(actor, dtype: torch.dtype | None = None):
    """The frozen reference for ``actor``: the adapter-disabled actor if it is a LoRA model,
    else a frozen copy (optionally cast to ``dtype``, e.g. bf16 on CUDA).

    Args:
        actor: the causal LM being trained, before any update (it is the SFT policy).
        dtype: weight dtype of the copy; the actor's by default.

    Returns:
        A callable model with a ``device``, usable wherever a causal LM is.
    """
    if is_lora(actor):
        return LoraDisabledReference(actor)
    ref = copy.deepcopy(actor)
    return freeze(ref if dtype is None else ref.to(dtype))
