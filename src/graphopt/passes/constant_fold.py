"""Constant folding: compute once, at optimize time, what depends only on constants.

Folded values become non-persistent buffers `_folded_<i>` of the GraphModule, read by
get_attr nodes. A value computed from frozen parameters keeps a recipe (a small
GraphModule from those parameters to the value) in `gm.meta`, so that
`refresh_folded_constants` can recompute it in place after a weight update; the same
recipe over the same tensors in another graph of the model reads the same value
(shared_weights.py).
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Callable

import torch
import torch.fx

from .._compat import fake
from .._compat.names import OpOverload, tree_leaves
from . import shared_weights
from .base import GraphFacts, PassResult, attribute, has_effect, is_view

# Set by the backend with freeze_parameters=True: {placeholder name: real tensor}.
FROZEN_INPUTS = "graphopt_frozen_inputs"
# Set here: {attribute name: recipe GraphModule}, in the order the values were folded.
FOLDED_RECIPES = "graphopt_folded_recipes"
# A folded value may always take this much, even when computed from scalars alone.
MIN_BOUND_BYTES = 64 * 1024
# Passes read constants up to this many elements for their values (algebraic.py's fill values).
READ_NUMEL = 4096


def fold_constants(gm: torch.fx.GraphModule) -> PassResult:
    """Evaluate each subgraph that reads only constants once; the graph reads the result.

        before:  w = placeholder (a frozen parameter);  s = aten.mul(w, 0.5);  y = aten.mm(x, s)
        after:   _folded_0 = get_attr[_folded_0];  y = aten.mm(x, _folded_0)

    Constants are tensor attributes (get_attr), ops on constants with constant
    arguments (`arange`, `full`, `zeros`, ...), and, only with freeze_parameters=True,
    the parameters and buffers in `gm.meta["graphopt_frozen_inputs"]`, except those
    the graph writes (a KV cache). Without freezing, parameters stay live inputs, so
    a later `load_state_dict` is seen.

    Never folded: random ops and ops with effects, values written in place or returned
    (a returned buffer would be shared by every call), and views of constants: a
    view costs nothing at run time, and `t(w)` must stay for recompose_linear. A
    one-element value computed from frozen parameters stays too, because Inductor
    inlines one-element constants into its kernels, where a refresh cannot reach them.

    Memory bound: a folded value, and every intermediate computed for it, is at most
    max(the bytes of the constant tensors it is computed from, 64 KiB), so an
    `expand` of a weight into a huge tensor is not materialised.
    """
    frozen = gm.meta.get(FROZEN_INPUTS, {})
    recipes = gm.meta.setdefault(FOLDED_RECIPES, {})
    sources = _constants(gm, frozen)
    # Fold the constants something live needs, directly or through a view (views stay).
    needed: set[torch.fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if node in sources and any(u not in sources or (u in needed and is_view(u)) for u in node.users):
            needed.add(node)
    folds = [n for n in gm.graph.nodes if n in needed and n.op == "call_function" and not is_view(n)]
    folds = [n for n in folds if not (_from_frozen(sources[n], recipes) and _numel(n) <= 1)]
    made = {node: _recipe(gm, node, recipes) for node in folds if _from_frozen(sources[node], recipes)}
    shared = {node: shared_weights.key(recipe, frozen) for node, recipe in made.items()}
    values = {node: value for node in folds if (value := shared_weights.find(shared.get(node))) is not None}
    values.update(_evaluate(gm, [n for n in folds if n not in values], frozen))
    for node, found in shared.items():
        shared_weights.share(found, values.get(node))
    folded = sum(_into_buffer(gm, node, values.get(node), made.get(node), recipes) is not None for node in folds)
    _erase_unread(gm, sources)
    return PassResult(changed=folded > 0, counts={"folded": folded} if folded else {})


def fold_node(gm: torch.fx.GraphModule, node: torch.fx.Node,
              compute: Callable[[], torch.Tensor] | None = None) -> torch.fx.Node | None:
    """Fold one node as fold_constants would (a buffer, a refresh recipe when it
    reads frozen parameters), for passes that create a node of constants, such as a
    layout conversion of a weight. Returns the get_attr now read instead, or None
    when `node` does not read only constants or is over the memory bound. `compute`,
    called only where the node folds, gives its value where the pass computes it better
    than running the node would (in the memory of a value the fold frees)."""
    frozen = gm.meta.get(FROZEN_INPUTS, {})
    recipes = gm.meta.setdefault(FOLDED_RECIPES, {})
    sources = _constants(gm, frozen)
    if node not in sources or node.op != "call_function":
        return None
    recipe = _recipe(gm, node, recipes) if _from_frozen(sources[node], recipes) else None
    value = shared_weights.computed(recipe, frozen, compute or (lambda: _evaluate(gm, [node], frozen).get(node)))
    attr = _into_buffer(gm, node, value, recipe, recipes)
    _erase_unread(gm, sources)
    return attr


def constant_nodes(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes whose values fold_constants could fold (frozen parameters, tensor
    attributes, and what is computed from them alone within the memory bound)."""
    return set(_constants(gm, gm.meta.get(FROZEN_INPUTS, {})))


