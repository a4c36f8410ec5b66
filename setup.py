"""Packaging for fsdp_wrap (metadata here; build backend and tool settings in pyproject.toml)."""

import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _long_description() -> tuple[str, str]:
    for name, content_type in (("README.rst", "text/x-rst"), ("README.md", "text/markdown")):
        path = os.path.join(HERE, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return f.read(), content_type
    return "", "text/plain"


LONG_DESCRIPTION, LONG_DESCRIPTION_TYPE = _long_description()


setup(
    name="fsdp_wrap",
    version="0.1.0",
    description=(
        "A Python re-implementation of PyTorch's FSDP1 on torch.distributed "
        "(drop-in for torch.distributed.fsdp)"
    ),
    long_description=LONG_DESCRIPTION,
    long_description_content_type=LONG_DESCRIPTION_TYPE,
    python_requires=">=3.9",
    packages=find_packages(
        exclude=[
            "tests",
            "tests.*",
            "benchmarks",
            "benchmarks.*",
            "tutorials",
            "tutorials.*",
            "docs",
            "docs.*",
        ]
    ),
    # A bare lower bound: an already-installed torch (e.g. a CPU build) satisfies
    # it and pip will not replace it.  Install the torch you want first.
    install_requires=["torch>=2.4", "numpy", "packaging"],
    extras_require={
        # transformers: `fsdp-wrap plan --hf-config` builds Hugging Face models
        # from their configs on the meta device; the tests plan and train GPT-2.
        # safetensors: fsdp_wrap writes and reads the format itself (streaming, no
        # dependency); the package is the reference the tests check the files with,
        # and what Hugging Face users load them with.
        "hf": ["transformers", "safetensors"],
        "test": ["pytest", "transformers", "safetensors"],
        "dev": ["pytest", "ruff", "mypy", "transformers", "safetensors"],
    },
    entry_points={
        "console_scripts": [
            "fsdp-wrap-demo = fsdp_wrap.demo:main",
            "fsdp-wrap = fsdp_wrap.cli:main",
        ]
    },
)
