"""The backend layer: `Backend` (backend.py), the compile of one graph (compile_graph.py),
device graphs around what it compiled (device_graphs.py), the "graphopt" name
(registry.py), and what a Backend decides per graph (tiers, executors, frozen weights).
It may import the base, the passes and the runtime (docs/design.md, "Layers")."""
