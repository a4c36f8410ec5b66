"""Function policies through ``_recursive_wrap``, checked against torch's FSDP1.

Everything runs in one process (:mod:`tests._wrap_common`): for every policy
and model the set of wrapped FQNs, each unit's kwargs, the returned numel and
the log of policy calls ``(module type, recurse, nonwrapped_numel)`` are
compared with torch's; key cases also assert hard-coded expectations (from the
reference doc, section 4) so that a shared mistake in the oracle comparison
cannot hide.
"""

from __future__ import annotations

import pytest
import torch.distributed.fsdp.wrap as torch_wrap

import fsdp_wrap.wrap as our_wrap
from tests._wrap_common import (
    CPU,
    IGNORES,
    MODELS,
    POLICY_NAMES,
    FakeWrap,
    ignored_of,
    logged,
    run_recursive,
    section4_model,
)


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("with_ignored", [False, True])
@pytest.mark.parametrize("only_children", [True, False])
def test_recursive_wrap_matches_torch(
    policy_name: str, model_name: str, with_ignored: bool, only_children: bool
) -> None:
    ignore = IGNORES[model_name] if with_ignored else None
    ours = run_recursive(our_wrap, policy_name, model_name, ignore, only_children)
    theirs = run_recursive(torch_wrap, policy_name, model_name, ignore, only_children)
    assert ours == theirs
    assert ours[2], "the policy must have been asked at least once"


def test_section4_call_log_matches_reference() -> None:
    # Exact log from reference section 4 (size_based, min_num_params=100, root not wrapped).
    _, numel, log = run_recursive(our_wrap, "size_100", "section4", None, True)
    assert log == [
        ("Sequential", True, 386),
        ("Embedding", True, 80),
        ("Block", True, 144),
        ("Linear", True, 72),
        ("Linear", True, 72),
        ("Block", False, 144),
        ("Block", True, 144),
        ("Linear", True, 72),
        ("Linear", True, 72),
        ("Block", False, 144),
        ("Linear", True, 18),
    ]
    assert numel == 288


@pytest.mark.parametrize(
    ("policy_name", "expected"),
    [
        ("size_100", {"1": "Block", "2": "Block"}),
        ("size_default", {}),
        ("lambda_emb", {"0": "Embedding"}),
        ("transformer", {"1": "Block", "2": "Block"}),
        ("or", {"0": "Embedding", "1": "Block", "2": "Block"}),
        (
            "always",
            {
                "0": "Embedding",
                "1": "Block",
                "1.fc1": "Linear",
                "1.fc2": "Linear",
                "2": "Block",
                "2.fc1": "Linear",
                "2.fc2": "Linear",
                "3": "Linear",
            },
        ),
        ("module_wrap_policy_obj", {"1": "Block", "2": "Block"}),
    ],
)
def test_section4_structures_match_reference(
    policy_name: str, expected: dict[str, str]
) -> None:
    struct, _, _ = run_recursive(our_wrap, policy_name, "section4", None, True)
    assert {fqn: name for fqn, (name, _) in struct.items()} == expected
    for _, kwargs in struct.values():
        assert kwargs == {"tag": "x", "device_id": CPU}


def test_recursive_wrap_numel_and_root_wrapping() -> None:
    model = section4_model()
    wrapped, numel = our_wrap._recursive_wrap(
        model,
        our_wrap.always_wrap_policy,
        FakeWrap,
        set(),
        set(),
        only_wrap_children=False,
    )
    assert isinstance(wrapped, FakeWrap) and wrapped._fsdp_wrapped_module is model
    assert numel == 386
    model = section4_model()
    _, numel = our_wrap._recursive_wrap(
        model, our_wrap.always_wrap_policy, FakeWrap, set(), set(), True
    )
    assert numel == 80 + 144 + 144 + 18


def test_recursive_wrap_ignored_not_entered() -> None:
    model = section4_model()
    ignored_modules, ignored_params = ignored_of(model, "1")
    log: list[tuple[str, bool, int]] = []
    our_wrap._recursive_wrap(
        model,
        logged(our_wrap.always_wrap_policy, log),
        FakeWrap,
        ignored_modules,
        ignored_params,
        True,
    )
    assert log[0] == ("Sequential", True, 386 - 144)
    assert not isinstance(model[1], FakeWrap) and not isinstance(model[1].fc1, FakeWrap)
    assert isinstance(model[2], FakeWrap) and isinstance(
        model[2]._fsdp_wrapped_module.fc1, FakeWrap
    )


def test_recursive_wrap_rejects_already_wrapped_child() -> None:
    model = section4_model()
    model[1] = FakeWrap(model[1])
    with pytest.raises(ValueError, match="is already wrapped by"):
        our_wrap._recursive_wrap(
            model, our_wrap.always_wrap_policy, FakeWrap, set(), set(), True
        )
    # A function (not a class) as wrapper cannot be isinstance-checked: no error.
    our_wrap._recursive_wrap(
        model,
        our_wrap.always_wrap_policy,
        lambda m, **k: FakeWrap(m, **k),
        set(),
        set(),
        True,
    )


def test_tied_model_shared_module_wrapped_once() -> None:
    struct, _, _ = run_recursive(our_wrap, "transformer", "tied", None, True)
    # named_children yields a module once, so the second reference ("3") stays unwrapped.
    assert set(struct) == {"1", "2"}
