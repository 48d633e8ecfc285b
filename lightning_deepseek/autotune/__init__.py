"""The ``"auto"`` settings of the library (docs/autotune.md): ``HybridParallelStrategy(tensor_parallel_size="auto")``,
``expert_parallel_size="auto"``, ``data_parallel_shard_size="auto"`` and ``GradientCompression(bits="auto")`` time a
copy of each candidate layout that fits in memory (DDP-wrapped, or sharded by FSDP2) and keep plain DDP unless
another is faster by a margin (``decision``: candidates, memory filter, margin rule; ``measure``: the timed copies;
``auto_parallel``: the steps at setup). Imported on first use.
"""

import importlib
from typing import Any

_LAZY = {
    **dict.fromkeys(("Candidate", "Decision", "ModelMemory", "NoCandidateFitsError", "candidates", "decide"),
                    "decision"),
    **dict.fromkeys(("decide_compression", "decide_parallel"), "auto_parallel"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"lightning_deepseek.autotune.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [*_LAZY]
