"""The device-graph runtime: what the backend wraps each compiled graph in (GraphRunner)
and the device graphs it replays (host and CUDA); `analysis/` holds what it learns of a
graph before replay (fake run, rows, signature, capture safety, piecewise split)."""
