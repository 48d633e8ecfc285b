"""Mixture-of-Experts support: the MoE protocol (how experts and balancing biases are found) and the
``ExpertLoadBalancing`` callback (DeepSeek-V3's aux-loss-free balancing). Expert parallelism itself lives in
:mod:`lightning_deepseek.parallel.expert`; the example model's MoE layer in :mod:`lightning_deepseek.models.moe`."""

from lightning_deepseek.moe.balancing import ExpertLoadBalancing
from lightning_deepseek.moe.protocol import ExpertLayer, find_expert_layers, register_experts

__all__ = ["ExpertLayer", "ExpertLoadBalancing", "find_expert_layers", "register_experts"]
