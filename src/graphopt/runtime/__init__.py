"""The device-graph runtime: what the backend wraps each compiled graph in (GraphRunner),
the device graphs it replays (host and CUDA), piecewise splitting and capture safety."""
