"""Level 2 with frozen weights, stored without them: Inductor's compiled code with its
constants left out, and for each constant how a later process makes it from its own
weights (`constant_specs`), so that it loads the code and binds them (`bind_constants`).

    a constant of the compiled code              is stored as
    a value the passes folded from weights       ("folded", name): its recipe is in the entry
    a weight the C++ GEMM template packed        ("packed", name of what it packed, the view
                                                  it read, the packing as ATen ops)
    a value folded from the graph alone          ("value", tensor): the key covers the graph
    anything else Inductor made                  ("value", tensor), and the entry is keyed
                                                  on the weights' values (not weight-free)

A graph attribute is computed from frozen weights exactly when it has a recipe
(constant_fold.py keeps one for every such value, for refresh()), so a value without
one is the graph's own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from .. import cache
from .._compat.inductor_constants import Recorded
from ..passes.constant_fold import FOLDED_RECIPES

FOLDED_STORAGES = "graphopt_folded_storages"


def constant_specs(recorded: Recorded, gm: torch.fx.GraphModule) -> tuple[dict[str, tuple], str | None]:
    """How each constant of the one graph Inductor compiled from `gm` is made again, and
    why the entry must be keyed on the weights' values (None: it need not be)."""
    if len(recorded.constants) != 1:
        raise ValueError(f"Inductor compiled {len(recorded.constants)} graphs from one, and an entry holds one")
    constants, names = recorded.constants[0], recorded.names[0]
    recipes = gm.meta.get(FOLDED_RECIPES, {})
    folded = {name: getattr(gm, name) for name in recipes if hasattr(gm, name)}
    storages = gm.meta.get(FOLDED_STORAGES, {})
    specs: dict[str, tuple] = {}
    keyed_on_weights = None
    for name, value in constants.items():
        attribute = names.get(name)
        packing = recorded.packing(value)
        if attribute in folded and folded[attribute] is value:
            specs[name] = ("folded", attribute)
        elif isinstance(attribute, str) and attribute not in recipes and getattr(gm, attribute, None) is value:
            specs[name] = ("value", value)
        elif packing is not None and packing.trace is not None and packing.storage in storages:
            specs[name] = ("packed", storages[packing.storage], packing.size, packing.stride, packing.offset,
                           cache.dump_graph(packing.trace))
        else:
            specs[name] = ("value", value)
            keyed_on_weights = keyed_on_weights or f"Inductor made its constant {name} from a value graphopt " \
                                                   "cannot trace back to the weights"
    return specs, keyed_on_weights


def note_folded_storages(gm: torch.fx.GraphModule) -> None:
    """Before Inductor lowers `gm`: which folded value each storage holds. The GEMM
    template drops the weights it packs from the graph module, and a packing names its
    weight by storage."""
    recipes = gm.meta.get(FOLDED_RECIPES, {})
    gm.meta[FOLDED_STORAGES] = {getattr(gm, name).untyped_storage().data_ptr(): name for name in recipes
                                if hasattr(gm, name) and getattr(gm, name).layout == torch.strided}


def bind_constants(specs: dict[str, tuple], values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The compiled code's constants, made from `values` (the folded values, computed
    from this process's weights) as `specs` says."""
    bound: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, spec in specs.items():
            bound[name] = _made(spec, values)
    return bound


def _made(spec: tuple, values: dict[str, torch.Tensor]) -> Any:
    kind = spec[0]
    if kind == "folded":
        return values[spec[1]]
    if kind == "packed":
        _, source, size, stride, offset, dumped = spec
        return cache.load_graph(dumped)(values[source].as_strided(size, stride, offset))
    return spec[1]
