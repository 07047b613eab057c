"""One whole PPO step (generate, score, reference / old log-probs, values, GAE, critic and actor
updates) on fixed workloads: seconds per step, tokens per second and peak memory.

Every response runs to the full length (``rollout.ignore_eos``), so the token count of a step
is fixed and two implementations can be compared token for token. The four models are
separate: actor, critic and reward model with fresh random weights from a config, the
reference a frozen copy of the actor; KL in the reward (k1, beta 0.001); one response per prompt.

Workloads (issue 15):

- W1: Llama, hidden 128, 4 layers, vocab 512; 16 prompts x (16 + 32) tokens; 1 epoch, 1 mini-batch.
- W2: Llama, hidden 256, 4 layers, vocab 2048; 32 x (16 + 64); 2 epochs, 2 mini-batches.
- W3: Qwen2.5-0.5B's shape (random weights); 64 x (256 + 256); 1 epoch, 1 mini-batch; CUDA.
- Q: verl's quickstart shape: Qwen2.5-0.5B, 256 x (512 + 512), 1 epoch, 4 mini-batches; CUDA.

On CUDA the weights and optimisers are float32 and forward passes autocast to bf16.

Usage: python benchmarks/bench_ppo_step.py [--workloads W1,W2] [--steps 5] [--device cpu|cuda]
       [--json out.json] [key=value ...]   (config overrides, e.g. rollout.cuda_graphs=true)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from refppo.config import Config, apply_overrides, validate
from refppo.models import freeze, load_causal_lm, load_value_model, tiny_config
from refppo.trainer import PPOTrainer

QWEN_05B = dict(
    arch="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    intermediate_size=4864, vocab=151936, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
)  # fmt: skip
WORKLOADS = {
    "W1": dict(model=dict(arch="llama", hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=4, vocab=512), prompts=16, prompt_len=16, response_len=32, epochs=1, minis=1),
    "W2": dict(model=dict(arch="llama", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=4, vocab=2048), prompts=32, prompt_len=16, response_len=64, epochs=2, minis=2),
    "W3": dict(model=QWEN_05B, prompts=64, prompt_len=256, response_len=256, epochs=1, minis=1, micro=16),
    "Q": dict(model=QWEN_05B, prompts=256, prompt_len=512, response_len=512, epochs=1, minis=4, micro=8),
}  # fmt: skip


def word_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A whitespace tokenizer with ``vocab`` ids: <pad>, <bos>, <eos>, then w3 .. w{vocab-1}."""
    words = ["<pad>", "<bos>", "<eos>", *(f"w{i}" for i in range(3, vocab))]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", padding_side="left"
    )


def build(name: str, device: str, seed: int = 0, extra: tuple[str, ...] = ()) -> PPOTrainer:
    """A PPOTrainer for workload ``name`` with random prompts of exactly ``prompt_len`` tokens."""
    w = WORKLOADS[name]
    spec = dict(w["model"])
    vocab, arch = spec.pop("vocab"), spec.pop("arch")
    tok = word_tokenizer(vocab)
    size = {k: spec.pop(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")}
    spec.setdefault("intermediate_size", 4 * size["hidden_size"])
    length = w["prompt_len"] + w["response_len"]
    model_config = tiny_config(tok, arch, **size, max_position_embeddings=length, **spec)
    micro = w.get("micro")
    overrides = [
        f"data.train_batch_size={w['prompts']}", f"data.max_prompt_length={w['prompt_len']}",
        f"data.max_response_length={w['response_len']}", "rollout.ignore_eos=true",
        f"actor.ppo_mini_batch_size={w['prompts'] // w['minis']}", f"actor.ppo_epochs={w['epochs']}",
        "algorithm.use_kl_in_reward=true", "trainer.critic_warmup=0", f"trainer.seed={seed}", *extra,
        *([f"actor.ppo_micro_batch_size_per_gpu={micro}", f"critic.ppo_micro_batch_size_per_gpu={micro}",
           f"rollout.log_prob_micro_batch_size_per_gpu={micro}", f"ref.log_prob_micro_batch_size_per_gpu={micro}",
           f"reward_model.micro_batch_size_per_gpu={micro}"] if micro else []),
    ]  # fmt: skip
    config = validate(apply_overrides(Config(), overrides))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (w["prompts"] * 4, w["prompt_len"]), generator=g)
    records = [{"prompt": " ".join(f"w{i}" for i in row)} for row in ids.tolist()]
    torch.manual_seed(seed)
    actor = load_causal_lm(model_config, device=device)
    critic = load_value_model(model_config, device=device)
    reward_model = freeze(load_value_model(model_config, device=device))
    return PPOTrainer(config, tok, actor, critic, records, records[:1], reward_model=reward_model)


def measure(name: str, device: str, steps: int, extra: tuple[str, ...] = ()) -> dict:
    """Median seconds per step over ``steps`` steps after one warm-up step (timed apart: it
    holds the compilation when ``rollout.cuda_graphs=true``)."""
    trainer = build(name, device, extra=extra)
    start = time.perf_counter()
    trainer.train_step()  # warm-up: allocator, kernels, optimiser state, compilation
    warmup = time.perf_counter() - start
    times, metrics = [], []
    for _ in range(steps):
        start = time.perf_counter()
        m = trainer.train_step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        metrics.append(m)
    w = WORKLOADS[name]
    tokens = w["prompts"] * (w["prompt_len"] + w["response_len"])
    phases = {k.removeprefix("timing_s/"): statistics.median(m[k] for m in metrics) for k in metrics[0] if k.startswith("timing_s/")}
    return {
        "workload": name,
        "device": device,
        "overrides": list(extra),
        "warmup_step_s": warmup,
        "step_s": statistics.median(times),
        "step_s_all": times,
        "tokens_per_s": tokens / statistics.median(times),
        "generated_tokens_per_s": w["prompts"] * w["response_len"] / phases["gen"],
        "peak_memory_gb": max(m["perf/max_memory_allocated_gb"] for m in metrics),
        "phases_s": phases,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="W1,W2")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("overrides", nargs="*", help="extra config overrides, e.g. rollout.cuda_graphs=true")
    args = parser.parse_args()
    results = []
    for name in args.workloads.split(","):
        r = measure(name, args.device, args.steps, tuple(args.overrides))
        results.append(r)
        phases = "  ".join(f"{k} {v:.2f}" for k, v in r["phases_s"].items())
        print(
            f"{name} {args.device} {' '.join(args.overrides)}: {r['step_s']:.3f} s/step (min {min(r['step_s_all']):.3f}, max {max(r['step_s_all']):.3f}), "
            f"{r['tokens_per_s']:.0f} tok/s, generation {r['generated_tokens_per_s']:.0f} tok/s, "
            f"peak {r['peak_memory_gb']:.2f} GB, warm-up step {r['warmup_step_s']:.1f} s | {phases}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
