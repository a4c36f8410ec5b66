"""Scripts that run real frameworks on fsdp_wrap, launched by tests/test_frameworks.py."""
