"""One whole PPO step (generate, score, reference / old log-probs, values, GAE, critic and actor
updates) on fixed workloads, refppo side by side with TRL's PPO trainer: seconds per step,
tokens per second, peak memory, and the ratio.

Every response runs to the full length (refppo's ``rollout.ignore_eos``; TRL without a stop
token), so the token count of a step is fixed and the two are compared token for token. Both get
the same models: actor, critic and reward model with fresh random weights from one seed, the
reference a frozen copy of the actor; KL in the reward (k1, beta 0.001); one response per prompt;
one optimiser step per mini-batch. TRL is ``trl==0.29.1`` (``pip install -e ".[bench]"``), whose
``trl.experimental.ppo.PPOTrainer`` is its maintained PPO implementation.

The two do not compute the same things, and the difference is part of what is measured: TRL
keeps the logits of every sampling step and takes the old log-probs from them (verl calls this
``bypass``), where refppo recomputes them in a forward pass (``algorithm.rollout_correction.bypass_mode=false``,
verl's default); TRL updates actor and critic with one optimiser on a summed loss, refppo with
two; TRL also computes each micro-batch's entropy for its logs. ``algorithm.rollout_correction.bypass_mode=true`` runs
refppo the way TRL does.

Each side runs in a fresh process (its own peak memory), alternating for ``--rounds`` rounds;
a round is one warm-up step and ``--steps`` timed steps. The summary line per workload gives each
side's median over all its timed steps and ``speedup`` = the second side's median / the first's
(TRL's / refppo's by default). ``--impls refppo+,refppo --plus "k=v ..."`` sets refppo against
itself with the ``--plus`` overrides on one side (``refppo+``), e.g. to measure an option;
``--chunk-elements N`` gives that side another log-softmax block size (rows x vocab elements,
``refppo.accel.logprobs.CHUNK_ELEMENTS``; it matters where the log-softmax runs in blocks: on CUDA,
or with ``actor.use_torch_compile`` or ``model.use_fused_kernels``), with or without ``--plus``.
``--cpu-bf16`` runs both sides' whole steps under the CPU's bf16 autocast (weights and optimisers
float32), as both run on CUDA: whether a CPU with bf16 matrix instructions changes the comparison.

Workloads (issue 15):

- W1: Llama, hidden 128, 4 layers, vocab 512; 16 prompts x (16 + 32) tokens; 1 epoch, 1 mini-batch.
- W2: Llama, hidden 256, 4 layers, vocab 2048; 32 x (16 + 64); 2 epochs, 2 mini-batches.
- W3: Qwen2.5-0.5B's shape (random weights); 64 x (256 + 256); 1 epoch, 1 mini-batch,
  micro-batches of 16; CUDA.
- V: a small model with Qwen2.5's vocabulary (hidden 256, 4 layers, 151,936 tokens); 16 x (16 + 64);
  the LM head and the logits dominate, which is what ``model.use_fused_kernels`` is for.
- Q: verl's quickstart shape: Qwen2.5-0.5B, 256 x (512 + 512), 1 epoch, 4 mini-batches,
  micro-batches of 8; CUDA; refppo only (TRL's gradient accumulation spans the whole batch, so it
  cannot step once per mini-batch in micro-batches).

On CUDA the weights and optimisers are float32 and forward passes autocast to bf16 (TRL's whole
loop included). Peak memory: CUDA, the peak allocated; CPU, the process's peak resident set.

Usage: python benchmarks/bench_ppo_step.py [--workloads W1,W2] [--impls refppo,trl] [--rounds 3]
       [--steps 5] [--threads N] [--device cpu|cuda] [--json out.json] [--plus "key=value ..."]
       [--chunk-elements N] [--cpu-bf16]
       [key=value ...]   (refppo config overrides, e.g. algorithm.rollout_correction.bypass_mode=true)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from bench_args import positive_int
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from refppo.accel import logprobs
from refppo.rollout.models import freeze, load_causal_lm, load_value_model, make_reference, tiny_config
from refppo.settings.config import Config, apply_overrides
from refppo.settings.validate import validate
from refppo.training.trainer import PPOTrainer

QWEN_05B = dict(
    arch="qwen2",
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab=151936,
    tie_word_embeddings=True,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
)
WORKLOADS = {
    "W1": dict(
        model=dict(
            arch="llama", hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, vocab=512
        ),
        prompts=16,
        prompt_len=16,
        response_len=32,
        epochs=1,
        minis=1,
    ),
    "W2": dict(
        model=dict(
            arch="llama", hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, vocab=2048
        ),
        prompts=32,
        prompt_len=16,
        response_len=64,
        epochs=2,
        minis=2,
    ),
    "W3": dict(model=QWEN_05B, prompts=64, prompt_len=256, response_len=256, epochs=1, minis=1, micro=16),
    "Q": dict(model=QWEN_05B, prompts=256, prompt_len=512, response_len=512, epochs=1, minis=4, micro=8),
    "V": dict(
        model=dict(
            arch="qwen2",
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab=QWEN_05B["vocab"],
        ),
        prompts=16,
        prompt_len=16,
        response_len=64,
        epochs=1,
        minis=1,
    ),
}


def word_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A whitespace tokenizer with ``vocab`` ids: <pad>, <bos>, <eos>, then w3 .. w{vocab-1}."""
    words = ["<pad>", "<bos>", "<eos>", *(f"w{i}" for i in range(3, vocab))]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", padding_side="left"
    )