def _into_buffer(gm: torch.fx.GraphModule, node: torch.fx.Node, value: object,
                 recipe: torch.fx.GraphModule | None, recipes: dict) -> torch.fx.Node | None:
    """Store `value` as a new `_folded_<i>` buffer (refreshed by `recipe` where it reads
    frozen parameters) and make `node`'s readers read it."""
    if not isinstance(value, torch.Tensor):
        return None
    name = next(f"_folded_{i}" for i in itertools.count() if not hasattr(gm, f"_folded_{i}"))
    gm.register_buffer(name, value, persistent=False)
    if gm.meta.get("graphopt_level") == 2:
        _allow_constants_in_inductor(gm)
    if recipe is not None:
        recipes[name] = recipe
    with gm.graph.inserting_before(node):
        attr = gm.graph.get_attr(name)
    attr.meta = dict(node.meta)
    node.replace_all_uses_with(attr)
    return attr


def _allow_constants_in_inductor(gm: torch.fx.GraphModule) -> None:
    """Inductor hands a constant to a kernel it calls as a library (SDPA on CPU, reading
    a folded causal mask) as the real tensor, under the compile's fake mode, which
    refuses real tensors unless told otherwise. Inductor's freezing, which adds
    constants to the graph as folding does, tells it so."""
    mode = fake.fake_mode_of(gm)
    if mode is not None:
        mode.allow_non_fake_inputs = True


def _erase_unread(gm: torch.fx.GraphModule, sources: dict) -> None:
    """Erase the constant ops nothing reads any more (what only the folded values read),
    and the earlier folded values (`sources`) nothing reads any more, with their buffers
    and recipes (not one just folded, which its caller may not have wired yet, nor one a
    pass may have read to decide a rewrite: its digest keys the stored graph): a
    weight folded into a concatenation, then quantized from it, would otherwise keep the
    full-precision concatenation alive beside the quantized one for nothing."""
    for node in reversed(gm.graph.nodes):
        if node in sources and node.op == "call_function" and not node.users:
            gm.graph.erase_node(node)
        elif node in sources:
            drop_if_unread(gm, node)


