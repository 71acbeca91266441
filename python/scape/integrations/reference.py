"""AdamS in plain torch: the dense baseline a framework runs with its own gradient exchange.

:class:`TorchAdamS` is the update :class:`scape.optim.ScapeAdamS` makes at ``density=1.0``
(``bias_correction="none"``, the default), written as an ordinary ``torch.optim.Optimizer``
over the framework's already-averaged gradients. Use it to separate "AdamS vs Adam" from
"sparse vs dense" inside a framework: the same model, data and schedule trained once with the
framework's own data-parallel machinery (DDP, DeepSpeed's engine, Megatron's DDP) and
``TorchAdamS``, once with ``ScapeAdamS`` and the framework's gradient exchange off. At density
1.0 the two follow each other to fp32 rounding (not bit for bit: ScapeAdamS averages
``b1*m + (1-b1)*g`` over ranks, the framework averages ``g``).

Per parameter, with m the previous momentum and g the averaged gradient (AdamS, arXiv
2505.16363)::

    v  = b2 * m**2 + (1 - b2) * g**2
    m  = b1 * m + (1 - b1) * g
    p *= 1 - lr * weight_decay
    p -= lr * m / (sqrt(v) + eps)
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Tuple

import torch

__all__ = ["TorchAdamS"]


class TorchAdamS(torch.optim.Optimizer):
    """AdamS (no second-moment state) as a plain torch optimizer; see the module docstring.

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr: learning rate (> 0).
        betas: (b1, b2), each in [0, 1).
        eps: added to the denominator (>= 0).
        weight_decay: decoupled weight decay (>= 0), applied to every coordinate.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        if not lr > 0.0:
            raise ValueError(f"TorchAdamS: lr: expected > 0, got {lr!r}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"TorchAdamS: betas: expected each in [0, 1), got {betas!r}")
        if not eps >= 0.0:
            raise ValueError(f"TorchAdamS: eps: expected >= 0, got {eps!r}")
        if not weight_decay >= 0.0:
            raise ValueError(f"TorchAdamS: weight_decay: expected >= 0, got {weight_decay!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = (group["lr"], group["betas"], group["eps"],
                                     group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                st = self.state[p]
                if "exp_avg" not in st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                m = st["exp_avg"]
                v = m.square().mul_(b2).add_(g.square(), alpha=1.0 - b2)
                m.mul_(b1).add_(g, alpha=1.0 - b1)
                st["step"] += 1
                if wd:
                    p.mul_(1.0 - lr * wd)
                p.sub_((m / v.sqrt().add_(eps)).mul_(lr).to(p.dtype))
        return loss