def workload_model(name: str):
    """Workload ``name``'s tokenizer and model config (random weights are drawn from it)."""
    w = WORKLOADS[name]
    spec = dict(w["model"])
    vocab, arch = spec.pop("vocab"), spec.pop("arch")
    tok = word_tokenizer(vocab)
    size = {k: spec.pop(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")}
    spec.setdefault("intermediate_size", 4 * size["hidden_size"])
    return tok, tiny_config(tok, arch, **size, max_position_embeddings=w["prompt_len"] + w["response_len"], **spec)


def shared_models(name: str, device: str, seed: int = 0) -> dict:
    """Everything both implementations share for workload ``name``: the tokenizer, the actor,
    critic and reward model (same seed, so the same weights) and 4 batches of random prompts of
    exactly ``prompt_len`` tokens, as token ids (prompts * 4, prompt_len)."""
    w = WORKLOADS[name]
    tok, model_config = workload_model(name)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model_config.vocab_size, (w["prompts"] * 4, w["prompt_len"]), generator=g)
    torch.manual_seed(seed)
    actor = load_causal_lm(model_config, device=device)
    critic = load_value_model(model_config, device=device)
    reward_model = freeze(load_value_model(model_config, device=device))
    return dict(tokenizer=tok, actor=actor, critic=critic, reward_model=reward_model, ids=ids)


def workload_overrides(name: str, seed: int = 0, extra: tuple[str, ...] = ()) -> list[str]:
    """refppo's settings for workload ``name`` (KL in the reward, k1, beta 0.001), then ``extra``."""
    w = WORKLOADS[name]
    micro = w.get("micro")
    return [
        f"data.train_batch_size={w['prompts']}",
        f"data.max_prompt_length={w['prompt_len']}",
        f"data.max_response_length={w['response_len']}",
        "rollout.ignore_eos=true",
        f"actor.ppo_mini_batch_size={w['prompts'] // w['minis']}",
        f"actor.ppo_epochs={w['epochs']}",
        "algorithm.use_kl_in_reward=true",
        "trainer.critic_warmup=0",
        f"trainer.seed={seed}",
        *(
            [
                f"actor.ppo_micro_batch_size_per_gpu={micro}",
                f"critic.ppo_micro_batch_size_per_gpu={micro}",
                f"rollout.log_prob_micro_batch_size_per_gpu={micro}",
                f"ref.log_prob_micro_batch_size_per_gpu={micro}",
                f"reward_model.micro_batch_size_per_gpu={micro}",
            ]
            if micro
            else []
        ),
        *extra,
    ]


RM_MICRO = "reward_model.micro_batch_size_per_gpu"


def benchmark_config(overrides: list[str]) -> Config:
    """The validated config of ``overrides``. The reward model is passed to the trainer as a
    model, not by ``reward_model.enable`` and a path, so :func:`refppo.settings.validate.validate` would
    refuse its micro-batch size as unread; the trainer reads it for any reward model it is given,
    so it is set after validation."""
    rm_micro = [o for o in overrides if o.startswith(RM_MICRO + "=")]
    config = validate(apply_overrides(Config(), [o for o in overrides if o not in rm_micro]))
    return apply_overrides(config, rm_micro[-1:])


def build(name: str, device: str, seed: int = 0, extra: tuple[str, ...] = ()) -> PPOTrainer:
    """refppo's PPOTrainer for workload ``name`` (:func:`workload_overrides`)."""
    config = benchmark_config(workload_overrides(name, seed, extra))
    m = shared_models(name, device, seed)
    records = [{"prompt": " ".join(f"w{i}" for i in row)} for row in m["ids"].tolist()]
    return PPOTrainer(
        config, m["tokenizer"], m["actor"], m["critic"], records, records[:1], reward_model=m["reward_model"]
    )


def time_refppo(name: str, device: str, steps: int, extra: tuple[str, ...] = (), on_step_end=None) -> dict:
    """refppo: seconds of the warm-up step and of ``steps`` more, and the median phase times.
    ``on_step_end(i)``, if given, runs after step i's time is taken (0 is the warm-up step)."""
    trainer = build(name, device, extra=extra)
    times, metrics = [], []
    for i in range(steps + 1):
        start = time.perf_counter()
        m = trainer.train_step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        metrics.append(m)
        if on_step_end is not None:
            on_step_end(i)
    phases = {
        k.removeprefix("timing_s/"): statistics.median(m[k] for m in metrics[1:])
        for k in metrics[0]
        if k.startswith("timing_s/")
    }
    return {"warmup_step_s": times[0], "step_s_all": times[1:], "phases_s": phases}


def trl_sizes(name: str) -> dict:
    """TRL's batch arguments for the same updates as refppo: rows per forward pass, one optimiser
    step per mini-batch. TRL accumulates gradients over ``gradient_accumulation_steps`` micro-
    batches *of the whole batch* (its batch is per-device size x accumulation), so with several
    mini-batches each mini-batch must be one forward pass."""
    w = WORKLOADS[name]
    mini = w["prompts"] // w["minis"]
    micro = w.get("micro", mini)
    if w["minis"] > 1 and micro != mini:
        raise ValueError(
            f"{name}: TRL cannot step once per mini-batch of {mini} rows in micro-batches of {micro} "
            "(its gradient accumulation spans the whole batch); compare W1, W2, W3"
        )
    per_device = w["prompts"] if w["minis"] > 1 else micro
    return dict(
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=w["prompts"] // per_device,
        num_mini_batches=w["minis"],
        local_rollout_forward_batch_size=micro,
    )


def time_trl(name: str, device: str, steps: int, on_step_end=None) -> dict:
    """TRL 0.29.1's PPO trainer on the same models, prompts and sizes: seconds per step from its
    step-end callbacks. Responses run to the full length (no stop token), KL in the reward (k1,
    the same coefficient), the reference a frozen copy of the actor, no gradient checkpointing.
    On CUDA its whole loop runs under bf16 autocast, as refppo's forward passes do (TRL's own
    ``bf16`` flag leaves generation in float32). ``on_step_end`` as in :func:`time_refppo`."""
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    import datasets
    import transformers
    from transformers import PrinterCallback, TrainerCallback
    from trl.experimental.ppo import PPOConfig
    from trl.experimental.ppo import PPOTrainer as TRLPPOTrainer

    transformers.logging.set_verbosity_error()  # deprecation notes from TRL's calls into transformers

    w = WORKLOADS[name]
    ref_config = Config()
    m = shared_models(name, device)
    times = [time.perf_counter()]

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter())
            if on_step_end is not None:
                on_step_end(len(times) - 2)

    train = datasets.Dataset.from_dict({"input_ids": m["ids"].tolist()})
    precision = torch.autocast("cuda", torch.bfloat16) if device == "cuda" else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as out, precision, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' FutureWarnings, and var() of one value in TRL's logs
        args = PPOConfig(
            output_dir=out,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            logging_steps=10**9,
            num_sample_generations=0,
            seed=0,
            total_episodes=w["prompts"] * (steps + 1),
            response_length=w["response_len"],
            stop_token=None,
            temperature=ref_config.rollout.temperature,
            kl_coef=ref_config.algorithm.kl_ctrl.kl_coef,
            kl_estimator="k1",
            num_ppo_epochs=w["epochs"],
            learning_rate=ref_config.actor.optim.lr,
            use_cpu=device == "cpu",
            **trl_sizes(name),
            gradient_checkpointing=False,
            bf16=device == "cuda",  # TRL's defaults are True; refppo's off
        )
        trainer = TRLPPOTrainer(
            args,
            m["tokenizer"],
            m["actor"],
            make_reference(m["actor"]),
            m["reward_model"],
            train,
            m["critic"],
            eval_dataset=train.select(range(1)),
            callbacks=[StepTimes()],
        )
        trainer.remove_callback(PrinterCallback)  # it prints every step's metrics
        times[0] = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # its "===training policy===" banner
            trainer.train()
    steps_s = [b - a for a, b in zip(times, times[1:])]
    return {"warmup_step_s": steps_s[0], "step_s_all": steps_s[1:], "phases_s": {}}


