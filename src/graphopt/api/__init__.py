"""The api layer: `optimize()` and what it returns (optimize.py), the step behind it
(step.py), stored traces (traces.py) and the guards filter (guards.py). It reaches the
passes and the runtime only through the backend layer (docs/design.md, "Layers")."""
