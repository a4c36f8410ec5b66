"""Every torch sentence fsdp_wrap's messages carry is the installed torch's.

fsdp_wrap starts a message with torch's own sentence where torch has one
(docs/testing.rst, docs/getting_started.rst).  :data:`SENTENCES` lists, per package file, each piece of
torch's text the package carries (found by comparing the package's string
literals with torch 2.13's source; ``{NAME}`` stands for a wording that
``fsdp_wrap._compat`` chooses by torch version).  For the installed torch, each
must still be in the package file and in torch's source, so a torch release
that rewords one fails here by name, in every lane CI runs (docs/testing.rst):
choose the wording by version in ``_compat.py`` then, and list it in
docs/getting_started.rst.  The tests that raise each error on torch and on
fsdp_wrap and compare the messages are elsewhere (tests/test_errors.py,
tests/test_wrap.py, ...).
"""

from __future__ import annotations

import ast
import functools
import os
import re

import pytest
import torch

import fsdp_wrap
import fsdp_wrap._compat as compat

PKG = os.path.dirname(os.path.abspath(fsdp_wrap.__file__))
TORCH = os.path.dirname(os.path.abspath(torch.__file__))

#: Where torch's FSDP1 sentences live (its FSDP1 package, c10d, nn.Module).
TORCH_FILES = (
    *(os.path.join("distributed", "fsdp", f)
      for f in sorted(os.listdir(os.path.join(TORCH, "distributed", "fsdp")))
      if f.endswith(".py")),
    os.path.join("distributed", "distributed_c10d.py"),
    # FSDP2's controls, which fsdp_wrap's units offer too (fsdp_wrap/runtime/explicit/)
    os.path.join("distributed", "fsdp", "_fully_shard", "_fully_shard.py"),
    os.path.join("nn", "modules", "module.py"),
)

#: Wordings chosen by torch version in fsdp_wrap/_compat.py.
CHOSEN = {"FSDP_INSTANCES_WORD": compat.FSDP_INSTANCES_WORD}

#: torch releases that word a sentence differently; fsdp_wrap gives the newer
#: wording on every torch.  (torch before 2.13 raises this error with three
#: strings as its arguments, so its message is their tuple.)
OLDER_TORCH_WORDS_IT_APART = {
    "Found state_dict_type LOCAL_STATE_DICT. DeviceMesh is not compatible with "
    "LOCAL_STATE_DICT. Please set state_dict_type to SHARDED_STATE_DICT to get DTensor "
    "state_dict.": (2, 13),
}

