"""Hybrid parallelism: ``HybridParallelStrategy`` (registered with Lightning as ``"hybrid"``), its settings
(``Cluster``, ``ExpertRouting``), its decided ``Layout``, parallel sizes and meshes (``ParallelDims``,
``WorldMesh``), its tensor-parallel ``Plan`` (declared by the model or found by structure), topology discovery, rank
placement and mesh-aware gradient clipping."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_deepseek.parallel.arguments import UnknownArgumentError
from lightning_deepseek.parallel.clipping import clip_grad_norm_, clip_grad_value_, total_grad_norm
from lightning_deepseek.parallel.cluster import Cluster
from lightning_deepseek.parallel.dims import ParallelDims, WorldMesh
from lightning_deepseek.parallel.expert_routing import ExpertRouting
from lightning_deepseek.parallel.layout import Layout
from lightning_deepseek.parallel.optimizers import MixedParamGroupError
from lightning_deepseek.parallel.placement import LinkCost
from lightning_deepseek.parallel.plan import Plan, PlanEntry, find_feed_forward_blocks
from lightning_deepseek.parallel.strategy import HybridParallelStrategy
from lightning_deepseek.parallel.topology import Topology

HybridParallelStrategy.register_strategies(StrategyRegistry)

__all__ = ["Cluster", "ExpertRouting", "HybridParallelStrategy", "Layout", "LinkCost", "MixedParamGroupError",
           "ParallelDims", "Plan", "PlanEntry", "Topology", "UnknownArgumentError", "WorldMesh", "clip_grad_norm_",
           "clip_grad_value_", "find_feed_forward_blocks", "total_grad_norm"]
