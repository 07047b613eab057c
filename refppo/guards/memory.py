"""Memory of a PPO run (appendix A2, note 004.14): arithmetic for any model size, and a meter.

The arithmetic counts bytes per parameter for what a network holds between steps (weights,
gradients, optimiser state) and bytes per token for what a training forward pass keeps for the
backward pass (activations). :func:`held_bytes` counts the same quantities from a live model and
optimiser, and :class:`PeakMeter` measures the peak of the tensors a block of code allocates,
on any device, so the arithmetic can be checked on a tiny model.
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Bytes per parameter of a trained network with AdamW: (weights, gradients, optimiser state).
# fp32: 4 + 4 + two fp32 moments. Mixed precision computes with bf16 weights and gradients and
# keeps an fp32 master copy beside the two moments: 2 + 2 + 12. Both total 16.
TRAINED_BYTES = {"fp32": (4, 4, 8), "bf16-mixed": (2, 2, 12)}
FROZEN_BYTES = {"fp32": 4, "bf16-mixed": 2}  # a frozen network (reference, reward model): weights only


def param_count(config, value_head: bool = False) -> int:
    """Parameters of a ``transformers`` model built from ``config``, counted without memory.

    Args:
        config: a ``PretrainedConfig`` (e.g. ``Qwen2Config(hidden_size=3584, ...)``).
        value_head: count the critic / reward model (a one-output head in place of the vocabulary
            head, as ``refppo.rollout.models.load_value_model`` builds it) instead of the causal LM.

    Returns:
        The number of parameters (the model is built on the meta device: no weights allocated).
    """
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    config = copy.deepcopy(config)
    if value_head:
        config.num_labels = 1
    auto = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    return sum(p.numel() for p in model.parameters())


def state_bytes(
    n_params: int, trained: bool = True, precision: str = "bf16-mixed", processes: int = 1
) -> dict[str, int]:
    """What a network holds between steps, in bytes, on each process.

    Args:
        n_params: its parameter count.
        trained: trained with AdamW (weights, gradients, two moments) or frozen (weights only).
        precision: "fp32" or "bf16-mixed" (bf16 compute, fp32 master weights and moments).
        processes: how many processes shard it with FSDP2 (``torchrun``): each holds a 1/processes
            share of every entry (the whole weights of one layer at a time exist only during its
            pass, and count as activations).

    Returns:
        ``{"weights", "gradients", "optimizer"}`` in bytes on one process (gradients exist during
        the update; the optimiser entry includes the fp32 master weights under mixed precision).
    """
    if precision not in TRAINED_BYTES:
        raise ValueError(f"precision={precision!r}; valid: {', '.join(TRAINED_BYTES)}")
    if processes < 1:
        raise ValueError(f"processes={processes} must be at least 1")
    share = -(-n_params // processes)  # rounded up: FSDP2 pads each parameter to whole rows per process
    if not trained:
        return {"weights": share * FROZEN_BYTES[precision], "gradients": 0, "optimizer": 0}
    weights, grads, optimizer = TRAINED_BYTES[precision]
    return {"weights": share * weights, "gradients": share * grads, "optimizer": share * optimizer}


def layer_values(config, seq_len: int | None = None) -> tuple[int, int]:
    """Values one decoder layer keeps per token for the backward pass, and how many of them are
    float32 whatever the weights' dtype (see :func:`activation_values_per_token`).

    Args:
        config: a Llama- or Qwen2-style ``PretrainedConfig``.
        seq_len: the padded width of a micro-batch that carries an attention mask; None without one.

    Returns:
        (values, float32 values), per token.
    """
    if seq_len is not None and seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: a masked micro-batch is at least one token wide (None: no mask)")
    h = config.hidden_size
    i = config.intermediate_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q = heads * head_dim
    kv = q if seq_len is not None else config.num_key_value_heads * head_dim
    return 2 * (3 * h + 1) + q + 2 * kv + q + heads + 4 * i + (seq_len or 0), 2 * (h + 1) + heads


def activation_values_per_token(config, seq_len: int | None = None) -> int:
    """Values a Llama/Qwen2 decoder (``transformers``, SDPA attention) saves for the backward
    pass per token of a training forward, the vocabulary logits aside.

    Per layer, as autograd saves them: each RMSNorm keeps its input, the inverse RMS (one value),
    the normalised input and its output (3h + 1, twice); attention keeps q, k, v, its output and
    a log-sum-exp per head; the SwiGLU MLP keeps the gate, its SiLU, the up projection and their
    product (4 x intermediate). The final RMSNorm adds 3h + 1. Without an attention mask k and v
    are kept at their key-value width. With one (a batch with padding, as every PPO batch whose
    prompts or responses differ in length; transformers drops a mask with nothing masked),
    transformers copies k and v to every query head (``repeat_kv``) before attention and keeps the
    copies, and each layer keeps the mask in the compute dtype: ``seq_len`` values per token.
    Besides these, a micro-batch keeps the rotary tables (cos and sin: 2 x sequence length x
    head_dim values, shared by its rows). Some of these values are float32 whatever the weights'
    dtype (:func:`float32_values_per_token`). Activation checkpointing keeps fewer
    (:func:`refppo.accel.checkpointing.checkpointed_activation_bytes`). Checked to the byte against
    a CPU's forward pass (``tests/test_memory.py``); a GPU's attention kernels may keep a little more.

    Args:
        config: a Llama- or Qwen2-style ``PretrainedConfig``.
        seq_len: the padded width of a micro-batch that carries an attention mask; None for a pass
            without one.

    Returns:
        Values per token (multiply by tokens and bytes per value: :func:`activation_bytes`).
    """
    per_layer, _ = layer_values(config, seq_len)
    return config.num_hidden_layers * per_layer + 3 * config.hidden_size + 1


def float32_values_per_token(config) -> int:
    """Of :func:`activation_values_per_token`, the values kept in float32 even by a model whose
    weights are bf16: each RMSNorm works on a float32 copy of its input and keeps it and the
    inverse RMS (h + 1), and attention keeps its log-sum-exp per head in float32.

    Args:
        config: a Llama- or Qwen2-style ``PretrainedConfig``.

    Returns:
        Values per token.
    """
    _, per_layer = layer_values(config, None)
    return config.num_hidden_layers * per_layer + config.hidden_size + 1


def activation_bytes(
    config, tokens: int, logit_tokens: int, bytes_per_value: int = 2, seq_len: int | None = None
) -> int:
    """Bytes of activations a training step holds: what the forward pass keeps for the backward pass.

    Args:
        config: a Llama- or Qwen2-style ``PretrainedConfig``.
        tokens: tokens in the micro-batch (rows x sequence length, prompts included).
        logit_tokens: positions whose vocabulary logits are computed (the response tokens and
            the position before them).
        bytes_per_value: the weights' bytes per value: 4 for float32, 2 for bf16 weights (as FSDP's
            bf16 mixed precision computes); :func:`float32_values_per_token` are 4 bytes either way.
            bf16 autocast over float32 weights keeps another mix, not counted here.
        seq_len: the micro-batch's padded width when it carries an attention mask (see
            :func:`activation_values_per_token`); None without one.

    Returns:
        Bytes: the decoder's activations plus one float32 vocabulary row per logit position
        (the log-softmax works in float32).
    """
    values = activation_values_per_token(config, seq_len)
    wide = float32_values_per_token(config)
    return bytes_of_values(config, tokens, logit_tokens, values, wide, bytes_per_value)


def bytes_of_values(config, tokens: int, logit_tokens: int, values: int, wide: int, bytes_per_value: int) -> int:
    """Bytes of ``values`` per token over ``tokens`` tokens, ``wide`` of them float32, plus one
    float32 vocabulary row per logit position.

    Args:
        config: a ``PretrainedConfig`` (its ``vocab_size``).
        tokens, logit_tokens: as :func:`activation_bytes`.
        values, wide: values kept per token, and how many of them are float32.
        bytes_per_value: 4 (float32 weights) or 2 (bf16 weights).

    Returns:
        Bytes.
    """
    if bytes_per_value not in (2, 4):
        raise ValueError(f"bytes_per_value={bytes_per_value}; valid: 4 (float32) or 2 (bf16 weights)")
    return tokens * (values * bytes_per_value + wide * (4 - bytes_per_value)) + logit_tokens * config.vocab_size * 4


# Bytes of Python objects per record while the preference task makes its comparisons or
# demonstrations, at their peak (the records and the prompts they come from; tests/test_memory.py).
SYNTHETIC_RECORD_BYTES = 450


def rollout_bytes(config, rows: int, prompt_length: int, response_length: int, bytes_per_value: int = 4) -> int:
    """Bytes a rollout of ``rows`` sequences holds at least, all rows decoding at once: the key/value
    cache of every row at full length, and three float32 vocabulary rows per row in the sampling
    step (the logits, the probabilities and their cumulative sum). A lower bound: the forward
    passes and the update need more.

    Args:
        config: a Llama- or Qwen2-style ``PretrainedConfig``.
        rows: sequences generated together (``data.train_batch_size * rollout.n``).
        prompt_length, response_length: ``data.max_prompt_length``, ``data.max_response_length``.
        bytes_per_value: of the cache: 4 for float32, 2 for bf16.

    Returns:
        Bytes.
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    cache = 2 * config.num_hidden_layers * kv_heads * head_dim * (prompt_length + response_length) * bytes_per_value
    return rows * (cache + 3 * config.vocab_size * 4)


