"""Small models shared by the distributed tests (CPU, fast, odd sizes).

Every size is odd on purpose so that flat parameters need padding when they
are sharded over 2, 3 or 4 ranks.  Each model comes with a ``wrap`` helper
that builds the same FSDP structure with either torch's FSDP1 or fsdp_wrap
(``impl`` is ``"torch"`` or ``"ours"``), so a test can deep-copy one model
into both and compare them step by step.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn as nn

VOCAB = 11
DIM = 7
HIDDEN = 10


# ---------------------------------------------------------------------------
# implementations
# ---------------------------------------------------------------------------


def fsdp_api(impl: str) -> Any:
    """The FSDP package of ``impl`` (torch's ``torch.distributed.fsdp`` or ours)."""
    if impl == "torch":
        import torch.distributed.fsdp as api
    elif impl == "ours":
        import fsdp_wrap as api
    else:
        raise ValueError(f"impl must be 'torch' or 'ours', got {impl!r}")
    return api


def wrap_api(impl: str) -> Any:
    if impl == "torch":
        import torch.distributed.fsdp.wrap as w
    else:
        import fsdp_wrap.wrap as w
    return w


def fsdp_kwargs(impl: str, **kw: Any) -> dict[str, Any]:
    """Translate enum *names* into ``impl``'s enums; torch gets ``device_id=cpu``.

    ``sharding_strategy`` and ``backward_prefetch`` may be given as names
    (``"FULL_SHARD"``, ``"BACKWARD_PRE"``; ``None`` stays ``None``).
    """
    api = fsdp_api(impl)
    out = dict(kw)
    if isinstance(out.get("sharding_strategy"), str):
        out["sharding_strategy"] = api.ShardingStrategy[out["sharding_strategy"]]
    if isinstance(out.get("backward_prefetch"), str):
        out["backward_prefetch"] = api.BackwardPrefetch[out["backward_prefetch"]]
    if impl == "torch":
        out.setdefault("device_id", torch.device("cpu"))
    return out


def fsdp_cls(impl: str) -> Any:
    return fsdp_api(impl).FullyShardedDataParallel


# ---------------------------------------------------------------------------
# 1. a transformer-ish model: tied embedding/head, a buffer, wrapped blocks
# ---------------------------------------------------------------------------


class Mlp(nn.Module):
    def __init__(self, d: int = DIM, h: int = HIDDEN) -> None:
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class Block(nn.Module):
    """Attention-ish mixing + an MLP; wrapped as its own unit (the MLP nests inside)."""

    def __init__(self, d: int = DIM, h: int = HIDDEN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mix = nn.Linear(d, d, bias=False)
        self.mlp = Mlp(d, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        # causal-ish mixing over the sequence dim, cheap
        steps = torch.arange(1, h.shape[-2] + 1, dtype=h.dtype, device=h.device)
        h = self.mix(h.cumsum(dim=-2) / steps[:, None])
        x = x + h
        return x + self.mlp(x)


class TinyTransformer(nn.Module):
    """Embedding tied to the output head (both in the root unit), a buffer, 2 blocks.

    Wrapped with :func:`transformer_policy`: root (emb/head/norm), blocks.0, blocks.1.
    """

    def __init__(self, d: int = DIM, h: int = HIDDEN, n_blocks: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList([Block(d, h) for _ in range(n_blocks)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: must stay in one unit (the root)
        self.register_buffer("scale", torch.tensor([1.25, 0.75, 1.5, 1.0, 0.5, 2.0, 1.0])[:d])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h) * self.scale)


def transformer_policy(impl: str, nested_mlp: bool = False) -> Any:
    """Blocks are units; with ``nested_mlp`` each block's MLP is a unit inside it.

    (The parity sweep keeps the transformer at 3 units for speed; nesting is
    exercised by the frozen model's policy and by :class:`DeepNest`.)
    """
    classes: set[type[nn.Module]] = {Block, Mlp} if nested_mlp else {Block}
    return wrap_api(impl).ModuleWrapPolicy(classes)


def transformer_input(gen: torch.Generator, batch: int = 3, seq: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=gen)


# ---------------------------------------------------------------------------
# 2. frozen parameters
# ---------------------------------------------------------------------------


class Frozen(nn.Module):
    """A unit whose parameters are all frozen (use_orig_params=False needs that)."""

    def __init__(self, d: int = DIM) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class FrozenModel(nn.Module):
    """in-proj -> Block -> Frozen unit -> Block -> out-proj on float inputs.

    With ``mixed=True`` some parameters of the first Block are frozen too, so
    that unit mixes frozen and trainable parameters (only valid with
    ``use_orig_params=True``).
    """

    def __init__(self, mixed: bool = False, d: int = DIM, h: int = HIDDEN) -> None:
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.b0 = Block(d, h)
        self.frozen = Frozen(d)
        self.b1 = Block(d, h)
        self.out = nn.Linear(d, 3)
        if mixed:
            self.b0.mix.weight.requires_grad_(False)
            self.b0.mlp.up.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.b1(self.frozen(self.b0(self.inp(x)))))


def frozen_policy(impl: str) -> Any:
    """Blocks, their MLPs (nested units) and the frozen module are units."""
    return wrap_api(impl).ModuleWrapPolicy({Block, Mlp, Frozen})


def float_input(gen: torch.Generator, batch: int = 3, seq: int = 4, feat: int = 5) -> torch.Tensor:
    return torch.randn(batch, seq, feat, generator=gen)


# ---------------------------------------------------------------------------
# 3. deep manual nesting: unit inside unit inside root
# ---------------------------------------------------------------------------


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 9)
        self.b = nn.Linear(9, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Middle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(7, 7)
        self.inner = Inner()
        self.post = nn.LayerNorm(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(x + self.inner(self.pre(x)))


class DeepNest(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.mid = Middle()
        self.out = nn.Linear(7, 3)
        self.register_buffer("bias2", torch.linspace(-1.0, 1.0, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(self.inp(x))) + self.bias2


def wrap_deep(impl: str, model: DeepNest, **kw: Any) -> nn.Module:
    """Manual wrapping: FSDP(DeepNest(mid=FSDP(Middle(inner=FSDP(Inner)))))."""
    cls = fsdp_cls(impl)
    kwargs = fsdp_kwargs(impl, **kw)
    model.mid.inner = cls(model.mid.inner, **kwargs)
    model.mid = cls(model.mid, **kwargs)
    return cls(model, **kwargs)


# ---------------------------------------------------------------------------
# 4. LoRA-shaped units: frozen base weights beside small trainable adapters
# ---------------------------------------------------------------------------


class LoraLinear(nn.Module):
    """A frozen base ``Linear`` (in ``base_dtype``) plus a trainable rank-``r``
    update in float32, as PEFT's LoRA layer: ``base(x) + B(A(x))``.  A base in
    another dtype computes in its own dtype (as a quantized base does)."""

    def __init__(self, d_in: int, d_out: int, r: int = 2,
                 base_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).to(base_dtype).requires_grad_(False)
        self.lora_A = nn.Linear(d_in, r, bias=False)
        self.lora_B = nn.Linear(r, d_out, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.3)  # (PEFT starts it at 0: A would get no grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base(x.to(self.base.weight.dtype)).to(x.dtype)
        return base + self.lora_B(self.lora_A(x))


class LoraBlock(nn.Module):
    """A frozen norm, a LoRA projection, a frozen up-projection and a LoRA
    down-projection: one unit holding frozen and trainable parameters (and,
    with ``base_dtype`` float64, two dtypes)."""

    def __init__(self, d: int = DIM, h: int = HIDDEN,
                 base_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d).requires_grad_(False)
        self.q = LoraLinear(d, d, base_dtype=base_dtype)
        self.up = nn.Linear(d, h).requires_grad_(False)
        self.down = LoraLinear(h, d, base_dtype=base_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.q(self.norm(x))
        x = x + self.down(torch.relu(self.up(x)))
        gain = getattr(self, "gain", None)  # (LoraNet(tiny_trainable=True))
        return x if gain is None else x * gain


class LoraNet(nn.Module):
    """Frozen input projection (so the first block's input needs no grad), two
    LoRA blocks, a trainable head.  ``tiny_trainable``: only one element per
    block trains (a rank's shard of every trainable flat parameter is empty
    at 2+ ranks)."""

    def __init__(self, base_dtype: torch.dtype = torch.float32,
                 tiny_trainable: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(5, DIM).requires_grad_(False)
        self.b0 = LoraBlock(base_dtype=base_dtype)
        self.b1 = LoraBlock(base_dtype=base_dtype)
        self.out = nn.Linear(DIM, 3)
        if tiny_trainable:
            self.requires_grad_(False)
            for b in (self.b0, self.b1):
                b.register_parameter("gain", nn.Parameter(torch.ones(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.b1(self.b0(self.inp(x))))


def lora_policy(impl: str) -> Any:
    return wrap_api(impl).ModuleWrapPolicy({LoraBlock})


# ---------------------------------------------------------------------------
# registry used by the sweeps
# ---------------------------------------------------------------------------

MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], torch.Tensor]]] = {
    "transformer": (TinyTransformer, transformer_input),
    "frozen": (lambda: FrozenModel(mixed=False), float_input),
    "frozen_mixed": (lambda: FrozenModel(mixed=True), float_input),
    "deep": (DeepNest, float_input),
}


def build(model_name: str, impl: str, base: nn.Module | None = None, **kw: Any) -> nn.Module:
    """Wrap a deep copy of ``base`` (or a fresh model) with ``impl``'s FSDP.

    ``kw`` are FSDP kwargs (enum names allowed); the model's wrap policy or
    manual wrapping is added here.
    """
    factory, _ = MODELS[model_name]
    model = copy.deepcopy(base) if base is not None else factory()
    if model_name == "deep":
        return wrap_deep(impl, model, **kw)  # type: ignore[arg-type]
    if model_name == "transformer":
        policy = transformer_policy(impl)
    else:
        policy = frozen_policy(impl)
    return fsdp_cls(impl)(model, auto_wrap_policy=policy, **fsdp_kwargs(impl, **kw))


def make_input(model_name: str, gen: torch.Generator) -> torch.Tensor:
    return MODELS[model_name][1](gen)


def new_model(model_name: str) -> nn.Module:
    return MODELS[model_name][0]()
