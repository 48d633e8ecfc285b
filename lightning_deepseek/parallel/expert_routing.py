"""``ExpertRouting``: how tokens reach their experts under expert parallelism, as one validated value.

Node-limited routing (DeepSeek-V3: each token's routed experts on at most ``max_islands_per_token`` islands,
:mod:`~lightning_deepseek.moe.node_limited`) and the dispatch that sends the rows (flat all-to-all, or per island
so that a token crosses to each island once, :mod:`~lightning_deepseek.parallel.expert_dispatch`).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_deepseek.moe.node_limited import check_max_islands
from lightning_deepseek.parallel.expert_dispatch import Dispatch, check_expert_dispatch


@dataclass(frozen=True)
class ExpertRouting:
    """MoE routing settings of ``HybridParallelStrategy``, validated at construction.

    Args:
        max_islands_per_token: each token's routed experts lie on at most this many islands of the cluster's
            topology; None: no limit.
        dispatch: ``"auto"`` (per island under node-limited routing when an expert-parallel group spans islands,
            else flat), ``"flat"`` or ``"per_island"``.
    """

    max_islands_per_token: int | None = None
    dispatch: Dispatch = "auto"

    def __post_init__(self) -> None:
        check_max_islands(self.max_islands_per_token)
        check_expert_dispatch(self.dispatch)
