"""Fusion passes: several ops replaced by one that does the same work in one call."""
