"""Every private torch API graphopt uses, in one package, one module per part of torch.

torch's compiler internals change between releases (graphopt runs on 2.11 to 2.15).
Each wrapper here detects what the installed torch offers, with `inspect` where a
signature moved, so an upgrade breaks this package and no other: no module outside it
names private torch (`tests/test_layers.py` checks). Callers import the module they
need (`from graphopt._compat import shapes`); this file re-exports nothing.

- `shapes.py`: symbolic sizes compared and read without a guard;
- `fake.py`: the FakeTensorMode a compile runs in, entered and left;
- `ops.py`: an ATen call's written arguments, in-place overloads, the dispatch mode;
- `dynamo.py`: the backend registry, dynamic dims, what Dynamo recorded of each input;
- `aot_autograd.py`: the functional inference graph, boxed calls;
- `inductor.py`: a compile with graphopt's post-grad pass, options, availability;
- `distributed.py`: process groups as a compiled graph names them;
- `names.py`: the private names used as they are;
- `patterns.py`: Inductor's pattern matcher; `autotune.py`: what its autotuning chose;
- `mkldnn.py`: oneDNN's fused convolutions and packed weights;
- `recompile.py`: Dynamo's recompile limit, when it gives up, what failed;
- `cache.py`: what the compile cache needs; `traces.py`: Dynamo's stored traces;
  `guard_sources.py`: a guard's source read by its syntax; `trace_graph.py`: the
  compiled graph a stored trace calls;
- `background.py`: Inductor's code generation in a child process.
"""
