"""Model and optimizer state dicts: names, chunks, buffers, sharded I/O.

Imports nothing: the modules are imported by their full paths."""
