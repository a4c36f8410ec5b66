"""The flat-parameter handle: flat tensor, layout, views, gradients, write-back.

Imports nothing: the modules are imported by their full paths."""