def device_info(device: str) -> dict:
    """What a measurement ran on: the card (or CPU) and the versions that set its speed."""
    import platform

    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    if device == "cuda":
        info["device"] = torch.cuda.get_device_name()
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            info["driver"] = None
    else:
        info["device"] = platform.processor() or platform.machine()
    return info


def step_record(
    steps_s: list[float],
    phases_s: dict,
    device: str,
    commit: str | None,
    overrides: list[str],
    chunk_elements: int | None,
) -> dict:
    """A step's result as ``benchmarks/results/q_step.json`` keeps it: the median of the timed
    steps (after warm-up), each step, the median phase times, the machine and the settings."""
    return {
        "median_step_s": statistics.median(steps_s),
        "steps": steps_s,
        "phases_s": phases_s,
        **device_info(device),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "overrides": overrides,
        "chunk_elements": chunk_elements or logprobs.CHUNK_ELEMENTS[device],
    }


def set_chunk_elements(n: int | None) -> None:
    """Blocks of ``n`` elements (rows x vocab) for every log-softmax of refppo in this process;
    None keeps refppo's default."""
    if n is not None:
        logprobs.CHUNK_ELEMENTS.update(dict.fromkeys(logprobs.CHUNK_ELEMENTS, n))


def worker(
    impl: str,
    name: str,
    device: str,
    steps: int,
    extra: tuple[str, ...],
    chunk_elements: int | None = None,
    cpu_bf16: bool = False,
) -> dict:
    """One implementation on one workload in this process, with its peak memory: CUDA, the
    peak allocated (weights included); CPU, the process's peak resident set. ``extra``: refppo's
    overrides (refppo+'s ``--plus`` included); ``chunk_elements``: refppo's log-softmax blocks;
    ``cpu_bf16``: every step under the CPU's bf16 autocast (refppo autocasts on CUDA only, so
    this outer context is the one its CPU passes see)."""
    set_chunk_elements(chunk_elements)
    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cpu_bf16):
        r = time_trl(name, device, steps) if impl == "trl" else time_refppo(name, device, steps, extra)
    w = WORKLOADS[name]
    step = statistics.median(r["step_s_all"])
    peak = (
        torch.cuda.max_memory_allocated()
        if device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "impl": impl,
        "workload": name,
        "device": device,
        "overrides": [] if impl == "trl" else list(extra),
        "chunk_elements": None if impl == "trl" else logprobs.CHUNK_ELEMENTS[device],
        "cpu_bf16": cpu_bf16,
        **r,
        "step_s": step,
        "tokens_per_s": w["prompts"] * (w["prompt_len"] + w["response_len"]) / step,
        "generated_tokens_per_s": w["prompts"] * w["response_len"] / r["phases_s"]["gen"]
        if "gen" in r["phases_s"]
        else None,
        "peak_memory_gb": peak / 2**30,
    }


