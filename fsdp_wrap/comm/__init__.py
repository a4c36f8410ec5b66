"""Communication: collectives, gradient buckets, batched gathers, reduction.

Imports nothing: the modules are imported by their full paths."""
