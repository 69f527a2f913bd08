"""AOTAutograd: a Dynamo graph turned into the functional ATen inference graph that
graphopt's passes rewrite, and the boxed calling convention of what it compiles.

`aot_module_simplified` and the boxing helper live in `torch._functorch`, whose layout
and keyword arguments have moved between releases (each is looked up here, with
`inspect` where a keyword is new): a torch upgrade that moves them breaks this file only.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch.fx
from torch._functorch.aot_autograd import aot_module_simplified

try:  # torch >= 2.4 moved the boxing helper out of functorch.compile
    from torch._functorch._aot_autograd.utils import make_boxed_func
except ImportError:  # pragma: no cover - older layouts
    from functorch.compile import make_boxed_func


def aot_inference(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    fw_compiler: Callable[[torch.fx.GraphModule, list], Callable],
) -> Callable:
    """Dynamo graph -> functional ATen inference graph, handed to `fw_compiler`.

    Input mutations (a KV-cache write) are kept inside the graph as a trailing
    `copy_` into the input, so graphopt's passes can turn them back into in-place
    writes; otherwise AOTAutograd would apply them in a Python epilogue.
    """
    accepted = inspect.signature(aot_module_simplified).parameters
    kwargs: dict[str, Any] = {"fw_compiler": fw_compiler}
    if "inference_compiler" in accepted:
        kwargs["inference_compiler"] = fw_compiler
    if "keep_inference_input_mutations" in accepted:
        kwargs["keep_inference_input_mutations"] = True
    return aot_module_simplified(gm, example_inputs, **kwargs)


def boxed(fn: Callable) -> Callable:
    """AOTAutograd calls compiled graphs with one list argument ("boxed")."""
    return make_boxed_func(fn)
