"""``HybridParallelStrategy``'s arguments, checked at construction, not at fit time: its own (:func:`check_arguments`)
and the keyword arguments it forwards (:func:`check_ddp_kwargs`).

The strategy hands its extra keyword arguments to Lightning's ``DDPStrategy``, which passes the ones it does not
take on to torch ``DistributedDataParallel`` when the model is wrapped, in ``Trainer.fit``. A misspelt strategy
argument would fail there, as DDP's ``TypeError``. The names are checked against this Lightning's and this torch's
signatures (``inspect``), so the check follows their versions; the closest valid name comes from ``difflib``.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

_SET_BY_LIGHTNING = ("module", "device_ids")  # DDPStrategy._setup_model passes both itself


class UnknownArgumentError(ValueError):
    """A keyword argument is neither the strategy's, nor Lightning ``DDPStrategy``'s, nor torch
    ``DistributedDataParallel``'s."""


def _parameter_names(fn: Callable[..., Any]) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [n for n, p in inspect.signature(fn).parameters.items() if n != "self" and p.kind in kinds]


def check_ddp_kwargs(owner: type, kwargs: dict[str, Any]) -> None:
    """Raise ``UnknownArgumentError`` on the first of ``kwargs`` that neither ``DDPStrategy`` nor
    ``DistributedDataParallel`` takes, or that Lightning sets itself.

    Args:
        owner: the strategy class; its own ``__init__`` arguments are suggested too (``placment`` -> ``placement``).
        kwargs: the extra keyword arguments it received.
    """
    own = _parameter_names(owner.__init__)
    lightning = [n for n in _parameter_names(DDPStrategy.__init__) if n not in own]
    ddp = [n for n in _parameter_names(DistributedDataParallel.__init__) if n not in _SET_BY_LIGHTNING]
    name = owner.__name__
    for key, value in kwargs.items():
        if key in lightning or key in ddp:
            continue
        if key in _SET_BY_LIGHTNING:
            raise UnknownArgumentError(f"{name}({key}={value!r}): Lightning sets DistributedDataParallel's {key} "
                                       f"itself (from the Trainer's devices). Remove {key}.")
        close = difflib.get_close_matches(key, [*own, *lightning, *ddp], n=1)
        hint = (f"did you mean {close[0]}?" if close else
                f"{name} takes {', '.join(own)}; other keyword arguments go to torch DistributedDataParallel "
                f"({', '.join(ddp)}) or to Lightning's DDPStrategy ({', '.join(lightning)}).")
        raise UnknownArgumentError(f"{name}: unknown argument {key}={value!r}: {hint}")


def check_arguments(*, tensor_parallel_size: Any, expert_parallel_size: Any, plan: Any, min_shard_params: Any,
                    placement: Any, cluster: Any, expert_routing: Any, data_parallel_shard_size: Any,
                    shard_optimizer_states: Any) -> None:
    """Raise ``ValueError``/``TypeError`` naming the first bad argument of ``HybridParallelStrategy`` and its fix."""
    from lightning_deepseek.parallel.cluster import Cluster
    from lightning_deepseek.parallel.expert_routing import ExpertRouting
    from lightning_deepseek.parallel.placement import POLICIES

    for name, size in (("tensor_parallel_size", tensor_parallel_size), ("expert_parallel_size", expert_parallel_size)):
        if size not in ("auto", "per_node") and not (isinstance(size, int) and not isinstance(size, bool) and size > 0):
            raise ValueError(f"{name}={size!r} must be a positive integer, 'auto' (decided by timing copies of the "
                             "model) or 'per_node' (by the processes per node).")
    shard = data_parallel_shard_size
    if shard != "auto" and not (isinstance(shard, int) and not isinstance(shard, bool) and shard > 0):
        raise ValueError(f"data_parallel_shard_size={shard!r} must be a positive integer (1: parameters replicated) "
                         "or 'auto' (shard inside a node, replicate across nodes).")
    if shard != 1 and shard_optimizer_states:
        raise ValueError(f"shard_optimizer_states=True with data_parallel_shard_size={shard!r}: parameter sharding "
                         "already shards the optimizer states. Set shard_optimizer_states=False (or "
                         "data_parallel_shard_size=1 for ZeRO-1 alone).")
    if placement not in POLICIES:
        raise ValueError(f"placement={placement!r} is not a placement policy: use one of {POLICIES}.")
    if plan != "auto" and not isinstance(plan, dict):
        raise TypeError(f"plan={plan!r} must be 'auto' or a dict of module-name patterns to 'colwise'/'rowwise'.")
    if min_shard_params < 0:
        raise ValueError(f"min_shard_params={min_shard_params} must be >= 0.")
    for name, value, kind in (("cluster", cluster, Cluster), ("expert_routing", expert_routing, ExpertRouting)):
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{name}={value!r} must be a lightning_deepseek.parallel.{kind.__name__} or None.")
