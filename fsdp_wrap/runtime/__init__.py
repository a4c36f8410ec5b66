"""Unit state, construction, forward/backward hooks, execution order, summon.

Imports nothing: the modules are imported by their full paths."""
