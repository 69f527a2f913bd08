"""The device-graph runtime: host and CUDA graphs, capture safety, and the GraphRunner."""