SENTENCES: dict[str, list[str]] = {
    "demo/launch.py": [
        'The `NO_SHARD` sharding strategy is deprecated',
    ],
    "fully_sharded_data_parallel/facade.py": [
        'A communication hook is already registered',
        'Communication hook is not supported for hybrid strategies:',
        'The communication hook must be callable but got',
        '`no_sync()` on inner FSDP instances is not supported. Please call `no_sync()` on root FSDP module.',
        'register_comm_hook can only be called on a root instance.',
    ],
    "handle/flat_param.py": [
        'FSDP_USE_FULL_PREC_IN_EVAL',
    ],
    "handle/grads.py": [
        'FSDP does not support gradients of gradients',
    ],
    "handle/layout.py": [
        'Cannot flatten integer dtype tensors',
        "FSDP doesn't support scalar parameters. Change",
        'FSDP only supports single device modules but got params on',
        'Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`',
        'Must flatten tensors with uniform dtype but got',
        'to a 1D tensor with numel equal to 1.',
    ],
    "handle/writeback.py": [
        'Cannot writeback when the',
        'Changing shared parameters is not supported yet',
        'FSDP does not support changing the parameters between forward and backward for',
    ],
    "runtime/construct.py": [
        'FSDP will not all-gather parameters for containers that do not implement forward:',
        'Cannot pass both ignored_modules and ignored_states at the same time. Please just pass ignored_states.',
        'Trying to ignore the top-level module passed into the FSDP constructor itself will result in all parameters being ignored and is not well-supported',
        '`ignored_modules` should be an iterable of `torch.nn.Module`s',
        '`ignored_modules` should not include FSDP modules',
        'ignored_modules expects nn.Module list elements but got types',
        'ignored_states expects all nn.Parameter or all nn.Module list elements but got types',
        'to be callable but got',
    ],
    "runtime/exec_order.py": [
        '. Collectives are unchecked and may give incorrect results or hang.',
        'Expected to all-gather for',
        'Expected to not all-gather any more parameters in the forward but trying',
        'Forward order differs across ranks:',
        'Forward order differs from that of the first iteration on rank',
        'a newly-added parameter since construction time',
        'is all-gathering parameters for',
        'to all-gather parameters for',
    ],
    "runtime/explicit/api.py": [
        'Expects FSDPModule but got',
        'does not have a method',
        'reshard_after_forward should be a bool, got',
    ],
    "runtime/grad_norm.py": [
        '`clip_grad_norm_()` should only be called on the root FSDP instance',
    ],
    "runtime/grad_norm_two_d.py": [  # (scale_to_norm, which both norms end in)
        'Called FSDP.clip_grad_norm_() on rank',
        'with no gradients -- returning the total norm in the default dtype',
    ],
    "runtime/hooks.py": [
        'FSDP_USE_FULL_PREC_IN_EVAL',
    ],
    "runtime/settings.py": [
        'Cannot pass both process_group and device_mesh at the same time. Please just pass only one of them.',
        'Default process group has not been initialized, please make sure to call init_process_group.',
        'Expected device_mesh to have ndim=2 but got',
        'Expected process_group to be passed in as either None or Tuple[dist.ProcessGroup, dist.ProcessGroup] but got',
        'FSDP is switching to use `NO_SHARD` instead of',
        'FSDP only supports single device modules but got params on',
        'Manual wrapping with',
        'The `NO_SHARD` sharding strategy is deprecated. If having issues, please use `DistributedDataParallel` instead.',
        'To support a module with both CPU and GPU params, please pass in device_id argument.',
        'requires explicit specification of process group or device_mesh.',
        'since the world size is 1.',
    ],
    "runtime/state.py": [
        'but current state is',
        'expected to be in states',
    ],
    "runtime/summon.py": [
        'Cannot manually unshard parameters during forward/backward',
        'Cannot manually unshard parameters when already unsharding parameters',
        'is not supported yet',
        'offload_to_cpu=True and NO_SHARD is not supported yet',
        'writeback=True and rank0_only=True is not supported yet',
    ],
    "runtime/tree.py": [
        'Expects one homogeneous value for',
        'FSDP optimizer in backward only supported with use_orig_params=True!',
    ],
    "sharded_grad_scaler.py": [
        'Attempting to unscale FP16 gradients.',
        'No inf checks were recorded prior to update.',
        'new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor with requires_grad=False.',
        'outputs must be a Tensor or an iterable of Tensors',
        'unscale_() has already been called on this optimizer since the last update().',
        'unscale_() is being called after step().',
    ],
    "state_dict/model.py": [
        ': copying a param with shape',
        'Expected optim_state_dict_config of type',
        'Expected state_dict_config of type',
        'Found state_dict_type LOCAL_STATE_DICT. DeviceMesh is not compatible with LOCAL_STATE_DICT. Please set state_dict_type to SHARDED_STATE_DICT to get DTensor state_dict.',
        'When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will be returned.',
        'from checkpoint, the shape in current model is',
    ],
    "state_dict/optim.py": [
        'Expected optim_state_key_type to be PARAM_NAME or PARAM_ID, got',
        "FSDP currently requires each rank to have at least the optimizer states needed by rank 0's optimizer but some ranks are missing some of those states",
        'Invalid parameter keys:',
    ],
    "state_dict/optim_load.py": [
        'All unflattened parameters comprising a single flat parameter must have positive-dimension tensor state with the same dtype but got dtypes',
        'All unflattened parameters comprising a single flat parameter must have scalar state with the same value and dtype but got',
        'Differing optimizer state names for the unflattened parameters:',
        'Differing optimizer state types for state',
        'and unflattened parameter names',
    ],
    "state_dict/sharded_io.py": [
        ': copying a param with shape',
        'from checkpoint, the shape in current model is',
    ],
    "checkpoint/weights/load.py": [
        ': copying a param with shape',
        'Error(s) in loading state_dict for',
        'Missing key(s) in state_dict:',
        'Unexpected key(s) in state_dict:',
        'from checkpoint, the shape in current model is',
    ],
    "wrap/auto_wrap.py": [
        'FSDP auto wrapping requires modules to not already have FSDP applied but found',
        'FSDP does not support wrapping such modules when use_orig_params=False.',
        'If possible, wrap the frozen parameters with FSDP separately.',
        'The following parameters have requires_grad=False:',
        'The following parameters have requires_grad=True:',
        'We do not recommend wrapping such modules since the gradient memory usage will be higher than expected (',
        'has both parameters with requires_grad=True and False.',
        'numel before sharding via reduce-scatter).',
    ],
    "wrap/context.py": [
        'You are already within an autowrap context and we currently do not supported nested autowrap.',
    ],
    "wrap/mp_overrides.py": [
        'Both mixed precision and an auto_wrap_policy were specified to FSDP, where the wrapped module has submodules of type:',
        'These modules will be wrapped as separate FSDP {FSDP_INSTANCES_WORD} with mixed precision disabled.',
    ],
    "wrap/policies.py": [
        'The lambda_fn passed to CustomPolicy should return False/True or a kwarg dict, but it returned',
    ],
}


