"""``AdamW`` with BF16 moments: DeepSeek-V3's optimizer state, half the bytes of FP32 moments.

A drop-in for ``torch.optim.AdamW`` (same arguments, same update) with ``moment_dtype``: the first and second
moments are stored in that dtype (BF16 by default) while parameters stay FP32 and every step computes in FP32
(each moment is widened, updated, used for this step's update, and stored back). With ``moment_dtype=torch.float32``
the steps are bitwise those of ``torch.optim.AdamW(foreach=False)``.

Rounding: BF16 keeps 8 significant bits, and Adam's second-moment increment ``(1 - beta2) * g**2`` is 1/1000 of the
moment: after a few hundred steps it falls below half a BF16 unit and round-to-nearest would freeze the moment.
``stochastic_rounding=True`` (the default) rounds up or down with probability proportional to the distance, so the
stored moment is unbiased and keeps moving; its random bits come from the optimizer's own generators (seeded by
``seed``, saved in ``state_dict``), so the training RNG stream is untouched and a resume continues exactly.

Why our own: ``torch.optim.AdamW`` keeps moments in the parameter's dtype (and ``load_state_dict`` casts them back
to it); torchao's optimizers quantize moments block-wise to 8/4 bit or FP8 (``AdamW8bit``, ``AdamW4bit``,
``AdamWFp8``), and its BF16-state AdamW (``torchao.optim._AdamW``) is private, meant for BF16 parameters, and
compiles every step with ``torch.compile`` (a C++ toolchain and minutes of compilation on CPU). This class is the
single-tensor Adam loop of torch with a cast on each side of the moment update.

Supports: dense gradients on any device, plain tensors and DTensors, several parameter groups, LR schedulers.
Does not support: ``amsgrad``, ``maximize``, complex or sparse parameters, ``capturable``/``fused``/``foreach``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer


class OptimizerConfigError(ValueError):
    """A bad optimizer argument; the message names it and the fix."""


class AdamW(Optimizer):
    """AdamW whose moments are stored in ``moment_dtype``.

    Args:
        params: parameters or parameter groups.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        moment_dtype: storage dtype of ``exp_avg`` and ``exp_avg_sq`` (``torch.bfloat16`` or ``torch.float32``).
        stochastic_rounding: round moments to a narrower dtype stochastically (see the module docstring).
        seed: seed of the rounding generators.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        moment_dtype: torch.dtype = torch.bfloat16,
        stochastic_rounding: bool = True,
        seed: int = 0,
    ) -> None:
        checks = [
            ("lr", lr, lr >= 0, "a value >= 0"), ("eps", eps, eps >= 0, "a value >= 0"),
            ("betas", betas, len(betas) == 2 and all(0 <= b < 1 for b in betas), "two values in [0, 1)"),
            ("weight_decay", weight_decay, weight_decay >= 0, "a value >= 0"),
            ("moment_dtype", moment_dtype, moment_dtype in (torch.bfloat16, torch.float32),
             "torch.bfloat16 (half the bytes) or torch.float32 (torch's AdamW)"),
        ]
        for name, value, ok, fix in checks:
            if not ok:
                raise OptimizerConfigError(f"AdamW `{name}={value}` is out of range. Use {fix}.")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.moment_dtype = moment_dtype
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    def _store(self, moment: torch.Tensor, value: torch.Tensor) -> None:
        """Write the FP32 ``value`` into ``moment`` (its own dtype), stochastically rounded if asked."""
        if moment.dtype == value.dtype:
            if moment is not value:
                moment.copy_(value)
            return
        if self.stochastic_rounding and moment.dtype == torch.bfloat16:
            local = value.to_local() if hasattr(value, "to_local") else value
            bits = local.view(torch.int32)
            noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device,
                                  generator=self._generator(bits.device))
            # Adding 16 random low bits then truncating them rounds the magnitude up with probability equal to the
            # cut-off fraction; the truncated float is exactly representable in BF16.
            bits.add_(noise).bitwise_and_(-65536)
        moment.copy_(value)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if grad.is_sparse:
                    raise RuntimeError("lightning_deepseek.optim.AdamW does not support sparse gradients.")
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, dtype=self.moment_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.moment_dtype)
                state["step"] += 1
                step = state["step"].item()
                # torch's single-tensor AdamW, in FP32 on widened moments (`.float()` is a no-op for FP32 ones).
                param.mul_(1 - lr * weight_decay)
                exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
                param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
                self._store(state["exp_avg"], exp_avg)
                self._store(state["exp_avg_sq"], exp_avg_sq)
        return loss

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        state = super().state_dict()
        state["rounding_generators"] = {key: g.get_state() for key, g in self._generators.items()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        state_dict = dict(state_dict)
        generators = state_dict.pop("rounding_generators", {})
        super().load_state_dict(state_dict)
        # torch casts loaded floating-point state to the parameter's dtype; the moments go back to theirs.
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(self.moment_dtype)
        for key, rng_state in generators.items():
            self._generator(torch.device(key)).set_state(rng_state)

    def moment_bytes(self) -> int:
        """Bytes held by the moments (``exp_avg`` and ``exp_avg_sq``) of every parameter stepped so far."""
        return sum(s[k].numel() * s[k].element_size() for s in self.state.values() for k in ("exp_avg", "exp_avg_sq")
                   if k in s)
