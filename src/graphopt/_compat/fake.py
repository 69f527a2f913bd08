"""Fake tensors: the FakeTensorMode a compile runs in, entered and left.

Dynamo, AOTAutograd and Inductor trace on fake tensors (`torch._subclasses.fake_tensor`)
under a mode they keep in `torch._guards`' tracing context; graphopt's passes and its
fake run find that mode, trace in it as torch does, and step outside it to make real
tensors (a folded constant, a packed weight). Those names are private and have moved:
a torch upgrade that moves them breaks this file only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
import torch.fx


def fake_mode_of(gm: torch.fx.GraphModule) -> Any:
    """The FakeTensorMode the graph's `meta["val"]` values belong to, or None."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])


def backend_fakes(example_inputs: Sequence[Any]) -> tuple[Any, list[Any]]:
    """The fake mode a compiler backend traces in, and `example_inputs` as its fake
    values (with the symbolic sizes Dynamo gave them); (None, []) outside one."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(list(example_inputs))
    if mode is None:
        return None, []
    return mode, [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]


@contextlib.contextmanager
def fake_tracing(fake_mode: Any) -> Iterator[None]:
    """Run ops on fake tensors in `fake_mode` as Dynamo and AOTAutograd do, under the
    Python dispatcher: composite ops (linear's 3-D fold) then decompose in Python
    with `sym_size`. Without it torch 2.11 reads a C++ `sizes()`, which specialises
    the batch symbol to the traced value for the rest of the compile."""
    from torch._dispatch.python import enable_python_dispatcher

    with fake_mode, enable_python_dispatcher():
        yield


def outside_fake_mode() -> Any:
    """A context that runs real tensors while a compiler's FakeTensorMode is active
    (passes run inside AOTAutograd's and Inductor's tracing)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return bool(_is_fake(tensor))
