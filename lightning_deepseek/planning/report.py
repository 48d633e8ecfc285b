"""``PlanReport``: what a plan found for one rank, as a frozen value, a table and a JSON-ready mapping."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lightning_deepseek.planning.layout import PlanLayout, StepShape

GIB = 2**30


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds. ``params``, ``grads`` (after backward), ``states`` (after the step) are counted on the
    sharded tensors; ``states_max`` is the most loaded rank's states (ZeRO-1); ``activations`` is what the memory
    tracker sees held at the end of forward (activations saved for backward and temporaries), ``peak`` its highest
    total over the first step plus DDP's buckets (``ddp_buckets``); ``steady_peak`` the peak of the steps after it,
    whose forward and backward run with the optimizer states held (a run's maximum: what must fit)."""

    params: int
    grads: int
    states: int
    states_max: int
    activations: int
    ddp_buckets: int
    peak: int
    steady_peak: int = 0


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
        out["layout_text"] = self.layout.describe(self.world_size)
        return out

    def table(self) -> str:
        m = self.memory
        layout = self.layout.describe(self.world_size)
        lines = [f"lds-plan: {self.model} on {self.world_size} x {self.cluster}, layout {layout}"
                 f" (placement {self.placement}, {self.num_sharded_layers} tensor-parallel layers), micro-batch "
                 f"{self.step.micro_batch_size} x {self.step.seq_len} tokens, {self.step.dtype}",
                 "", "| memory per rank (rank 0) | GiB |", "|---|---|"]
        rows = [("parameters", m.params), ("gradients", m.grads), ("optimizer states", m.states)]
        rows += [("optimizer states, most loaded rank", m.states_max)] if m.states_max != m.states else []
        rows += [("activations at the end of forward", m.activations), ("DDP buckets", m.ddp_buckets),
                 ("peak, first step", m.peak), ("peak, later steps (optimizer states held)", m.steady_peak),
                 ("device memory", self.memory_capacity)]
        unit, scale = ("GiB", GIB) if m.steady_peak >= GIB else ("MiB", 2**20)
        lines[2] = f"| memory per rank (rank 0) | {unit} |"
        lines += [f"| {name} | {value / scale:,.2f} |" for name, value in rows]
        verdict = "fits" if self.fits else f"does NOT fit: {(m.steady_peak - self.memory_capacity) / GIB:.2f} GiB over"
        lines += [f"\n{verdict}", "", "| mesh dim | op | group | link | calls | MiB per step | seconds | exposed |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {t.dim} | {t.op} | {t.group_size} | {t.link} | {t.calls} | {t.num_bytes / 2**20:,.3f} | "
                  f"{t.seconds:.4f} | {t.exposed_seconds:.4f} |" for t in self.traffic]
        lines += ["", f"step: {self.step_seconds:.3f} s = compute {self.compute_seconds:.3f} s "
                  f"({self.flops / 1e12:.1f} TFLOP) + optimizer {self.optimizer_seconds:.3f} s + exposed "
                  f"communication {self.comm_seconds:.3f} s; {self.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, "
                  f"MFU {self.mfu:.1%}",
                  f"planned in {self.plan_seconds:.1f} s", "assumptions:"]
        lines += [f"- {a}" for a in self.assumptions]
        return "\n".join(lines)
