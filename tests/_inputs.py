"""Inputs shared by the tests: masks of every shape the code must handle, chat templates, rollouts
of a tiny model, a ragged batch, and a probe of attention calls."""

import contextlib

import torch
from hypothesis import strategies as st

from refppo.rollout.generation import generate
from refppo.rollout.prompts import build_batch, tokenize_prompts
from refppo.tasks.tokenizer import build_tokenizer

PROMPTS = ["12+34=", "7*8=", "999+1=", "hello, world:"]


def rollout(tok, actor, prompts=PROMPTS, **kw):
    """``generate`` on ``prompts``: 12 new tokens, a generator seeded 0, unless ``kw`` says otherwise."""
    ids, mask = tokenize_prompts(tok, prompts)
    kw = {"max_new_tokens": 12, "generator": torch.Generator().manual_seed(0), **kw}
    return generate(actor, ids, mask, tok.eos_token_id, tok.pad_token_id, **kw)


def row_tokens(batch):
    """Each row's unpadded prompt ids and valid response ids, as Python lists."""
    for i in range(batch["prompts"].shape[0]):
        prompt = batch["prompts"][i][batch["attention_mask"][i, : batch["prompts"].shape[1]].bool()].tolist()
        response = batch["responses"][i][batch["response_mask"][i].bool()].tolist()
        yield prompt, response


def ragged_batch(tok, rows=12):
    """Prompts of 2-13 characters and responses of 1-9 tokens (plus EOS), in the rollout layout,
    with random advantages and an index."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 10, (rows,), generator=g).tolist()
    prompts = ["1" * (2 + (5 * i) % 12) + "=" for i in range(rows)]
    batch = build_batch(tok, prompts, ["7" * n for n in lengths])
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"]
    batch["index"] = torch.arange(rows)
    return batch


# Chat templates in the character tokenizer's alphabet: Llama-style (the template writes the BOS,
# and the tokenizer adds one to a text) and Qwen-style (no BOS in the template).
_CHAT_TURNS = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}.{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CHAT_TEMPLATES = {"bos": "{{ bos_token }}" + _CHAT_TURNS, "no bos": _CHAT_TURNS}


@contextlib.contextmanager
def attention_calls(models, record):
    """Yields a list that gets ``record(layer, kwargs)`` at every attention layer's call (inside
    the decoder layer, so a checkpointed layer's recomputation is seen too)."""
    calls = []
    layers = [m for model in models for m in model.modules() if type(m).__name__.endswith("Attention")]
    hooks = [
        m.register_forward_pre_hook(lambda m, args, kw: calls.append(record(m, kw)), with_kwargs=True) for m in layers
    ]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


def chat_tokenizer(template: str = "bos"):
    """The offline tasks' character tokenizer with one of :data:`CHAT_TEMPLATES`."""
    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATES[template]
    return tok


def templateless_tokenizer():
    """The offline tasks' character tokenizer without a chat template, as many a base model's is."""
    tok = build_tokenizer()
    tok.chat_template = None
    return tok


MASK_KINDS = ("full", "ragged", "holes", "with_empty_rows")


def make_mask(kind: str, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """(batch, length) float mask: full, right-padded ragged, random holes, or ragged with empty rows."""
    if kind == "full":
        return torch.ones(batch, length, dtype=torch.float64)
    if kind == "holes":
        m = (torch.rand(batch, length, generator=gen) < 0.7).double()
        m[:, 0] = 1.0
        return m
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    if kind == "with_empty_rows":
        lengths[torch.rand(batch, generator=gen) < 0.3] = 0
        lengths[0] = max(int(lengths[0]), 2)
    return (torch.arange(length)[None, :] < lengths[:, None]).double()


@st.composite
def batches(draw, min_len=1, max_batch=5, max_len=12):
    """Draw (generator, batch, length, mask kind)."""
    seed = draw(st.integers(0, 2**31 - 1))
    batch = draw(st.integers(1, max_batch))
    length = draw(st.integers(min_len, max_len))
    kind = draw(st.sampled_from(MASK_KINDS))
    return torch.Generator().manual_seed(seed), batch, length, kind
