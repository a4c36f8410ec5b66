"""What the framework scripts share: results, and the documented ways past the
frameworks' GPU-only gates on CPU (test harness only, never the library;
Accelerate's is shared with the TRL benchmark, ``benchmarks/_trl_models.py``).

The scenario scripts (``accelerate_run.py`` ...) run inside ``scenarios_run.py``
under ``torchrun --nproc-per-node 2`` (gloo), which gives each its results and
output folder.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
import torch.nn as nn

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

from benchmarks._trl_models import accelerate_on_cpu as accelerate_on_cpu  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
OUT = sys.argv[1] if len(sys.argv) > 1 else "."
RESULTS: dict[str, Any] = {}

# Every framework run is made with torch's legacy optimizer-state functions
# raising NotImplementedError, as PyTorch PR #191712 proposes
# (tests/_torch_future.py): the frameworks under install() must not need them.
from tests._torch_future import LEGACY_OPTIM_APIS, REMOVED_HELPERS, torch_fsdp1_class  # noqa: E402
from tests._torch_future import apply as _remove_torch_legacy_optim_apis  # noqa: E402

_remove_torch_legacy_optim_apis()


def _raise_not_implemented(cls: Any) -> bool:
    for name in LEGACY_OPTIM_APIS:
        try:
            getattr(cls, name)()
        except NotImplementedError:
            continue
        except Exception:
            return False
        return False
    return True


# Observed here, before install() (which points the class's names at fsdp_wrap's
# working functions, the point of the exercise): torch's own raise.
_LEGACY_RAISED_BEFORE_INSTALL = _raise_not_implemented(torch_fsdp1_class())


def legacy_optim_apis_removed() -> bool:
    """Whether torch's legacy optimizer-state functions raised
    ``NotImplementedError`` before ``install()`` and the private helpers PR
    #191712 deletes are still gone (the simulated removal in force)."""
    import torch.distributed.fsdp._optim_utils as optim_utils

    return _LEGACY_RAISED_BEFORE_INSTALL and not any(hasattr(optim_utils, n) for n in REMOVED_HELPERS)


def record(key: str, value: Any) -> None:
    RESULTS[key] = value


def use_fsdp_wrap() -> None:
    """From here on torch's FSDP1 names are fsdp_wrap's (what a user does)."""
    import fsdp_wrap

    fsdp_wrap.install(verbose=False)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.l(x))


def mlp() -> nn.Module:
    """Two ``Block`` units and a head: the non-HF scripts' model (seeded)."""
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(16, 4))


def tiny_gpt2(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                     bos_token_id=0, eos_token_id=0,  # no dropout: resumed runs replay exactly
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).to(dtype)


def tokens(step: int, batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + RANK)
    return torch.randint(0, 64, (batch, 8), generator=g)


def full_params_match(fsdp_model: torch.nn.Module, plain_sd: dict[str, torch.Tensor]) -> float:
    """Largest difference between a model's full parameters and a plain state dict."""
    import fsdp_wrap

    with fsdp_wrap.FullyShardedDataParallel.summon_full_params(fsdp_model):
        own = {k: v.detach().clone() for k, v in fsdp_model.named_parameters()}
    assert own and set(own) <= set(plain_sd), (sorted(own)[:3], sorted(plain_sd)[:3])
    return max((own[k].float() - plain_sd[k].float()).abs().max().item() for k in own)


def exit_now(code: int = 0) -> None:
    """End this rank without interpreter shutdown (see fsdp_wrap/_teardown.py); imported
    late so that a run on torch's own FSDP1 never imports fsdp_wrap."""
    from fsdp_wrap.comm.teardown import exit_now as leave

    leave(code)