def in_subprocess(
    impl: str,
    name: str,
    device: str,
    steps: int,
    extra: tuple[str, ...],
    threads: int | None,
    chunk_elements: int | None = None,
    cpu_bf16: bool = False,
) -> dict:
    """``worker`` in a fresh Python process, so each side's peak memory is its own."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--worker", "--impls", impl, "--workloads", name, "--device", device]
        cmd += ["--steps", str(steps), "--json", f.name, *(["--threads", str(threads)] if threads else [])]
        cmd += [
            *(["--chunk-elements", str(chunk_elements)] if chunk_elements else []),
            *(["--cpu-bf16"] if cpu_bf16 else []),
            *extra,
        ]
        subprocess.run(cmd, check=True)
        return json.loads(Path(f.name).read_text())[0]


def summary(results: list[dict], impls: list[str]) -> list[dict]:
    """Per workload: each implementation's median step over all its timed steps and rounds, the
    ratio second / first of ``impls`` (the first's speed-up: TRL / refppo by default) overall,
    per round and its median over the rounds."""
    rows = []
    for name in dict.fromkeys(r["workload"] for r in results):
        by = {i: [r for r in results if r["workload"] == name and r["impl"] == i] for i in impls}
        med = {i: statistics.median(t for r in rs for t in r["step_s_all"]) for i, rs in by.items() if rs}
        row = {"workload": name, **{f"{i}_step_s": v for i, v in med.items()}}
        for i, rs in by.items():
            if rs:
                row[f"{i}_peak_memory_gb"] = max(r["peak_memory_gb"] for r in rs)
        if len(med) == 2:
            first, second = impls
            row["speedup"] = med[second] / med[first]
            row["speedup_per_round"] = [t["step_s"] / r["step_s"] for r, t in zip(by[first], by[second])]
            # Neighbouring rounds share the machine's state, so this moves less with its drift.
            row["speedup_median_round"] = statistics.median(row["speedup_per_round"])
        rows.append(row)
    return rows


def checked_choices(
    parser: argparse.ArgumentParser, args: argparse.Namespace, known: tuple[str, ...] = ("refppo", "trl")
) -> tuple[list[str], list[str]]:
    """``--impls`` and ``--workloads`` as lists, after refusing what cannot run, before any work:
    an unknown name (``known`` lists the implementations), TRL not installed, a workload TRL
    cannot run."""
    impls, names = args.impls.split(","), args.workloads.split(",")
    if unknown := set(impls) - set(known):
        parser.error(f"--impls: unknown {sorted(unknown)}; choose from {', '.join(known)}")
    if unknown := set(names) - set(WORKLOADS):
        parser.error(f"--workloads: unknown {sorted(unknown)}; choose from {sorted(WORKLOADS)}")
    if "trl" in impls:
        if importlib.util.find_spec("trl") is None:
            parser.error('TRL is not installed: pip install -e ".[bench]", or run --impls refppo')
        for name in names:
            try:
                trl_sizes(name)
            except ValueError as e:
                parser.error(str(e))
    return impls, names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="W1,W2")
    parser.add_argument("--impls", default="refppo,trl", help="refppo, trl or both (trl needs .[bench])")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds, each side in a fresh process")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round, after one warm-up step")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--plus",
        default="",
        help='the refppo+ side\'s overrides, on top of the others, e.g. "model.use_fused_kernels=true"',
    )
    parser.add_argument(
        "--chunk-elements",
        type=positive_int,
        default=None,
        help="the refppo+ side's log-softmax blocks (rows x vocab elements)",
    )
    parser.add_argument(
        "--cpu-bf16", action="store_true", help="both sides under the CPU's bf16 autocast (--device cpu)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="refppo config overrides, e.g. rollout.cuda_graphs=true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    impls, names = checked_choices(parser, args, ("refppo", "refppo+", "trl"))
    if len(impls) != len(set(impls)) or len(impls) > 2:
        parser.error("--impls: one or two different implementations")
    if ("refppo+" in impls) != bool(
        args.plus or args.chunk_elements
    ) and not args.worker:  # a worker gets refppo+'s among its own
        parser.error("--plus and --chunk-elements change the refppo+ side: use refppo+ with one or both, or neither")
    if args.cpu_bf16 and args.device != "cpu":
        parser.error("--cpu-bf16 is for --device cpu (on CUDA both sides autocast to bf16 already)")
    plus = tuple(args.plus.split())
    try:  # an unknown key or a bad value, before any work (the workload's sizes are checked with them later)
        apply_overrides(Config(), [*args.overrides, *plus])
    except ValueError as e:
        parser.error(str(e))
    if args.worker:
        results = [
            worker(
                impls[0], names[0], args.device, args.steps, tuple(args.overrides), args.chunk_elements, args.cpu_bf16
            )
        ]
    else:
        results = []
        for name in names:
            for round_ in range(args.rounds):
                for impl in impls if round_ % 2 == 0 else impls[::-1]:
                    plus_side = impl == "refppo+"
                    extra = tuple(args.overrides) + (plus if plus_side else ())
                    chunk = args.chunk_elements if plus_side else None
                    r = in_subprocess(impl, name, args.device, args.steps, extra, args.threads, chunk, args.cpu_bf16)
                    results.append(r)
                    phases = "  ".join(f"{k} {v:.2f}" for k, v in r["phases_s"].items())
                    print(
                        f"{name} {impl} round {round_ + 1}: {r['step_s']:.3f} s/step (min {min(r['step_s_all']):.3f}, "
                        f"max {max(r['step_s_all']):.3f}), {r['tokens_per_s']:.0f} tok/s, "
                        + (
                            f"generation {r['generated_tokens_per_s']:.0f} tok/s, "
                            if r["generated_tokens_per_s"]
                            else ""
                        )
                        + f"peak {r['peak_memory_gb']:.2f} GB, "
                        f"warm-up step {r['warmup_step_s']:.1f} s {'| ' + phases if phases else ''}",
                        flush=True,
                    )
                    # rewritten after every side, so a run cut short by a time limit keeps its rounds
                    save(results, args.json)
        for row in summary(results, impls):
            print(json.dumps(row))
    save(results, args.json)


def save(results: list[dict], path: str | None) -> None:
    """Every measured side so far, as a JSON list, at ``path`` (nothing when it is None)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