def _norm(text: str) -> str:
    return " ".join(text.split())


@functools.cache
def _pieces(path: str) -> tuple[str, ...]:
    """The string literals of a Python file, f-strings' literal parts each on its own."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append(_norm(node.value))
    return tuple(out)


@functools.cache
def _torch_pieces() -> tuple[str, ...]:
    return tuple(p for f in TORCH_FILES for p in _pieces(os.path.join(TORCH, f)))


def _cases() -> list[tuple[str, str]]:
    return [(f, s) for f, sentences in SENTENCES.items() for s in sentences]


@pytest.mark.parametrize("path,sentence", _cases())
def test_the_package_still_carries_it(path: str, sentence: str) -> None:
    pieces = _pieces(os.path.join(PKG, path))
    for part in re.split(r"\{[A-Z_]+\}", sentence):
        part = _norm(part)
        assert not part or any(part in p for p in pieces), (
            f"fsdp_wrap/{path} no longer says {part!r}: update SENTENCES"
        )


@pytest.mark.parametrize("path,sentence", _cases())
def test_the_installed_torch_says_it(path: str, sentence: str) -> None:
    text = _norm(sentence.format(**CHOSEN))
    older = OLDER_TORCH_WORDS_IT_APART.get(sentence)
    if older and not compat.torch_at_least(*older):
        # torch's words are all there, apart (fsdp_wrap joins them as newer torch does)
        words = set(re.findall(r"\w+", text))
        assert words <= set(re.findall(r"\w+", " ".join(_torch_pieces()))), text
        return
    assert any(text in p for p in _torch_pieces()), (
        f"torch {torch.__version__} no longer says {text!r} (fsdp_wrap/{path} does): choose "
        "the installed torch's wording in fsdp_wrap/_compat.py and list it in "
        "docs/getting_started.rst"
    )


def test_every_chosen_wording_is_used() -> None:
    used = {name for ss in SENTENCES.values() for s in ss for name in re.findall(r"\{([A-Z_]+)\}", s)}
    assert used == set(CHOSEN)


def test_the_torch_matrix_lists_test_files() -> None:
    """CI's torch lanes run ``pytest @tests/torch_matrix.txt`` (.ci/run, tox.ini):
    one argument per line, no comments (pytest reads every line as an
    argument): test files or single tests of them (``file::test``), each file
    existing, this one among them, and ``--deselect=`` lines naming tests of
    listed files (the parity sweeps at 3 and 4 ranks and their non-vacuity
    checks: docs/testing.rst says why), never the non-vacuity check of a sweep
    the lanes run."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    with open(os.path.join(here, "torch_matrix.txt")) as f:
        lines = f.read().splitlines()
    assert lines and all(lines), "blank lines in tests/torch_matrix.txt"
    files = [p.split("::")[0] for p in lines if not p.startswith("--deselect=")]
    for p in lines:
        if p.startswith("--deselect="):
            assert p.split("=", 1)[1].split("::")[0] in files, f"{p} deselects from an unlisted file"
    missing = [p for p in files if not os.path.isfile(os.path.join(root, p))]
    assert not missing, f"tests/torch_matrix.txt names files that do not exist: {missing}"
    assert "tests/test_torch_sentences.py" in lines
    assert len(set(lines)) == len(lines), "a file listed twice runs twice"
    # every parity sweep a lane runs keeps its non-vacuity check (the check that
    # the sweep compared states, clipped, saw gradients: a sweep that compares
    # nothing passes too)
    from tests.test_parity import GROUPS

    deselected = {p.split("=", 1)[1] for p in lines if p.startswith("--deselect=")}
    check = "tests/test_parity.py::test_sweep_is_not_vacuous"
    assert check not in deselected, "the lanes deselect every parity sweep's non-vacuity check"
    for ws in ("2", "3", "4"):
        if any(f"tests/test_parity.py::test_parity[{g}-{ws}]" not in deselected for g in GROUPS):
            assert f"{check}[{ws}]" not in deselected, f"the {ws}-rank sweep runs unchecked"
