"""Generation with a Qwen2.5-0.5B-shaped model (14 query heads, 2 key/value heads; random
weights): decoding through transformers' SDPA function vs refppo's grouped decode attention
(``refppo.accel.decoding.grouped_decode_attention``, what the static-cache decoder uses), side by
side in one run, with the static-cache decoder run eagerly and compiled (``rollout.cuda_graphs``).

With a mask (always, over a static cache) and under ``torch.compile``, or with transformers before
5.23 at any time, transformers' SDPA path copies each key/value head to its 7 query heads over the
whole KV cache (``repeat_kv``) in every layer at every decoding step. The grouped attention reads
the cache in place. Both sample greedily from the same weights; the share of identical responses
is printed and must be at least 90% (float rounding differs between the two, so a near tie may
break the other way).

Usage: python benchmarks/bench_decode.py [--device cpu|cuda] [--rows 16] [--prompt 256]
       [--response 64] [--layers 24] [--modes eager,compiled] [--rounds 3] [--threads N]
       (W3's shape: --rows 64 --prompt 256 --response 256; Q's: --rows 256 --prompt 512 --response 512)
"""

import argparse
import contextlib
import statistics
from unittest import mock

import torch
from bench_gae import timed  # timed(fn, device, repeats) -> (median seconds, result)
from bench_ppo_step import QWEN_05B, word_tokenizer

from refppo.accel import decoding
from refppo.rollout.generation import generate as sample
from refppo.rollout.models import load_causal_lm, tiny_config

SIDES = ("transformers' SDPA", "grouped")


def qwen_shaped_actor(layers: int, max_len: int, device: str):
    """Qwen2.5-0.5B's shape with ``layers`` layers, fresh random weights (seed 0), and its tokenizer."""
    spec = dict(QWEN_05B, num_hidden_layers=layers, max_position_embeddings=max_len)
    vocab, arch = spec.pop("vocab"), spec.pop("arch")
    tok = word_tokenizer(vocab)
    torch.manual_seed(0)
    return load_causal_lm(tiny_config(tok, arch, **spec), device=device), tok


def generate(side: str, tok, prompts, decoder, response: int) -> tuple[float, dict]:
    """Greedy fixed-length generation on one side; (seconds, batch)."""
    attention = decoding.decode_attention if side == "grouped" else (lambda model: contextlib.nullcontext())
    with mock.patch.object(decoding, "decode_attention", attention):
        return timed(
            lambda: sample(
                decoder,
                prompts,
                torch.ones_like(prompts),
                tok.eos_token_id,
                tok.pad_token_id,
                response,
                do_sample=False,
                ignore_eos=True,
            ),
            decoder.device.type,
            1,
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--layers", type=int, default=QWEN_05B["num_hidden_layers"])
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int)
    a = p.parse_args()
    modes = a.modes.split(",")
    if not set(modes) <= {"eager", "compiled"}:
        p.error(f"--modes takes eager and/or compiled, not {a.modes}")
    if a.threads:
        torch.set_num_threads(a.threads)
    actor, tok = qwen_shaped_actor(a.layers, a.prompt + a.response, a.device)
    prompts = torch.randint(3, len(tok), (a.rows, a.prompt), generator=torch.Generator().manual_seed(0))
    tokens = a.rows * a.response
    print(
        f"device={a.device} torch={torch.__version__} threads={torch.get_num_threads()} rows={a.rows} "
        f"prompt={a.prompt} response={a.response} layers={a.layers}; seconds per generate, median of "
        f"{a.rounds} alternating rounds after a warm-up (which compiles)"
    )
    for mode in modes:
        decoder = decoding.StaticDecoder(actor, a.prompt + a.response, compile=mode == "compiled")
        batches = {side: generate(side, tok, prompts, decoder, a.response)[1] for side in SIDES}
        same = (batches[SIDES[0]]["responses"] == batches[SIDES[1]]["responses"]).all(dim=1).float().mean().item()
        assert same >= 0.9, f"{mode}: only {same:.0%} of greedy responses are the same on both sides"
        times = {side: [] for side in SIDES}
        for _ in range(a.rounds):
            for side in SIDES:
                times[side].append(generate(side, tok, prompts, decoder, a.response)[0])
        med = {side: statistics.median(t) for side, t in times.items()}
        for side in SIDES:
            print(
                f"{mode:8s} {side:18s} {med[side]:.3f} s ({min(times[side]):.3f}-{max(times[side]):.3f}), "
                f"{tokens / med[side]:,.0f} tok/s"
            )
        print(f"{mode:8s} speed-up {med[SIDES[0]] / med[SIDES[1]]:.2f}x; identical greedy responses {same:.0%}")


if __name__ == "__main__":
    main()
