"""Inductor's kernel templates within graphopt's compiles: each Jinja source parsed once."""

from __future__ import annotations

from graphopt._compat import inductor


def test_a_kernel_templates_source_is_parsed_once_within_a_compile():
    """Inductor parses and compiles a template's source at every render (each GEMM's
    candidates, then the final code); inside graphopt's compiles once per source."""
    from torch._inductor.codegen.common import KernelTemplate

    source = "{{ a }} + {{ b | indent_except_first(1) }}"
    outside = KernelTemplate._template_from_string(source)
    assert KernelTemplate._template_from_string(source) is not outside
    with inductor.templates_parsed_once():
        first = KernelTemplate._template_from_string(source)
        assert KernelTemplate._template_from_string(source) is first
        assert first.render(a=1, b="x\ny") == "1 + x\n    y"
    assert KernelTemplate._template_from_string(source) is not first


def test_a_gemm_weight_is_blocked_without_an_empty_pad_and_to_the_same_values(monkeypatch):
    """The C++ GEMM template pads a constant weight to its block width, then blocks it:
    with nothing to pad, the pad is a whole copy of the weight. Inside graphopt's
    compiles it is skipped, and the blocked weight is the same."""
    import torch
    from torch._inductor import compile_fx  # noqa: F401 - the template's module imports only after it
    from torch._inductor.codegen.cpp_gemm_template import CppGemmTemplate

    w = torch.randn(64, 96)  # [k, n]: n = 96 in blocks of 32, or of 64 with 32 padded
    expected = {padding: CppGemmTemplate.block_weight(w, [(96 + padding) // block, 64, block], padding)
                for padding, block in ((0, 32), (32, 64))}
    pads = []
    pad = torch.nn.functional.pad
    monkeypatch.setattr(torch.nn.functional, "pad", lambda *a, **k: pads.append(a[1]) or pad(*a, **k))
    with inductor.lighter_templates():
        for padding, block in ((0, 32), (32, 64)):
            blocked = CppGemmTemplate.block_weight(w, [(96 + padding) // block, 64, block], padding)
            assert torch.equal(blocked, expected[padding]) and blocked.is_contiguous()
    assert pads == [(0, 32)]  # the one weight that needed padding