def drop_if_unread(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """Erase `node`, a get_attr of a folded value, where nothing reads it any more, with
    its buffer and recipe once no other get_attr reads them (not a value a pass may have
    read: its digest keys the stored graph). A pass that packs a folded weight for
    oneDNN calls this on the dense weight, whose packed copy's recipe holds its own: the
    dense concatenation of Q/K/V or gate/up would otherwise stay beside the packed one."""
    if node.op == "get_attr" and node.target.startswith("_folded_") and not node.users \
            and not may_be_read(attribute(gm, node.target)):
        gm.graph.erase_node(node)
        if not gm.graph.find_nodes(op="get_attr", target=node.target):
            delattr(gm, node.target)
            gm.meta.get(FOLDED_RECIPES, {}).pop(node.target, None)


def may_be_read(value: torch.Tensor) -> bool:
    """Whether a pass may have read a folded value to decide a rewrite: small or integral ones."""
    return value.layout == torch.strided and (value.numel() <= READ_NUMEL or not value.dtype.is_floating_point)


def refresh_folded_constants(gm: torch.fx.GraphModule) -> int:
    """Recompute, in place, every folded value that depends on frozen parameters
    from their current values; returns how many were recomputed. In place: the
    buffers keep their addresses, so captured device graphs stay valid."""
    frozen = gm.meta.get(FROZEN_INPUTS, {})
    # At level 2 Inductor's C++ GEMM template packs a constant weight and drops the original
    # from the module; refresh() compiled that graph again from the current weights (repack.py).
    recipes = {name: recipe for name, recipe in gm.meta.get(FOLDED_RECIPES, {}).items() if hasattr(gm, name)}
    with fake.outside_fake_mode(), torch.inference_mode(False), torch.no_grad():
        for name, recipe in recipes.items():  # in folding order: later recipes read earlier values
            args = [frozen[p.target] for p in recipe.graph.find_nodes(op="placeholder")]
            getattr(gm, name).copy_(recipe(*args))
    return len(recipes)


def _constants(gm: torch.fx.GraphModule, frozen: dict) -> dict[torch.fx.Node, frozenset]:
    """Every constant node -> the constant tensors (placeholders, get_attrs) it is computed from."""
    facts = GraphFacts(gm.graph)
    untouchable = facts.written | facts.returned
    sources: dict[torch.fx.Node, frozenset] = {}
    for node in gm.graph.nodes:
        if node in untouchable:
            continue
        if node.op == "placeholder" and node.name in frozen:
            sources[node] = frozenset([node])
        elif node.op == "get_attr" and isinstance(attribute(gm, node.target), torch.Tensor):
            sources[node] = frozenset([node])
        elif node.op == "call_function" and all(i in sources for i in node.all_input_nodes) \
                and _foldable_op(node):  # the cheap test first: most nodes read a non-constant
            reads = frozenset().union(*(sources[i] for i in node.all_input_nodes))
            size = _numel_bytes(node)
            bound = max(sum(_numel_bytes(r) or 0 for r in reads), MIN_BOUND_BYTES)
            if size is not None and (is_view(node) or size <= bound):
                sources[node] = reads
    return sources


def _foldable_op(node: torch.fx.Node) -> bool:
    target = node.target
    if has_effect(node):
        return False
    if target is operator.getitem:
        return True
    return isinstance(target, OpOverload) and not target._schema.is_mutable


def _numel_bytes(node: torch.fx.Node) -> int | None:
    """Bytes of the tensors a node computes; None unless they all have static shapes."""
    leaves = tree_leaves(node.meta.get("val"))
    if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves) \
            or not all(isinstance(s, int) for t in leaves for s in t.shape):
        return None
    return sum(t.numel() * t.element_size() for t in leaves)


def _numel(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) else 0


def _from_frozen(reads: frozenset, recipes: dict) -> bool:
    """Whether a value changes when a frozen parameter is updated: it reads a frozen
    placeholder, or a folded value that does."""
    return any(r.op == "placeholder" or r.target in recipes for r in reads)


def _evaluate(gm: torch.fx.GraphModule, folds: list[torch.fx.Node], frozen: dict) -> dict:
    """Real values of `folds`. A node whose op fails on real tensors is left out, and so
    is everything computed from it. Each other value is dropped once its last reader has
    run: quantizing a weight computes four float32 copies of it on the way."""
    needed = _ancestors(folds)
    order = [n for n in gm.graph.nodes if n in needed]
    last_reader = {i: node for node in order for i in node.all_input_nodes}
    keep = set(folds)
    env: dict[torch.fx.Node, object] = {}
    with fake.outside_fake_mode(), torch.inference_mode(False), torch.no_grad():
        for node in order:
            if node.op == "placeholder":
                env[node] = frozen[node.name]
            elif node.op == "get_attr":
                env[node] = attribute(gm, node.target)
            elif all(i in env for i in node.all_input_nodes):
                args, kwargs = torch.fx.map_arg((node.args, node.kwargs), env.__getitem__)
                try:
                    env[node] = node.target(*args, **kwargs)
                except Exception:  # noqa: BLE001 - such an op simply stays in the graph
                    pass
                del args, kwargs
            for i in node.all_input_nodes:
                if last_reader[i] is node and i not in keep:
                    env.pop(i, None)
    return {node: env[node] for node in folds if node in env}


