"""``PlanReport``: what a plan found for one rank, as a frozen value, a table and a JSON-ready mapping."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lightning_deepseek.planning.layout import PlanLayout, StepShape

GIB = 2**30
# What torch's caching allocator reserves over the step's tensors (its ``reserved_bytes.all.peak`` over their peak).
# Calibrated on torchtitan's published Llama 3.1 8B eager rows, FSDP over 8 and 128 H100s (82.4 and 67.0 GiB
# reserved, torchtitan's benchmarks/llama3_h100_202412_torchtitan.md) over the tensors' peak of the same steps under
# torch's MemTracker (68.6 and 58.1 GiB, torchtitan's own step on a fake world, benchmarks/planning/
# torchtitan_own_step.py, and this planner's alike): x1.20 and x1.15. A caching allocator's reserve grows with the
# freed blocks it cannot reuse (fragmentation, other streams' pools), not as a fixed share: an estimate of what a run
# reports, not a bound.
ALLOCATOR_RESERVE = 1.18


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds. ``params``, ``grads`` (after backward), ``states`` (after the step) are counted on the
    sharded tensors; ``states_max`` is the most loaded rank's states (ZeRO-1); ``activations`` is what the memory
    tracker sees held at the end of forward (activations saved for backward and temporaries), ``peak`` its highest
    total over the first step plus DDP's buckets (``ddp_buckets``) and gradient compression's residuals and message
    buffers (``compression``); ``steady_peak`` the peak of the steps after it, whose forward and backward run with
    the optimizer states held (a run's maximum: what must fit; the caching allocator frees its cache and retries
    before it runs out); ``reserved`` what the caching allocator is estimated to reserve for it
    (:data:`ALLOCATOR_RESERVE`): what a run's ``torch.cuda.max_memory_reserved`` reports."""

    params: int
    grads: int
    states: int
    states_max: int
    activations: int
    ddp_buckets: int
    peak: int
    steady_peak: int = 0
    compression: int = 0

    @property
    def reserved(self) -> int:
        return int(self.steady_peak * ALLOCATOR_RESERVE)


@dataclass(frozen=True)
class Traffic:
    """Bytes per step one rank hands to the collectives of one mesh dimension and op, their calls, the link class
    (``intra``: inside a node, ``inter``: across nodes), the predicted seconds and how many of them are exposed."""

    dim: str
    op: str
    group_size: int
    link: str
    calls: int
    num_bytes: int
    seconds: float
    exposed_seconds: float


@dataclass(frozen=True)
class StageRow:
    """One pipeline stage: its pipeline rank, the micro-batches it holds in flight at most (torch's action table),
    the activations one micro-batch holds, its forward and backward seconds per micro-batch."""

    stage: int
    pp_rank: int
    in_flight: int
    activations: int
    forward_seconds: float
    backward_seconds: float


@dataclass(frozen=True)
class PipelineRankRow:
    """What one pipeline rank holds: model states, the activations of its in-flight micro-batches at its peak, the
    receive buffers torch's stages keep (one per micro-batch and direction), and its peak of the later steps."""

    pp_rank: int
    stages: tuple[int, ...]
    params: int
    grads: int
    states: int
    activations: int
    buffers: int
    peak: int


@dataclass(frozen=True)
class PipelinePlan:
    """A pipelined plan's schedule: each rank and stage, the replayed step (``makespan``: the schedule's compute and
    bubble, point-to-point transfers included), how much of it is bubble and exposed transfer, and the least, over
    the pipeline ranks, of a rank's tensor- and expert-parallel collectives in its forwards and backwards (exposed
    whole in the step)."""

    schedule: str
    pp: int
    num_microbatches: int
    ranks: tuple[PipelineRankRow, ...]
    stages: tuple[StageRow, ...]
    makespan: float
    bubble_seconds: float
    p2p_exposed_seconds: float
    least_parallel_seconds: float = 0.0

    def table(self, unit: str = "GiB", scale: int = GIB) -> str:
        share = self.bubble_seconds / self.makespan if self.makespan else 0.0
        lines = [f"pipeline: {self.schedule}, pp={self.pp}, {self.num_microbatches} micro-batches; schedule "
                 f"{self.makespan:.3f} s of which bubble {self.bubble_seconds:.3f} s ({share:.1%}), exposed "
                 f"point-to-point {self.p2p_exposed_seconds:.4f} s",
                 "", "| pp rank | stages | params | grads | optimizer states | held activations | receive buffers | "
                 f"peak ({unit}) |", "|---|---|---|---|---|---|---|---|"]
        for r in self.ranks:
            values = (r.params, r.grads, r.states, r.activations, r.buffers, r.peak)
            lines.append(f"| {r.pp_rank} | {','.join(map(str, r.stages))} | "
                         + " | ".join(f"{v / scale:,.2f}" for v in values) + " |")
        lines += ["", "| stage | pp rank | in flight (micro-batches) | activations per micro-batch (MiB) | forward s | "
                  "backward s |", "|---|---|---|---|---|---|"]
        lines += [f"| {s.stage} | {s.pp_rank} | {s.in_flight} | {s.activations / 2**20:,.1f} | "
                  f"{s.forward_seconds:.4f} | {s.backward_seconds:.4f} |" for s in self.stages]
        return "\n".join(lines)


