"""Planning before renting: ``HybridParallelStrategy``'s own set-up and one training step at any world size on
torch's fake process group and fake tensors (:mod:`.planner`), the memory per rank, the bytes per mesh dimension and
link, and the step time a cluster's figures predict; and the search over the strategy's layouts (:mod:`.search`).
``lds-plan`` is its command line. Nothing here imports the application.
"""

from lightning_deepseek.planning.cluster import ClusterSpec, ClusterSpecError
from lightning_deepseek.planning.layout import PlanLayout, StepShape
from lightning_deepseek.planning.models import ModelSpec
from lightning_deepseek.planning.planner import plan
from lightning_deepseek.planning.report import PlanReport

__all__ = ["ClusterSpec", "ClusterSpecError", "ModelSpec", "PlanLayout", "PlanReport", "StepShape", "plan"]
