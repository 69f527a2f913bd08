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
