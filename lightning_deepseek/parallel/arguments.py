"""Keyword arguments that ``HybridParallelStrategy`` forwards: checked at construction, not at fit time.

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
