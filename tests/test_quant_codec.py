"""The codec of quantized collectives, and the ``quantize_collectives`` setting (one process).

* The error bound (fsdp_wrap/comm/quant/codec.py, "the error bound"): every
  decoded value within ``scale / 2 + 4 u absmax`` of its block, for several
  distributions, widths, block sizes, segmentations and input dtypes.
* Blocks restart at each segment: a unit's codes do not depend on the units
  travelling with it (buckets and batched gathers rely on that).
* Zeros stay zeros; an inf or NaN turns its block (only) into NaNs.
* Packets have the size :func:`packet_nbytes` says, row by row.
* The setting: strings, the environment variable, the dataclass, and the
  errors for what it refuses.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_wrap.comm.quant.codec import (
    Codec,
    decode_row,
    encode_rows,
    error_bound,
    packet_nbytes,
    roundtrip,
)
from fsdp_wrap.comm.quant.config import (
    QUANTIZE_ENV,
    CollectiveQuantization,
    resolve_quantization,
)

SEGMENTATIONS = [None, (5, 300, 17), (64, 128), (1,), (3, 1, 250)]


def _data(kind: str, n: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, generator=gen)
    if kind == "heavy":  # gradients: a few large values among many small ones
        x = x * torch.rand(n, generator=gen).pow(8) * 1e3
    elif kind == "tiny":
        x = x * 1e-30
    elif kind == "const":
        x = torch.full((n,), -0.3)
    return x


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [1, 7, 64, 2048])
def test_error_bound(bits: int, block: int) -> None:
    gen = torch.Generator().manual_seed(bits * 1000 + block)
    codec = Codec(bits, block)
    for segs in SEGMENTATIONS:
        n = 322 if segs is None else sum(segs)
        for kind in ("normal", "heavy", "tiny", "const"):
            for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
                x = _data(kind, n, gen).to(dtype)
                y = roundtrip(x, codec, segs)
                err = (x.double() - y.double()).abs()
                bound = error_bound(x, codec, segs).double()
                # (x as float32: an fp64 input is rounded to float32 first)
                bound += x.double().abs() * 2.0**-24 if dtype == torch.float64 else 0
                assert bool((err <= bound).all()), (kind, dtype, segs, float((err - bound).max()))
                assert y.dtype == torch.float32


def test_bound_is_half_a_step() -> None:
    """Values halfway between codes are where the bound is reached (no slack
    hides a wrong scale: a scale twice too large would break it)."""
    codec = Codec(8, 4)
    x = torch.tensor([127.0, 0.5, -1.5, 2.5])  # scale 1: halves round to even
    y = roundtrip(x, codec)
    assert y.tolist() == [127.0, 0.0, -2.0, 2.0]
    assert torch.equal((x - y).abs().max(), torch.tensor(0.5))


def test_segments_are_independent() -> None:
    gen = torch.Generator().manual_seed(1)
    a, b, c = (torch.randn(n, generator=gen) * s for n, s in ((37, 1.0), (5, 100.0), (70, 0.01)))
    for bits in (8, 4):
        codec = Codec(bits, 16)
        joint = roundtrip(torch.cat([a, b, c]), codec, (37, 5, 70))
        alone = torch.cat([roundtrip(t, codec) for t in (a, b, c)])
        assert torch.equal(joint, alone)


def test_zeros_and_non_finite_blocks() -> None:
    codec = Codec(8, 3)
    x = torch.tensor([0.0, 0.0, 0.0, 1.0, float("inf"), 2.0, 3.0, float("nan"), 4.0, 5.0])
    y = roundtrip(x, codec)
    assert torch.equal(y[:3], torch.zeros(3))
    assert bool(y[3:9].isnan().all())  # the two blocks holding inf and NaN
    assert y[9].item() == 5.0
    assert torch.equal(roundtrip(torch.zeros(9), Codec(4, 4)), torch.zeros(9))


@pytest.mark.parametrize("bits", [8, 4])
def test_packets(bits: int) -> None:
    gen = torch.Generator().manual_seed(2)
    codec = Codec(bits, 16)
    for segs in [(5, 300, 17), (33,), (32, 32)]:
        n = sum(segs)
        rows = torch.randn(3, n, generator=gen)
        packets = encode_rows(rows, codec, segs)
        assert packets.dtype == torch.uint8
        assert packets.shape == (3, packet_nbytes(segs, codec))
        for r in range(3):
            out = torch.empty(n, dtype=torch.bfloat16)
            decode_row(packets[r], codec, segs, out)
            assert torch.equal(out, roundtrip(rows[r], codec, segs).to(torch.bfloat16))
    # int8 at 2048: a byte per value plus 4 per block
    assert packet_nbytes((4096,), Codec(8, 2048)) == 4096 + 8
    assert packet_nbytes((4096,), Codec(4, 2048)) == 2048 + 8


def test_setting_strings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(QUANTIZE_ENV, raising=False)
    assert resolve_quantization(None) is None
    assert resolve_quantization("off") is None
    spec = resolve_quantization("grads")
    assert spec is not None and spec.weights is None and spec.grads == Codec(8, 2048)
    assert spec.where == "cross_node"
    spec = resolve_quantization(" Weights , grads=int4, block=512, where=all ")
    assert spec is not None
    assert (spec.weights, spec.grads, spec.where) == (Codec(8, 512), Codec(4, 512), "all")
    spec = resolve_quantization("both")
    assert spec is not None and spec.weights == spec.grads == Codec(8, 2048)
    spec = resolve_quantization(CollectiveQuantization(weights=None, grads="int4", block_size=64))
    assert spec is not None and (spec.weights, spec.grads) == (None, Codec(4, 64))
    assert resolve_quantization(CollectiveQuantization(weights=None, grads=None)) is None
    # the environment variable, and the keyword winning over it
    monkeypatch.setenv(QUANTIZE_ENV, "weights,where=all")
    spec = resolve_quantization(None)
    assert spec is not None and spec.weights == Codec(8, 2048) and spec.grads is None
    assert resolve_quantization("off") is None


@pytest.mark.parametrize("value, words", [
    ("grads=int2", ["quantize_collectives", "expected 'int8', 'int4' or None", "grads='int2'"]),
    ("weights=int4", ["int4 is offered for gradients only", "weights='int8'"]),
    ("grads,block=0", ["block_size=0", ">= 1"]),
    ("grads,block=big", ["block='big'", "whole number"]),
    ("grads,where=node", ["where='node'", "['cross_node', 'all']"]),
    ("block=64", ["'weights', 'grads' or both"]),
    ("gradients", ["items such as", "'gradients'"]),
    (CollectiveQuantization(block_size=2.5), ["block_size=2.5"]),  # type: ignore[arg-type]
])
def test_setting_errors(value: object, words: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(QUANTIZE_ENV, raising=False)
    with pytest.raises(ValueError) as err:
        resolve_quantization(value, "[rank 3] ")
    msg = str(err.value)
    assert msg.startswith("[rank 3] "), msg
    for w in words:
        assert w in msg, (w, msg)


def test_setting_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(QUANTIZE_ENV, "grads=fp8")
    with pytest.raises(ValueError, match=f"{QUANTIZE_ENV}: expected"):
        resolve_quantization(None)
    with pytest.raises(TypeError, match="CollectiveQuantization, a string"):
        resolve_quantization(8)


def test_settings_are_immutable_values() -> None:
    """A setting is a value shared by every unit of a tree (the children get the
    root's): it can be neither changed under one of them nor differ by identity
    (hashable, equal by value).  (Found by mutation testing: ``frozen=False``
    survived every test.)"""
    import dataclasses

    from fsdp_wrap.comm.quant.config import QuantSpec

    q = CollectiveQuantization(grads="int4")
    assert hash(q) == hash(CollectiveQuantization(grads="int4"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.where = "all"  # type: ignore[misc]
    spec = resolve_quantization(q)
    assert isinstance(spec, QuantSpec) and hash(spec) == hash(resolve_quantization(q))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.where = "all"  # type: ignore[misc]
    assert hash(Codec(8, 64)) == hash(Codec(8, 64))
