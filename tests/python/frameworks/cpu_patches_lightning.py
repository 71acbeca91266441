"""CPU-only / old-version patches for PyTorch Lightning 2.2.5 on this machine (Debian's torch
1.13, Python 3.11), imported by run_patched.py before the example runs; neither
scape.integrations.lightning nor the example carries them.

- LightningModule.__init__ calls _register_sharded_tensor_state_dict_hooks_if_available, which
  on torch < 2.1 imports torch.distributed._shard.sharded_tensor; torch 1.13's module there
  declares a dataclass field with a mutable default, which Python 3.11's dataclasses refuse
  (ValueError: mutable default ... for field tensor_properties). The hooks only matter for
  ShardedTensor parameters (none here): the patch keeps Lightning's method and skips it only
  when that import fails. torch >= 2.1 (any GPU cluster's) does not take this path.
"""
from __future__ import annotations

import importlib


def _patch(flavour: str) -> None:
    try:
        mod = importlib.import_module(flavour + ".core.module")
    except ImportError:
        return
    cls = mod.LightningModule
    orig = cls._register_sharded_tensor_state_dict_hooks_if_available
    if getattr(orig, "_scape_cpu_patch", False):
        return

    def register_if_importable(self) -> None:
        try:
            import torch.distributed._shard.sharded_tensor  # noqa: F401
        except (ImportError, ValueError):
            return
        orig(self)

    register_if_importable._scape_cpu_patch = True  # type: ignore[attr-defined]
    cls._register_sharded_tensor_state_dict_hooks_if_available = register_if_importable


for _f in ("pytorch_lightning", "lightning.pytorch"):
    _patch(_f)