@dataclass(frozen=True)
class PlanReport:
    """One plan: the layout, rank 0's memory and traffic, the predicted step, the assumptions behind it."""

    model: str
    world_size: int
    layout: PlanLayout
    cluster: str
    step: StepShape
    placement: str
    num_sharded_layers: int
    memory: RankMemory
    memory_capacity: int
    traffic: tuple[Traffic, ...]
    flops: float
    compute_seconds: float
    optimizer_seconds: float
    comm_seconds: float
    step_seconds: float
    tokens_per_second_per_gpu: float
    mfu: float
    plan_seconds: float
    assumptions: tuple[str, ...]
    pipeline: PipelinePlan | None = None
    codec_seconds: float = 0.0

    @property
    def fits(self) -> bool:
        return self.memory.steady_peak <= self.memory_capacity

    def bytes_by_dim(self) -> dict[str, int]:
        """Bytes per step by mesh dimension."""
        totals: dict[str, int] = {}
        for row in self.traffic:
            totals[row.dim] = totals.get(row.dim, 0) + row.num_bytes
        return totals

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["fits"] = self.fits
        out["memory"]["reserved"] = self.memory.reserved
        out["layout_text"] = self.layout.describe(self.world_size)
        return out

    def table(self) -> str:
        m = self.memory
        layout = self.layout.describe(self.world_size)
        lines = [f"lds-plan: {self.model} on {self.world_size} x {self.cluster}, layout {layout}"
                 f" (placement {self.placement}, {self.num_sharded_layers} tensor-parallel layers), micro-batch "
                 f"{self.step.micro_batch_size} x {self.step.seq_len} tokens, {self.step.dtype}",
                 "", "", "|---|---|"]
        rows = [("parameters", m.params), ("gradients", m.grads), ("optimizer states", m.states)]
        rows += [("optimizer states, most loaded rank", m.states_max)] if m.states_max != m.states else []
        held = "activations at the end of forward" if self.pipeline is None else "activations held (most in flight)"
        rows += [(held, m.activations), ("DDP buckets", m.ddp_buckets)]
        rows += [("compression residuals and messages", m.compression)] if m.compression else []
        rows += [("peak, first step", m.peak), ("peak, later steps (optimizer states held)", m.steady_peak),
                 (f"reserved by the caching allocator, later steps (x{ALLOCATOR_RESERVE}, estimate)", m.reserved),
                 ("device memory", self.memory_capacity)]
        unit, scale = ("GiB", GIB) if m.steady_peak >= GIB else ("MiB", 2**20)
        who = "rank 0" if self.pipeline is None else "the most loaded pipeline rank"
        lines[2] = f"| memory per rank ({who}) | {unit} |"
        lines += [f"| {name} | {value / scale:,.2f} |" for name, value in rows]
        verdict = "fits" if self.fits else f"does NOT fit: {(m.steady_peak - self.memory_capacity) / GIB:.2f} GiB over"
        lines += [f"\n{verdict}", "", "| mesh dim | op | group | link | calls | MiB per step | seconds | exposed |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {t.dim} | {t.op} | {t.group_size} | {t.link} | {t.calls} | {t.num_bytes / 2**20:,.3f} | "
                  f"{t.seconds:.4f} | {t.exposed_seconds:.4f} |" for t in self.traffic]
        lines += ["", self.pipeline.table(unit, scale)] if self.pipeline is not None else []
        bubble = f" + pipeline bubble {self.pipeline.bubble_seconds:.3f} s" if self.pipeline is not None else ""
        bubble += f" + compression codec {self.codec_seconds:.3f} s" if self.codec_seconds else ""
        lines += ["", f"step: {self.step_seconds:.3f} s = compute {self.compute_seconds:.3f} s "
                  f"({self.flops / 1e12:.1f} TFLOP) + optimizer {self.optimizer_seconds:.3f} s + exposed "
                  f"communication {self.comm_seconds:.3f} s{bubble}; {self.tokens_per_second_per_gpu:,.0f} tokens/s "
                  f"per GPU, MFU {self.mfu:.1%}",
                  f"planned in {self.plan_seconds:.1f} s", "assumptions:"]
        lines += [f"- {a}" for a in self.assumptions]
        return "\n".join(lines)
