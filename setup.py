"""Packaging for fsdp_wrap (metadata here; build backend and tool settings in pyproject.toml)."""

import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))

# One line Python runs at every start-up (site.py executes ``.pth`` lines that
# begin with ``import``): with FSDP_WRAP_INSTALL set, fsdp_wrap.install() runs
# before any user code, so scripts and frameworks need no change at all.
PTH_NAME = "fsdp_wrap-install.pth"
PTH_LINE = (
    "import os; os.environ.get('FSDP_WRAP_INSTALL', '').strip().lower() in "
    "('1', 'true', 'yes', 'on') and __import__('importlib').import_module('fsdp_wrap.frameworks.installer').install_from_env()\n"
)


class BuildPyWithStartupHook(build_py):
    """build_py that also puts the start-up hook at the top of the wheel (site-packages)."""

    def run(self) -> None:
        super().run()
        target = os.path.join(self.build_lib, PTH_NAME)
        with open(target, "w", encoding="utf-8") as f:
            f.write(PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH_NAME)]


def _long_description() -> tuple[str, str]:
    for name, content_type in (("README.rst", "text/x-rst"), ("README.md", "text/markdown")):
        path = os.path.join(HERE, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return f.read(), content_type
    return "", "text/plain"



def _cmdclass() -> dict[str, type]:
    """build_py for wheels; for ``pip install -e .`` the editable wheel gets the
    same hook (setuptools builds it without build_py's top-level files)."""
    classes: dict[str, type] = {"build_py": BuildPyWithStartupHook}
    try:
        from setuptools.command.editable_wheel import editable_wheel
    except ImportError:  # setuptools < 64: no PEP 660 editable installs
        return classes

    class EditableWithStartupHook(editable_wheel):  # type: ignore[misc, valid-type]
        def _select_strategy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            strategy = super()._select_strategy(*args, **kwargs)

            def write(wheel, files, mapping):  # type: ignore[no-untyped-def]
                strategy(wheel, files, mapping)
                wheel.writestr(PTH_NAME, PTH_LINE.encode())

            class _WithHook:
                def __call__(self, wheel, files, mapping):  # type: ignore[no-untyped-def]
                    write(wheel, files, mapping)

                def __enter__(self):  # type: ignore[no-untyped-def]
                    strategy.__enter__()
                    return self

                def __exit__(self, *exc):  # type: ignore[no-untyped-def]
                    return strategy.__exit__(*exc)

            return _WithHook()

    classes["editable_wheel"] = EditableWithStartupHook
    return classes


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
    author="the fsdp_wrap authors",
    # An SPDX expression (PEP 639); the text is in LICENSE, which setuptools
    # puts in the wheel.  No licence classifier: the expression replaces it.
    license="BSD-3-Clause",
    license_files=["LICENSE"],
    # No project URLs: there is no public home to point at yet.
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        # the versions CI and the GPU machine test (python_requires is wider)
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: Software Development :: Libraries :: Python Modules",
    ],
    keywords=["pytorch", "fsdp", "distributed", "data parallel", "sharding"],
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
    # it and pip will not replace it.  Install the torch you want first.  The
    # bound is the oldest torch CI tests (.ci/run's torch matrix: 2.11, 2.13 and
    # the newest release); fsdp_wrap does not import on 2.4 (DTensor's public
    # module is 2.5's), which the bound said until CI ran it.
    install_requires=["torch>=2.11", "numpy", "packaging"],
    extras_require={
        # transformers: `fsdp-wrap plan --hf-config` builds Hugging Face models
        # from their configs on the meta device; the tests plan and train GPT-2.
        # safetensors: fsdp_wrap writes and reads the format itself (streaming, no
        # dependency); the package is the reference the tests check the files with,
        # and what Hugging Face users load them with.
        "hf": ["transformers", "safetensors"],
        # The frameworks fsdp_wrap.install() is tested against (tests/test_frameworks.py):
        # Accelerate and the transformers Trainer, Lightning Fabric and Trainer.
        "frameworks": ["accelerate", "transformers", "lightning"],
        # matplotlib: `fsdp-wrap plan --plot` and the demo's loss plot (pictures only;
        # the library never needs it).  The tests check the pictures, hence "test".
        "plot": ["matplotlib"],
        # Fine-tuning (docs/fine_tuning.rst, tests/test_peft.py): PEFT's LoRA on a
        # Hugging Face model, and bitsandbytes >= 0.50, the first release that
        # quantizes NF4 and runs Linear4bit on CPU, for QLoRA.
        "finetune": ["peft", "bitsandbytes>=0.50", "transformers"],
        # TRL's SFT, DPO and GRPO trainers, run for real on 2 CPU ranks by
        # tests/test_trl.py (with PEFT LoRA and bitsandbytes QLoRA): what most
        # FSDP1 fine-tuning goes through.  The 1.x API the tests use; tested
        # with 1.16.  Not needed by the library.
        "trl": ["trl>=1.0", "peft", "bitsandbytes>=0.50", "transformers"],
        # verl's FSDP1 engine, run end to end on 2 CPU ranks by tests/test_verl.py
        # (slow).  verl 0.9.1 pins transformers<5.11, so it cannot share an
        # environment with "frameworks"/"trl" (.ci/run gives it one of its own);
        # its engine workers import uvicorn and fastapi, which it does not declare.
        "verl": ["verl==0.9.1", "uvicorn", "fastapi", "peft"],
        # peft: load_pretrained maps a LoRA model's names onto a base checkpoint
        # (tests/test_load_pretrained.py) and the LoRA tests (tests/test_peft.py)
        # run real peft models.
        "test": ["pytest", "transformers", "safetensors", "matplotlib", "peft"],
        "dev": ["pytest", "ruff", "mypy", "transformers", "safetensors"],
        # The documentation site (docs/conf.py): Sphinx with its own autodoc and
        # napoleon, and furo, a maintained theme from the package index.
        "docs": ["sphinx>=7", "furo"],
    },
    cmdclass=_cmdclass(),
    entry_points={
        "console_scripts": [
            "fsdp-wrap-demo = fsdp_wrap.cli:demo_entry",
            "fsdp-wrap = fsdp_wrap.cli:main",
        ]
    },
)
