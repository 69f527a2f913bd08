"""torch.distributed as a compiled graph meets it: whether a process group is up, and
the group a functional collective names in the graph.

A functional collective carries its group as a name (`group_name`); the name is
resolved through `distributed_c10d._resolve_process_group`, private: a torch upgrade
that moves it breaks this file only.
"""

from __future__ import annotations

from typing import Any

import torch


def distributed_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def process_group_named(name: str) -> Any:
    """The process group a functional collective names in the graph (its `group_name`)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)
