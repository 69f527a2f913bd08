"""What Inductor's code assumed about a graph's sizes, checked before each call where Dynamo cannot.

    Dynamo's guards (made at the trace) -> level 2 compiled later, in a child process
        -> Inductor assumes Ne(Mod(s75, 32), 0), s75 <= 4096 (guards it added to the shape env)
        -> those assumptions checked on each call's sizes: Inductor's code where they hold,
           AOTAutograd's graph (the same math, run as FX code) where they do not

Compiled in the process, such guards join Dynamo's and a call whose sizes break them traces
again. A compile that ends after Dynamo's guards were made (level 2 started at a later call,
its code generated in a child) has no such door, so the check goes into the compiled code:
one expression over the call's sizes, made by the shape environment as Inductor's own
graph cache makes it (`produce_guards_expression`), compiled once.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence


class UnguardedAssumption(RuntimeError):
    """The child's compile added a guard on the graph's sizes that cannot be checked at a call."""


def checked(output: Any, elsewhere: Callable[[list], Any], example_inputs: Sequence[Any], shape_env: Any,
            added: Sequence[Any], outside: Callable[[str], None]) -> None:
    """Make `output` (Inductor's compiled graph) run its code only on calls whose sizes
    satisfy `added` (the guards its compile added), and `elsewhere` (a boxed call) on the
    others, each of which is told to `outside` with the reason. Raises UnguardedAssumption
    where the guards cannot be written over the inputs."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    described = ", ".join(str(g.expr) for g in added[:3])
    try:
        code = shape_env.produce_guards_expression(list(example_inputs), guards=list(added))
    except Exception as error:  # noqa: BLE001 - any failure to express them means they cannot be checked
        raise UnguardedAssumption(f"Inductor's code assumes {described}, which cannot be checked at a call "
                                  f"({type(error).__name__}: {error})") from error
    if code is None:
        return
    holds = eval(f"lambda L: {code}", dict(SYMPY_INTERP))  # noqa: S307 - the shape environment's own expression
    names = [f"t{i}" for i in range(len(example_inputs))]
    compiled = output.current_callable
    why = f"level 2's code assumes {described} about the graph's sizes: a call outside that runs its graph as FX code"

    def run(args: list) -> Any:
        if holds(dict(zip(names, args))):
            return compiled(args)
        outside(why)
        return elsewhere(args)

    output.current_callable = run
