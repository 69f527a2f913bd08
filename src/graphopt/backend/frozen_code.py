"""Level 2 with frozen weights, stored without them: Inductor's compiled code with its
constants left out, and for each constant how a later process makes it from its own
weights (`constant_specs`), so that it loads the code and makes them (`make_constants`).

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

from typing import Any, Callable

import torch
import torch.fx

from .. import cache
from .._compat import fake
from .._compat.inductor_constants import Recorded
from ..passes.constant_fold import FOLDED_RECIPES
from . import packing

FOLDED_STORAGES = "graphopt_folded_storages"


def constant_specs(recorded: Recorded, gm: torch.fx.GraphModule) -> tuple[dict[str, tuple], str | None]:
    """How each constant of the one graph Inductor compiled from `gm` is made again, and
    why the entry must be keyed on the weights' values (None: it need not be)."""
    if len(recorded.constants) != 1:
        raise ValueError(f"Inductor compiled {len(recorded.constants)} graphs from one, and an entry holds one")
    constants, names = recorded.constants[0], recorded.names[0]
    if constants is None:
        raise ValueError("this torch's compiled graph did not say where its constants came from")
    recipes = gm.meta.get(FOLDED_RECIPES, {})
    folded = {name: getattr(gm, name) for name in recipes if hasattr(gm, name)}
    storages = gm.meta.get(FOLDED_STORAGES, {})
    specs: dict[str, tuple] = {}
    keyed_on_weights = None
    for name, value in constants.items():
        attribute = names.get(name)
        packed = recorded.packing(value)
        if attribute in folded and folded[attribute] is value:
            specs[name] = ("folded", attribute)
        elif isinstance(attribute, str) and attribute not in recipes and getattr(gm, attribute, None) is value:
            specs[name] = ("value", value)
        elif packed is not None and packed.trace is not None and packed.storage in storages:
            specs[name] = ("packed", storages[packed.storage], packed.size, packed.stride, packed.offset,
                           cache.dump_graph(packed.trace))
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


class StaleCode(RuntimeError):
    """Raised by the call of a graph built from a stored trace whose code refresh() let
    go (`LoadedCode.repack`), before it runs: the step is traced and compiled again."""


class LoadedCode:
    """A stored level-2 frozen graph's code, loaded with its constants made from this
    process's `weights` (by the names its recipes read). `remake()` (refresh()) makes
    them again from the weights as they are now, into the same tensors: no compile.
    `stale` says why the code was let go, once it has been (`repack`)."""

    def __init__(self, code: Callable, stored: dict, weights: dict[str, torch.Tensor],
                 constants: dict[str, torch.Tensor]):
        self.code, self.stored, self.weights, self.constants = code, stored, weights, constants
        self.held = [weights]  # what the frozen watch points at reassigned weights
        self._boxed_call = getattr(code, "_boxed_call", False)  # Dynamo's calling convention
        self.stale: str | None = None

    def __call__(self, *args: Any) -> Any:
        return self.code(*args)

    def remake(self) -> bool:
        """Make the constants again from the weights; False (nothing changed) where a
        value a pass read differs, which the code may rest on: it must be compiled again."""
        made = make_constants(self.stored["constants"], self.stored["frozen"], self.weights)
        if isinstance(made, str):
            return False
        with torch.no_grad():
            for name, spec in self.stored["constants"].items():
                if spec[0] != "value":
                    self.constants[name].copy_(made[name])
        return True

    def repack(self) -> None:
        """refresh() of a graph built from a stored trace, which has no Dynamo graph to
        compile again: where a value a pass may have read changed, the code (and the
        packed weights it holds) is let go, and the graph's frozen watch raises StaleCode
        at its next call (api/traces.py traces the step again, as a first start would)."""
        if self.stale is None and not self.remake():
            self.stale = ("a value folded from the weights that a pass may have read changed, and its code may "
                          "rest on the old value")
            self.code = self.constants = None


def make_constants(specs: dict[str, tuple], frozen: dict, weights: dict[str, torch.Tensor]) -> dict | str:
    """The compiled code's constants made from `weights` (this process's, by the names
    the entry's recipes read) as `specs` says, or why the entry does not fit them (a
    value a pass read differs). A packed weight is made by one graph, its fold and
    packing composed (packing.py), so its folded value is never made on its own."""
    recipes = dict(frozen["recipes"])
    values: dict[str, torch.Tensor] = {}

    def folded(name: str) -> torch.Tensor:
        if name not in values:
            for read in _reads(recipes[name]):  # an earlier folded value, by name
                folded(read)
            values[name] = _run(cache.load_graph(recipes[name], values), weights)
        return values[name]

    with fake.outside_fake_mode(), torch.inference_mode(False), torch.no_grad():
        changed = read_changed(frozen, folded)
        if changed is not None:
            return changed
        constants = {}
        for name, spec in specs.items():
            if spec[0] == "folded":
                constants[name] = folded(spec[1])
            elif spec[0] == "packed":
                constants[name] = _packed(spec, recipes, folded, weights)
            else:
                constants[name] = spec[1]
    return constants


def read_changed(frozen: dict, folded: Callable[[str], torch.Tensor]) -> str | None:
    """Why a frozen entry does not fit this process's weights: a value a pass may have
    read (kept by digest) folds to another value (`folded` gives it by name); or None."""
    for name, digest in frozen["read"].items():
        if cache.tensor_digest(folded(name)) != digest:
            return f"its folded value {name} differs from the one the passes read when it was compiled (the " \
                   "weights changed)"
    return None


def _packed(spec: tuple, recipes: dict, folded: Callable, weights: dict) -> torch.Tensor:
    _, source, size, stride, offset, dumped = spec
    packing_graph = cache.load_graph(dumped)
    if _reads(recipes[source]):  # a recipe reading folded values by name: made in two steps
        return packing_graph(folded(source).as_strided(size, stride, offset))
    recipe = cache.load_graph(recipes[source])
    whole = packing.composed(recipe, (size, stride, offset), packing_graph)
    inputs = [weights[p.target] for p in recipe.graph.find_nodes(op="placeholder")]
    try:
        whole = packing.simplify(whole, inputs)
    except Exception:  # noqa: BLE001, S110 - an op without a meta kernel: the composed graph, unsimplified
        pass
    return whole(*inputs)


def _run(recipe: torch.fx.GraphModule, weights: dict) -> torch.Tensor:
    return recipe(*[weights[p.target] for p in recipe.graph.find_nodes(op="placeholder")])


def _reads(dumped: dict) -> list[str]:
    """The values a stored recipe reads by name (get_attr of one it does not hold)."""
    return [target for op, _, target, _ in dumped["nodes"] if op == "get_attr" and target not in dumped["attributes"]]
