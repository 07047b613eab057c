"""benchmarks/profile_step.py: a step's profile split by phase and by kind of work."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from _trainers import make_trainer  # noqa: E402
from profile_step import COLUMNS, kind, phase_table, profile_step  # noqa: E402

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def test_operators_get_their_kind():
    expected = {
        ("aten::addmm", False): "matrix products",
        ("aten::_scaled_dot_product_efficient_attention_backward", False): "attention",
        ("aten::logsumexp", False): "softmax and sampling",
        ("aten::multinomial", False): "softmax and sampling",
        ("aten::_to_copy", False): "copies and casts",
        ("aten::rsqrt", False): "elementwise and other",
        ("aten::mul", True): "optimizer",  # inside Optimizer.step
        ("aten::_foreach_norm", False): "optimizer",  # gradient clipping
        ("AddmmBackward0", False): "autograd engine",
        ("autograd::engine::evaluate_function: AddmmBackward0", False): "autograd engine",
        ("Torch-Compiled Region: 0/1", False): "compiled code",
        ("_ChunkedLogSoftmax", False): None,  # a Python-level range: its own time is Python's
    }
    assert {key: kind(*key) for key in expected} == expected


def event(name, start, end, cpu_us=0.0, device_us=0.0, kernels=0, annotation=False, device_type=CPU):
    return SimpleNamespace(
        name=name,
        time_range=SimpleNamespace(start=start, end=end),
        self_cpu_time_total=cpu_us,
        self_device_time_total=device_us,
        kernels=[None] * kernels,
        is_user_annotation=annotation,
        device_type=device_type,
    )


def test_work_goes_to_the_phase_it_started_in():
    """Operators belong to the phase whose range holds their start, on any thread; ranges and
    kernel events add no work; on CUDA the work is the launched kernels' time."""
    events = [
        event("timing_s/gen", 0, 100, cpu_us=40, annotation=True),
        event("timing_s/update_actor", 200, 400, annotation=True),
        event("Optimizer.step#AdamW.step", 350, 390, cpu_us=5, annotation=True),
        event("aten::mm", 10, 20, cpu_us=10, device_us=3, kernels=1),
        event("aten::mul", 95, 150, cpu_us=55, device_us=4, kernels=2),  # starts in gen, ends after it
        event("aten::mm", 150, 160, cpu_us=10, device_us=9, kernels=1),  # between phases: not counted
        event("AddmmBackward0", 250, 260, cpu_us=7),  # the autograd thread
        event("aten::mm", 252, 258, cpu_us=6, device_us=20, kernels=1),
        event("aten::_foreach_mul_", 360, 370, cpu_us=8, device_us=2, kernels=1),
        event("aten::addcdiv_", 375, 380, cpu_us=3, device_us=1, kernels=1),  # inside Optimizer.step
        event("void gemm_kernel", 252, 258, device_us=20, device_type=CUDA),  # counted with its aten::mm
        event("triton_red_fused_0", 260, 262, cpu_us=2, device_us=6, kernels=1),  # a compiled kernel's launch
        event("triton_red_fused_0", 260, 262, device_us=6, device_type=CUDA),  # and the kernel: counted once
    ]
    walls = {"timing_s/gen": 0.2, "timing_s/update_actor": 0.5}
    cpu = phase_table(events, walls, "cpu")
    assert cpu["timing_s/gen"] == pytest.approx(
        {
            "wall": 0.2,
            "busy": 65e-6,
            **dict.fromkeys(COLUMNS, 0.0),
            "matrix products": 10e-6,
            "elementwise and other": 55e-6,
            "kernels": 3,
        }
    )
    up = cpu["timing_s/update_actor"]
    assert (up["matrix products"], up["autograd engine"], up["optimizer"], up["busy"]) == pytest.approx(
        (6e-6, 7e-6, 11e-6, 26e-6)
    )
    cuda = phase_table(events, walls, "cuda")
    assert (cuda["timing_s/gen"]["busy"], cuda["timing_s/update_actor"]["matrix products"]) == pytest.approx(
        (7e-6, 20e-6)
    )
    assert cuda["timing_s/update_actor"]["compiled code"] == pytest.approx(6e-6)
    assert cuda["timing_s/update_actor"]["busy"] == pytest.approx(29e-6)


def test_a_profiled_step_splits_every_phase():
    """A real step on a CPU: every phase of the step, matrix products in every model pass, the
    optimiser only in the updates, and no phase busier than its wall time."""
    trainer = make_trainer(["algorithm.use_kl_in_reward=true"])
    metrics, events = profile_step(trainer, "cpu", warmup=1)
    walls = {k: v for k, v in metrics.items() if k.startswith("timing_s/") and k != "timing_s/step"}
    table = phase_table(events, walls, "cpu")
    assert (
        set(table)
        == set(walls)
        == {
            f"timing_s/{p}"
            for p in ("gen", "reward", "ref", "old_log_prob", "values", "adv", "update_critic", "update_actor")
        }
    )
    for name, row in table.items():
        assert abs(row["busy"] - sum(row[k] for k in COLUMNS)) < 1e-9
        assert 0 < row["busy"] <= row["wall"], (name, row)
        updates = name in ("timing_s/update_critic", "timing_s/update_actor")
        assert (row["optimizer"] > 0) == updates, (name, row)
        if name not in ("timing_s/reward", "timing_s/adv"):  # the reward is a rule here; GAE has no model
            assert row["matrix products"] > 0, (name, row)
    assert sum(row["busy"] for row in table.values()) < metrics["timing_s/step"]
