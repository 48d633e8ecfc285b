"""``PlanLayout`` and ``StepShape``: the settings a plan is made for, each one validated value.

``PlanLayout`` holds the strategy's layout settings: ``tensor_parallel_size``, ``expert_parallel_size``,
``shard_optimizer_states`` (ZeRO-1), ``placement``, FSDP2's ``data_parallel_shard_size`` and
``reshard_after_forward``, ``activation_checkpointing``, and the pipeline's ``pipeline_parallel_size``,
``pipeline_schedule`` and ``pipeline_microbatches``, and the bits of ``GradientCompression``'s exchange; the
data-parallel size is what is left of the world. They are validated by the strategy's own ``LayoutSettings`` (the
bits by ``CompressionConfig`` too). Each setting the strategy gains is one more field here, one more
axis of :func:`lightning_deepseek.planning.search.candidate_layouts`, and one more argument handed to the strategy's
own code by the planner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_deepseek.autotune.measure import BLOCK_SIZE
from lightning_deepseek.compression.config import CompressionConfig
from lightning_deepseek.compression.quantize import SUPPORTED_BITS
from lightning_deepseek.parallel.layout import LayoutSettings
from lightning_deepseek.parallel.pipeline import min_microbatches

DTYPES = ("fp32", "bf16", "fp8")


@dataclass(frozen=True)
class PlanLayout:
    """A layout of ``HybridParallelStrategy``.

    Args:
        tp: ``tensor_parallel_size``.
        ep: ``expert_parallel_size``.
        shard_optimizer_states: ZeRO-1.
        placement: the rank-order policy (``"auto"``: the strategy's estimate over the cluster's link figures).
        dp_shard: ``data_parallel_shard_size`` (FSDP2; the other data-parallel ranks replicate the shards: HSDP).
        reshard_after_forward: FSDP2's: free each block's gathered parameters after its forward.
        activation_checkpointing: ``"none"``, ``"full"`` or ``"selective"`` per transformer block.
        pp: ``pipeline_parallel_size`` (1: no pipeline).
        pp_schedule: ``pipeline_schedule`` (``"1F1B"``, ``"Interleaved1F1B"``, ``"ZBVZeroBubble"``, ``"DualPipeV"``).
        pp_microbatches: ``pipeline_microbatches`` (None: the schedule's least); each of
            :attr:`StepShape.micro_batch_size` sequences.
        bits: ``GradientCompression``'s bits (8 or 4, at lds-train's preset block size of those bits: its
            ``compression=int8`` / ``int4``; the plan is of a step past the warm-up) on DDP's buckets; None: DDP's
            fp32 all-reduce.
        sequence_parallel: ``sequence_parallel`` (with pp and tp: the stages' blocks on ``1 / tp`` of the sequence).
        loss_parallel: ``loss_parallel`` (with pp and tp: the embedding, head and loss sharded by vocabulary).
    """

    tp: int = 1
    ep: int = 1
    shard_optimizer_states: bool = False
    placement: str = "auto"
    dp_shard: int = 1
    reshard_after_forward: bool = True
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    pp: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatches: int | None = None
    bits: int | None = None
    sequence_parallel: bool = False
    loss_parallel: bool = False

    def __post_init__(self) -> None:
        for name, size in (("tensor_parallel_size", self.tp), ("expert_parallel_size", self.ep)):
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{name}={size!r} must be a positive integer.")
        if self.dp_shard == "auto":
            raise ValueError("data_parallel_shard_size='auto' is the processes per node: give the number for a plan "
                             "(the cluster's gpus_per_node).")
        if self.bits is not None and (isinstance(self.bits, bool) or self.bits not in SUPPORTED_BITS):
            raise ValueError(f"compression bits={self.bits!r} cannot be planned: use None (DDP's fp32 all-reduce), "
                             "8 (compression=int8) or 4 (compression=int4); layout=auto plans each.")
        self.compression()  # the callback's own checks
        self.settings()  # the strategy's own checks

    def settings(self) -> LayoutSettings:
        """The strategy's ``LayoutSettings`` of this layout."""
        return LayoutSettings(self.tp, self.ep, self.dp_shard, placement=self.placement,
                              reshard_after_forward=self.reshard_after_forward,
                              activation_checkpointing=self.activation_checkpointing,
                              shard_optimizer_states=self.shard_optimizer_states, pp=self.pp,
                              pp_schedule=self.pp_schedule, pp_microbatches=self.pp_microbatches,
                              bits=self.bits, sp=self.sequence_parallel, loss_parallel=self.loss_parallel)

    def compression(self) -> CompressionConfig | None:
        """The settings of the compressed exchange ``GradientCompression(bits=bits)`` runs (lds-train's preset of
        these bits), or None without compression."""
        return None if self.bits is None else CompressionConfig(bits=self.bits, block_size=BLOCK_SIZE[self.bits])

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step (1 without a pipeline)."""
        return 1 if self.pp == 1 else self.pp_microbatches or min_microbatches(self.pp_schedule, self.pp)

    def describe(self, world_size: int) -> str:
        parts = [f"dp={world_size // (self.tp * self.pp)}", f"tp={self.tp}"]
        parts += [f"pp={self.pp} {self.pp_schedule} x{self.num_microbatches}"] if self.pp > 1 else []
        parts += [f"ep={self.ep}"] if self.ep > 1 else []
        parts += ["zero1"] if self.shard_optimizer_states else []
        if self.dp_shard > 1:
            replicas = world_size // (self.dp_shard * self.pp) if world_size else 0
            parts += [f"fsdp={self.dp_shard}" + (f"x{replicas}" if replicas > 1 else "")]
            parts += [] if self.reshard_after_forward else ["no-reshard"]
        parts += [f"ac={self.activation_checkpointing}"] if self.activation_checkpointing != "none" else []
        parts += [f"int{self.bits}"] if self.bits is not None else []
        parts += ["sp"] if self.sequence_parallel else []
        parts += ["loss-parallel"] if self.loss_parallel else []
        return " ".join(parts)


@dataclass(frozen=True)
class StepShape:
    """One training step of a plan.

    Args:
        micro_batch_size: sequences per rank and step (under a pipeline: per micro-batch).
        seq_len: tokens per sequence.
        dtype: ``"fp32"``, or ``"bf16"``: FP32 parameters, gradients and AdamW states, BF16 autocast compute (the
            peak FLOPs of this dtype count); or ``"fp8"``: ``"bf16"`` with ``StagedPrecision``'s FP8 stage, torchao's
            float8 training (tensorwise) on the ``nn.Linear`` layers it selects: their GEMMs at the fp8 peak, the rest
            at the bf16 peak (:mod:`lightning_deepseek.planning.float8`; needs torchao).
        compute_efficiency: the fraction of the peak FLOPs the step's compute reaches (an assumption, printed).
        compiled: the model under ``torch.compile``: the compute reaches ``compute_efficiency`` times
            :data:`~lightning_deepseek.planning.estimate.COMPILE_SPEEDUP` (a calibrated ratio; memory unchanged).
        min_shard_params: the strategy's ``min_shard_params``.
        bucket_cap_mb: DDP's ``bucket_cap_mb``.
        fsdp_bf16: with ``dtype="bf16"``, FSDP2's units under ``StagedPrecision``'s BF16 stage policy
            (:mod:`lightning_deepseek.precision.fsdp_policy`: parameters gathered and computed in BF16, gradients
            reduce-scattered in FP32; the sharded FP32 parameters and AdamW states unchanged).
    """

    micro_batch_size: int = 1
    seq_len: int = 2048
    dtype: str = "bf16"
    compute_efficiency: float = 0.4
    compiled: bool = False
    min_shard_params: int = 1 << 16
    bucket_cap_mb: float = 25.0
    fsdp_bf16: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {DTYPES}.")
        if self.micro_batch_size < 1 or self.seq_len < 1:
            raise ValueError(f"micro_batch_size={self.micro_batch_size} and seq_len={self.seq_len} must be >= 1.")
        if self.fsdp_bf16 and self.dtype == "fp32":
            raise ValueError(f"fsdp_bf16=True needs dtype='bf16' or 'fp8' (got {self.dtype!r}): FSDP2's BF16 policy is "
                             "that of a BF16 or FP8 stage. Set dtype='bf16' or fsdp_bf16=False.")
        if not 0 < self.compute_efficiency <= 1:
            raise ValueError(f"compute_efficiency={self.compute_efficiency} must be in (0, 1].")

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_len
