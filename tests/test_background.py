"""Level 2's code generated in a child process (_compat/background.py): what comes back
is unpickled off the calling thread, and a failure anywhere is the compile's failure.
The compiles themselves are tested end to end in test_tiers.py."""

import gc
import threading
import weakref
from concurrent.futures import Future

from graphopt._compat import background


def test_the_childs_code_is_unpickled_off_the_calling_thread_as_it_arrives():
    """What the child sends back is unpickled in a thread of its own, so that the call
    that first runs level 2 does not pay for it (1.9 GB of packed weights on a 0.85B
    Llama); a failure there, or the child's own, is the compile's failure, which
    BackgroundCompile reports."""
    sent, unpickled_in = Future(), []

    def unpickle(result):
        unpickled_in.append(threading.current_thread().name)
        return result * 2

    arrived = background._unpickled(sent, unpickle)
    sent.set_result(21)
    assert arrived.result(timeout=10) == 42 and unpickled_in == ["graphopt-background-unpickle"]

    failed = Future()
    failing = background._unpickled(failed, unpickle)
    failed.set_exception(RuntimeError("the child's compile failed"))
    assert str(failing.exception(timeout=10)) == "the child's compile failed"

    def garbled(result):
        raise EOFError("Ran out of input")

    broken = Future()
    unreadable = background._unpickled(broken, garbled)
    broken.set_result(b"not a pickle")
    assert isinstance(unreadable.exception(timeout=10), EOFError)


def test_a_model_dropped_while_its_child_compiles_is_freed_and_its_code_never_unpickled():
    """What the child's future holds leads to the graph's constants only through the
    future the model holds: dropped with the model, they are freed before the child
    ends, and what the child then sends back is not unpickled."""

    class Constants:
        pass

    constants, unpickled = Constants(), []
    alive = weakref.ref(constants)
    sent = Future()
    dropped = background._unpickled(sent, lambda result, held=constants: unpickled.append(held))
    del constants, dropped
    gc.collect()
    assert alive() is None
    sent.set_result(b"the child's code")
    for thread in threading.enumerate():
        if thread.name == "graphopt-background-unpickle":
            thread.join(timeout=10)
    assert unpickled == []


def test_a_size_the_childs_code_assumes_is_checked_at_each_call():
    """A guard Inductor adds in the child (s0 <= 10, s0 % 4 == 0) cannot join Dynamo's
    guards: a call whose sizes break it runs the graph as FX code, and says so; a call
    within it runs Inductor's code."""
    import types

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from graphopt._compat import size_assumptions

    shape_env = ShapeEnv()
    dynamic_rows = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    x = FakeTensorMode(shape_env=shape_env).from_tensor(torch.zeros(8, 4), symbolic_context=dynamic_rows)
    known = len(shape_env.guards)
    assert x.shape[0] <= 10 and x.shape[0] % 4 == 0  # as Inductor's lowering asks, adding two guards
    added = shape_env.guards[known:]
    assert len(added) == 2
    compiled, told = types.SimpleNamespace(current_callable=lambda args: "inductor"), []
    size_assumptions.checked(compiled, lambda args: "fx", [x], shape_env, added, told.append)
    ran = [compiled.current_callable([torch.zeros(rows, 4)]) for rows in (8, 12, 6, 4)]
    assert ran == ["inductor", "fx", "fx", "inductor"]
    assert len(told) == 2 and "<= 10" in told[0] and "runs its graph as FX code" in told[0]
