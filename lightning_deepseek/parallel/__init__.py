"""Hybrid parallelism: ``HybridParallelStrategy`` (registered with Lightning as ``"hybrid"``), its automatic
tensor-parallel plan, topology discovery, rank placement and mesh-aware gradient clipping."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_deepseek.parallel.arguments import UnknownArgumentError
from lightning_deepseek.parallel.clipping import clip_grad_norm_, clip_grad_value_
from lightning_deepseek.parallel.placement import LinkCost
from lightning_deepseek.parallel.plan import find_feed_forward_blocks
from lightning_deepseek.parallel.strategy import HybridParallelStrategy, MixedParamGroupError
from lightning_deepseek.parallel.topology import Topology

HybridParallelStrategy.register_strategies(StrategyRegistry)

__all__ = ["HybridParallelStrategy", "LinkCost", "MixedParamGroupError", "Topology", "UnknownArgumentError",
           "clip_grad_norm_", "clip_grad_value_", "find_feed_forward_blocks"]
