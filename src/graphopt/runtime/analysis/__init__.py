"""What the runtime learns of a graph before it replays it: the fake run (splitting ops,
written inputs, rows that mix), the signature, capture safety and the piecewise split."""