def _tensor_bytes(tensors) -> int:
    """Bytes of the tensors, of a sharded one (an FSDP2 DTensor) this process's shard only."""
    local = (t.to_local() if hasattr(t, "to_local") else t for t in tensors if torch.is_tensor(t))
    return sum(t.numel() * t.element_size() for t in local)


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """What a live network holds, counted from its tensors (compare :func:`state_bytes`).

    Args:
        model: the network.
        optimizer: its optimiser, after at least one step (Adam creates its state lazily).

    Returns:
        ``{"weights", "gradients", "optimizer"}`` in bytes on this process (of a model sharded
        with FSDP2, its shards): every parameter; one gradient of its parameter's size for each
        trained one (freed between steps by ``zero_grad``); the
        optimiser's state tensors (Adam's step counters, scalars, aside).
    """
    params = list(model.parameters())
    state = optimizer.state.values() if optimizer is not None else []
    return {
        "weights": _tensor_bytes(params),
        "gradients": _tensor_bytes(p for p in params if p.requires_grad),
        "optimizer": sum(_tensor_bytes(v for v in s.values() if torch.is_tensor(v) and v.dim() > 0) for s in state),
    }


class PeakMeter(TorchDispatchMode):
    """Measures the bytes of tensors allocated inside a ``with`` block: now and at the peak.

    Every tensor an operation returns is counted once per storage until that storage is freed,
    on any device (CPU included, where ``torch.cuda.max_memory_allocated`` has no equivalent).
    Tensors that existed before the block (weights, optimiser state) are not counted.

    Example::

        with PeakMeter() as meter:
            loss = model(**batch).logits.sum()
            loss.backward()
        meter.peak  # bytes
    """

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}  # storage address -> bytes
        self.now = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def _count(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        # a view or in-place result shares an input's storage: new memory only if nothing held it
        if key in self.live or key in inputs or storage.nbytes() == 0:
            return
        self.live[key] = storage.nbytes()
        self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t, inputs)
        return out