def _recipe(gm: torch.fx.GraphModule, node: torch.fx.Node, recipes: dict) -> torch.fx.GraphModule:
    """A GraphModule computing `node` from its constants: one placeholder per frozen
    parameter (named like the graph's), get_attr for attributes. A folded value it reads
    that has a recipe is computed from that recipe in it, so that the recipe holds no
    folded value, which can then be freed once the graph stops reading it."""
    ancestors = _ancestors([node])
    part = [n for n in gm.graph.nodes if n in ancestors]
    inlined = {n: recipes[n.target] for n in part if n.op == "get_attr" and n.target in recipes}
    graph, env, inputs, attrs = torch.fx.Graph(), {}, {}, {}
    # The placeholders first: a recipe is called with the frozen parameters in their order.
    for n in part:
        reads = inlined[n].graph.find_nodes(op="placeholder") if n in inlined else [n] if n.op == "placeholder" else []
        for p in reads:
            if p.target not in inputs:
                inputs[p.target] = graph.placeholder(p.target)
    for n in part:
        if n in inlined:
            env[n] = _copied(graph, inlined[n], inputs, attrs)
        elif n.op == "placeholder":
            env[n] = inputs[n.target]
        else:
            env[n] = graph.node_copy(n, env.__getitem__)
            if n.op == "get_attr":
                attrs[n.target] = attribute(gm, n.target)
    graph.output(env[node])
    return torch.fx.GraphModule(attrs, graph)


def recipe_of_call(gm: torch.fx.GraphModule, source: torch.fx.Node, op: Any,
                   args: tuple) -> torch.fx.GraphModule | None:
    """The refresh recipe of `op(source, *args)` (a weight's packing, say), `source` a
    frozen parameter or a folded value with a recipe; None for any other source, which
    no frozen parameter changes. A folded source's recipe is copied in rather than read
    by name: the source may be freed once the graph stops reading it, and its name
    reused by a later fold, which a recipe reading it by name would then read."""
    recipes = gm.meta.get(FOLDED_RECIPES, {})
    graph, inputs, attrs = torch.fx.Graph(), {}, {}
    if source.op == "placeholder":
        value = graph.placeholder(source.name)
    elif source.op == "get_attr" and source.target in recipes:
        inner = recipes[source.target]
        for p in inner.graph.find_nodes(op="placeholder"):
            inputs[p.target] = graph.placeholder(p.target)
        value = _copied(graph, inner, inputs, attrs)
    else:
        return None
    graph.output(graph.call_function(op, (value, *args)))
    return torch.fx.GraphModule(attrs, graph)


def _copied(graph: torch.fx.Graph, recipe: torch.fx.GraphModule, inputs: dict, attrs: dict) -> torch.fx.Node:
    """`recipe`'s nodes copied into `graph`, its placeholders bound to `inputs`; its output."""
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for r in recipe.graph.nodes:
        if r.op == "placeholder":
            env[r] = inputs[r.target]
        elif r.op == "output":
            return env[r.args[0]]
        else:
            env[r] = graph.node_copy(r, env.__getitem__)
            if r.op == "get_attr":
                attrs[r.target] = attribute(recipe, r.target)
    raise ValueError("a recipe without an output")


def _ancestors(nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """`nodes` and every node they are computed from."""
    todo, found = list(nodes), set()
    while todo:
        node = todo.pop()
        if node not in found:
            found.add(node)
            todo.extend(node.all_input_nodes)
    return found

