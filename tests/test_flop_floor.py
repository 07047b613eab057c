"""benchmarks/flop_floor.py: the recorder counts a step's products and replays their layouts."""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from flop_floor import ProductRecorder, _layout, _materialise, replay_seconds  # noqa: E402

aten = torch.ops.aten


def recorded(fn) -> ProductRecorder:
    recorder = ProductRecorder()
    with recorder:
        fn()
    return recorder


def total_flops(recorder: ProductRecorder) -> int:
    return sum(n * recorder.flops[key] for key, n in recorder.calls.items())


def test_products_and_cpu_attention_are_counted_by_call():
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5), torch.randn(7, 5), torch.randn(7)
    a, c = torch.randn(2, 3, 4), torch.randn(2, 4, 6)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)

    def forward():
        F.linear(x, w, b)
        F.linear(x, w, b)  # the same layout again: one distinct call, counted twice
        torch.bmm(a, c)
        F.scaled_dot_product_attention(q, k, v)
        torch.exp(x)  # not a product: not recorded

    recorder = recorded(forward)
    linear, bmm, attention = 2 * 3 * 5 * 7, 2 * 2 * 3 * 4 * 6, 2 * (2 * 1 * 2 * 4 * 6 * 8)  # QK^T and PV
    assert total_flops(recorder) == 2 * linear + bmm + attention
    assert sum(recorder.calls.values()) == 4 and len(recorder.calls) == 3
    packets = {key[0]._overloadpacket for key in recorder.calls}
    assert aten._scaled_dot_product_flash_attention_for_cpu in packets


def test_attention_backward_on_cpu_is_counted():
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v)
    recorder = recorded(lambda: out.sum().backward())
    # Five products of 1 x 2 x 4 x 4 x 8 multiply-adds: the scores recomputed, then the gradients
    # of the scores, of V, of Q and of K (torch's count for a flash-attention backward).
    assert total_flops(recorder) == 5 * (2 * 1 * 2 * 4 * 4 * 8)
    assert {key[0]._overloadpacket for key in recorder.calls} == {
        aten._scaled_dot_product_flash_attention_for_cpu_backward
    }


def test_layouts_are_replayed_with_their_shapes_strides_and_dtypes():
    base = torch.randn(4, 6)
    for t in (base, base.t(), base[:, ::2], torch.randn(3, 1).expand(3, 5), torch.zeros(2, 3, dtype=torch.long)):
        (copy,) = _materialise(_layout((t,)))
        assert (copy.shape, copy.stride(), copy.dtype) == (t.shape, t.stride(), t.dtype)
        if t.is_floating_point():
            assert bool(copy.isfinite().all()) and bool((copy != 0).any())


def test_a_replay_dtype_replaces_only_floating_tensors():
    layout = _layout((torch.randn(4, 6).t(), torch.zeros(3, dtype=torch.long), 2.0))
    wide, index, scalar = _materialise(layout, torch.bfloat16)
    assert (wide.dtype, wide.shape, wide.stride()) == (torch.bfloat16, (6, 4), (1, 6))
    assert index.dtype == torch.long and scalar == 2.0


def test_a_recorded_call_replays():
    recorder = recorded(lambda: torch.mm(torch.randn(8, 16), torch.randn(16, 4).t().contiguous().t()))
    (key,) = recorder.calls
    assert recorder.flops[key] == 2 * 8 * 16 * 4
    assert replay_seconds(key, "cpu", repeats=3) > 0
    assert replay_seconds(key, "cpu", repeats=3, dtype=torch.bfloat16) > 0


def test_grouped_query_attention_counts_every_query_head():
    """Keys and values shared by groups of query heads (enable_gqa; Qwen2.5's 14 query heads read 2
    key/value heads): each query head still does its products (torch's formulas refused these shapes
    before 2.13; on the H100's torch 2.11 the recorder failed on W3)."""
    q = torch.randn(1, 4, 5, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, 6, 8, requires_grad=True) for _ in range(2))

    def step():
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True).sum().backward()

    product = 2 * 1 * 4 * 5 * 6 * 8  # one (5 x 8) @ (8 x 6)-sized product per query head
    assert total_flops(recorded(step)) == 2 * product + 5 * product  # forward QK^T, PV; backward as above
