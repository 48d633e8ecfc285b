"""Automatic configuration: decisions by a cost model (``cost_model``, ``measure``, ``auto_parallel``)."""

# --- cost model (helper "auto", issue #16 item 1): keep this block when merging with the tune helper's exports ---
from lightning_deepseek.autotune.cost_model import (
    Candidate,
    ComputeProfile,
    Decision,
    Machine,
    ModelFacts,
    NoCandidateFitsError,
    Prediction,
    decide,
    predict,
)

__all__ = ["Candidate", "ComputeProfile", "Decision", "Machine", "ModelFacts", "NoCandidateFitsError", "Prediction",
           "decide", "predict"]
# --- end cost model block ---
