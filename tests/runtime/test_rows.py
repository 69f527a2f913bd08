"""Padding only where rows are independent (runtime/rows.py, row_rules.py).

Every model here is a Linear + ReLU followed by one more operation, run through
`graphopt.optimize` with the default configuration (level 1, device graphs on,
dim 0 of every tensor input dynamic), capture sizes 1, 2, 4 and 8, over a stream
of batch sizes of which 3, 5, 6 and 7 would be padded. Every call must give
eager's numbers; a graph that mixes rows must be captured at each batch's exact
size with the op and the user's line in the report; a row-wise one must still pad.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from support import unexpected_fallbacks

import graphopt
from graphopt import FallbackKind
from graphopt.config import tolerance

STREAM = (3, 5, 7, 6, 3, 5, 7, 6, 8, 2)
CONFIG = graphopt.GraphOptimizationConfig(graph_opt_level=1, max_num_seqs=8, cudagraph_num_of_warmups=1)


class Model(torch.nn.Module):
    def __init__(self, then: Callable):
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 6)
        self.register_buffer("table", torch.randn(10, 6))
        self.then = then

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.then(self, torch.relu(self.a(x)))


def _experts(m: Model, h: torch.Tensor, back: Callable) -> torch.Tensor:
    """A mixture of experts in miniature, as transformers' `grouped_mm` experts run:
    each row's two best of 6 experts, the entries sorted by expert, each scaled by
    its expert's row of the table, then put back (`back(x, perm)`) and summed per row."""
    keys, perm = torch.sort(h.topk(2, dim=-1).indices.view(-1))
    return back(h[perm // 2] * m.table[keys], perm)


def _inverse(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return x[inv].view(-1, 2, 6).sum(1)


def _positions(perm: torch.Tensor) -> torch.Tensor:
    """Where each entry went in the sorted order (the inverse permutation), as floats."""
    return torch.zeros(perm.shape).index_put_([perm], torch.arange(perm.numel()).float())


# The table: each of these mixes rows, and padding changed its numbers.
MIXING = {
    "h - h.mean(0)": (lambda m, h: h - h.mean(0), "aten.mean"),
    "softmax(h, dim=0)": (lambda m, h: torch.softmax(h, dim=0), "aten._softmax"),
    "h.sum()": (lambda m, h: h.sum() * m.b(h), "aten.sum"),
    "sort(h, dim=0)": (lambda m, h: torch.sort(h, dim=0).values, "aten.sort"),
    "h.t() @ h": (lambda m, h: h.t() @ h, "aten.mm"),
    "h.amax(0)": (lambda m, h: h.amax(0), "aten.amax"),
    "h.flip(0)": (lambda m, h: h.flip(0), "aten.flip"),
    "h[-1]": (lambda m, h: h[-1], "aten.select"),
    "layer norm across the batch": (lambda m, h: F.layer_norm(h.t(), (h.shape[0],)).t(), "aten.native_layer_norm"),
    "h @ h.t()": (lambda m, h: h @ h.t(), "aten.mm"),
    "h.cumsum(0)": (lambda m, h: h.cumsum(0), "aten.cumsum"),
    "h[1:]": (lambda m, h: h[1:] * 2, "aten.slice"),
    "h / batch size": (lambda m, h: h / h.shape[0], "batch size as a number"),
    "rows indexed by data": (lambda m, h: h[h[:, 0].argsort()], "in the order of the sort"),
    "batch norm over the batch": (lambda m, h: F.batch_norm(h, None, None, training=True), "batch_norm"),
    # What a sort moves must come back before it meets anything but row-wise ops.
    "a scan along sorted rows": (lambda m, h: _experts(m, h, lambda x, p: _inverse(x.cumsum(0), p)),
                                 "aten.cumsum"),
    "sorted positions as numbers": (lambda m, h: _experts(m, h, lambda x, p: x[:h.shape[0]] * p[:h.shape[0], None]),
                                    "aten.slice"),
    "sorted rows beside unsorted ones": (lambda m, h: _experts(m, h, lambda x, p: x.view(-1, 2, 6).sum(1) + h),
                                         "aten.view"),
    "the inverse used as a number": (lambda m, h: _experts(
        m, h, lambda x, p: _inverse(x, p) * _positions(p).view(-1, 2).sum(1, keepdim=True)), "aten.sum"),
    "sorted rows returned": (lambda m, h: _experts(m, h, lambda x, p: x), "in the order of the sort"),
}

# Row-wise: these must keep padding (captures only at capture sizes).
ROWWISE = {
    "linear": lambda m, h: m.b(h),
    "softmax over features": lambda m, h: torch.softmax(h, -1),
    "layer norm": lambda m, h: F.layer_norm(h, (6,)),
    "h - h.mean(1)": lambda m, h: h - h.mean(1, keepdim=True),
    "views": lambda m, h: h.view(h.shape[0], 2, 3).transpose(1, 2).reshape(h.shape[0], 6),
    "lookup per row": lambda m, h: m.table[(h > 0).long().sum(-1)] + h,
    "cat along features": lambda m, h: torch.cat([h, h * 2], 1)[:, :6],
    "arange(b) as a column": lambda m, h: h + torch.arange(h.shape[0])[:, None],
    "a shared row expanded": lambda m, h: h + m.table[0].expand(h.shape[0], 6),
    "attention over heads": lambda m, h: F.scaled_dot_product_attention(
        *[h.view(-1, 1, 2, 3)] * 3).reshape(-1, 6),
    "rows gathered by arange": lambda m, h: h[torch.arange(h.shape[0]), (h > 0).long().argmax(-1)][:, None] * h,
    "pairs rotated as complex numbers": lambda m, h: torch.view_as_real(
        torch.view_as_complex(h.view(-1, 3, 2)) * torch.view_as_complex(m.table[:3, :2].contiguous())).flatten(1),
    # In place after reinplace_intermediates (gelu_, hardswish_), which torch does not tag pointwise.
    "activations a CNN runs": lambda m, h: F.hardswish(F.gelu(h * 2)),
    "rows sorted by expert and put back": lambda m, h: _experts(m, h, _inverse),
    "rows sorted by expert and added back": lambda m, h: _experts(
        m, h, lambda x, p: torch.zeros_like(h).index_add_(0, p // 2, x)),
}


def _stream(model: torch.nn.Module, inputs: Callable[[int], tuple], dtype: torch.dtype = torch.float32,
            config=CONFIG, **kwargs) -> graphopt.Report:
    """`model` through optimize() over STREAM's batches (`inputs(batch)`), each against eager."""
    opt = graphopt.optimize(model, config, **kwargs)
    atol, rtol = tolerance(dtype)
    with torch.inference_mode():
        for batch in STREAM:
            args = inputs(batch)
            torch.testing.assert_close(opt(*args), model(*args), atol=atol, rtol=rtol,
                                       msg=lambda m: f"batch {batch}: {m}\n{opt.report()}")
    return opt.report()


def _run(then: Callable, config=CONFIG) -> graphopt.Report:
    torch.manual_seed(0)
    return _stream(Model(then).eval(), lambda batch: (torch.randn(batch, 6),), config=config)


@pytest.mark.parametrize("name", MIXING)
def test_a_graph_that_mixes_rows_gives_eagers_numbers_at_exact_sizes(name: str) -> None:
    then, op = MIXING[name]
    report = _run(then)
    sizes = {c.size for c in report.captures}
    assert sizes <= set(STREAM) and sizes & {3, 5, 6, 7}, f"{name}: not captured at exact sizes\n{report}"
    reasons = report.reasons(FallbackKind.EXACT_SIZE)
    assert len(reasons) == 1 and op in reasons[0] and "test_rows.py:" in reasons[0], str(report)


@pytest.mark.parametrize("name", ROWWISE)
def test_a_rowwise_graph_still_pads(name: str) -> None:
    report = _run(ROWWISE[name])
    assert sorted({c.size for c in report.captures}) == [4, 8], str(report)
    assert not unexpected_fallbacks(report), str(report)


def test_a_graph_break_on_a_count_of_rows_gives_eagers_numbers() -> None:
    """`.item()` splits the step in two graphs: the first counts rows, so it must not pad."""

    def then(m: Model, h: torch.Tensor) -> torch.Tensor:
        n = int((h > 0).sum().item())
        return m.b(h) * (1 / (1 + n))

    report = _run(then, CONFIG.replace(cache_dir=None))
    assert any("aten.sum" in r for r in report.reasons(FallbackKind.EXACT_SIZE)), report


def test_no_call_pads_a_mixing_graph_not_even_the_first(monkeypatch) -> None:
    """Warm-ups, captures and replays alike run at the batch's own size."""
    from graphopt.runtime.static_inputs import StaticInputs

    sizes = []
    fill = StaticInputs.fill
    monkeypatch.setattr(StaticInputs, "fill", lambda self, args, batch, size: (
        sizes.append((batch, size)), fill(self, args, batch, size))[1])
    _run(MIXING["h - h.mean(0)"][0])
    assert sizes and all(batch == size for batch, size in sizes), sizes


def test_a_custom_op_declared_rowwise_keeps_padding() -> None:
    @torch.library.custom_op("graphopt_test::scale_rows", mutates_args=())
    def scale_rows(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @scale_rows.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    then = lambda m, h: torch.ops.graphopt_test.scale_rows(h)  # noqa: E731
    report = _run(then)
    assert any("graphopt_test.scale_rows" in r for r in report.reasons(FallbackKind.EXACT_SIZE)), report
    torch._dynamo.reset()
    report = _run(then, CONFIG.replace(rowwise_ops=["graphopt_test::scale_rows"]))
    assert sorted({c.size for c in report.captures}) == [4, 8], str(report)


def test_a_table_beside_the_batch_is_not_taken_for_it() -> None:
    """A lookup table of 10 rows passed beside ids of 3 to 7: the ids are the batch."""

    def step(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return table[ids] * 2

    table = torch.randn(10, 4)
    opt = graphopt.optimize(step, CONFIG)
    with torch.inference_mode():
        for batch in STREAM:
            ids = torch.randint(0, 10, (batch,))
            torch.testing.assert_close(opt(table, ids), step(table, ids))
    report = opt.report()
    assert sorted({c.size for c in report.captures}) == [4, 8], str(report)
    assert not unexpected_fallbacks(report), str(report)
    assert "dim 0 of 'ids'" in str(report), str(report)


def test_rowwise_ops_must_name_ops() -> None:
    with pytest.raises(ValueError, match="rowwise_ops must be a list of op names"):
        graphopt.GraphOptimizationConfig(graph_opt_level=1, rowwise_ops=["not an op"])
    assert graphopt.GraphOptimizationConfig(graph_opt_level=1, rowwise_ops=["mylib::op"]).rowwise_ops == ["mylib.op"]


class Experts(torch.nn.Module):
    """transformers' `grouped_mm` experts: 4 experts, 2 per row, the entries sorted by
    expert and multiplied in groups whose bounds count the sorted keys (`counted`)."""

    def __init__(self, counted: str):
        super().__init__()
        self.router = torch.nn.Linear(8, 4)
        self.w = torch.nn.Parameter(torch.randn(4, 8, 8))
        self.counted = counted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.router(x).softmax(-1).topk(2, dim=-1)
        if self.counted == "keys without a bound":
            experts = (x[:, :2].abs() * 2).long().clamp(0, 3)
        keys, perm = torch.sort(experts.view(-1))
        counted = experts.view(-1) if self.counted == "unsorted keys" else keys
        offsets = torch.cumsum(torch.histc(counted.float(), bins=4, min=0, max=3), 0, dtype=torch.int32)
        # grouped_mm's meta function takes bfloat16 only.
        y = torch._grouped_mm(x[perm // 2].bfloat16(), self.w.bfloat16(), offs=offsets).float()
        y = y * weights.view(-1)[perm, None]
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel())
        return y[inv].view(-1, 2, 8).sum(1)


@pytest.mark.parametrize("counted", ["sorted keys", "unsorted keys", "keys without a bound"])
def test_experts_pad_only_when_grouped_by_their_own_sorted_keys(counted: str) -> None:
    try:
        torch._grouped_mm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(1, 8, 8, dtype=torch.bfloat16),
                          offs=torch.tensor([2], dtype=torch.int32))
    except (AttributeError, RuntimeError) as error:
        pytest.skip(f"this torch has no CPU grouped_mm: {error}")
    torch.manual_seed(0)
    report = _stream(Experts(counted).eval(), lambda batch: (torch.randn(batch, 8),), torch.bfloat16)
    sizes = sorted({c.size for c in report.captures})
    if counted == "sorted keys":
        assert sizes == [4, 8] and not unexpected_fallbacks(report), str(report)
    else:
        assert set(sizes) & {3, 5, 6, 7}, str(report)
        assert any("aten.histc" in r for r in report.reasons(FallbackKind.EXACT_SIZE)), str(report)


class Attend(torch.nn.Module):
    """graphopt::decode_attention over a slot cache of 8 sequences and a scratch slot."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.randn(9, 2, 16, 8))
        self.register_buffer("v", torch.randn(9, 2, 16, 8))

    def forward(self, q: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return torch.ops.graphopt.decode_attention(q, self.k, self.v, slots, positions, 0.35) * 2


def test_decode_attention_reads_its_own_rows_so_it_pads() -> None:
    import graphopt.kernels.decode_attention  # noqa: F401 - registers the op

    torch.manual_seed(0)
    report = _stream(Attend().eval(), lambda batch: (torch.randn(batch, 4, 1, 8), torch.randint(0, 16, (batch, 1)),
                                                     torch.randperm(8)[:batch]), pad_values={"slots": 8})
    assert sorted({c.size for c in report.captures}) == [4, 8] and not unexpected_fallbacks(report), str(report)
