"""The decision of the ``"auto"`` settings: the candidates, the memory filter and the margin rule.

A candidate is a tensor-parallel size ``tp``, an expert-parallel size ``ep``, a parameter-sharding size
``dp_shard`` (FSDP2; 1: off) and a gradient compression ``bits`` (None: fp32, 8 or 4). :func:`decide` drops the
candidates whose memory per rank does not fit, then keeps the simplest fitting one (plain DDP first: the smallest
``tp``, then ``ep``, then ``dp_shard``, then no compression) unless a timed one
is faster by ``margin`` or more; of those that are, the simplest within ``margin`` of the fastest, so that
sharding and compression each have to pay on their own. Where nothing was timed it keeps the simplest candidate
that fits, and its reason says so. Sharding and compressing change numerics and add code paths: they must pay
clearly.

Memory per rank: parameters and gradients, ``state_factor`` optimizer states per parameter byte (Adam: 2), each
``1/dp_shard`` under parameter sharding (a tp or ep shard over its shard ranks,
:meth:`~lightning_deepseek.parallel.dims.ParallelDims.shard_split`), the fp32 error-feedback residual of the
exchanged gradients when compressed, and the activations autograd saves for backward, against the budget the caller
gives (:data:`.auto_parallel.HEADROOM` of the device memory). Not counted: communication buffers (FSDP's gathered
blocks among them), the allocator's fragmentation, temporaries outside autograd. No process group is needed
here: the measurements come from :mod:`.measure` through :mod:`.auto_parallel`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

_GIB = 2**30


class NoCandidateFitsError(ValueError):
    """No candidate's parameters, gradients, optimizer states and activations fit the device memory."""


@dataclass(frozen=True)
class Candidate:
    """One layout: tensor-parallel size, expert-parallel size, compression bits (None: fp32), parameter-sharding
    size (1: parameters replicated)."""

    tp: int = 1
    ep: int = 1
    bits: int | None = None
    dp_shard: int = 1

    @property
    def label(self) -> str:
        shard = f" dp_shard={self.dp_shard}" if self.dp_shard > 1 else ""
        return f"tp={self.tp} ep={self.ep}{shard} {'fp32' if self.bits is None else f'int{self.bits}'}"

    @property
    def simplicity(self) -> tuple[int, int, int, int]:
        """Sort key: plain DDP first, then the least sharding, then the least compression."""
        return (self.tp, self.ep, self.dp_shard, 0 if self.bits is None else 16 - self.bits)

    def shard_of(self, model_parallel: int) -> int:
        """The ranks parameter sharding splits one shard of a model-parallel size over (as
        ``ParallelDims.shard_split``)."""
        return self.dp_shard // model_parallel if self.dp_shard % model_parallel == 0 else 1


@dataclass(frozen=True)
class ModelMemory:
    """What one rank of the model holds, for the memory filter.

    Args:
        replicated_bytes: ``{tp: bytes}``: the parameters a ``tp`` plan leaves whole (the experts' included).
        sharded_bytes: ``{tp: bytes}``: one rank's shards of the parameters the ``tp`` plan shards.
        expert_bytes: the routed experts' parameters (split ``ep`` ways).
        activation_bytes: the tensors autograd saves for backward in one micro-batch.
        state_factor: optimizer state bytes per parameter byte (Adam, AdamW: 2).
    """

    replicated_bytes: Mapping[int, int]
    sharded_bytes: Mapping[int, int] = field(default_factory=dict)
    expert_bytes: int = 0
    activation_bytes: int = 0
    state_factor: float = 2.0

    def exchanged_bytes(self, candidate: Candidate) -> int:
        """The gradient bytes DDP exchanges: what tensor and expert parallelism leave replicated."""
        experts = self.expert_bytes if candidate.ep > 1 else 0
        return self.replicated_bytes[candidate.tp] - experts

    def bytes_per_rank(self, candidate: Candidate) -> int:
        """Parameters, gradients, optimizer states, error-feedback residual and activations of one rank."""
        experts = self.expert_bytes // candidate.ep // candidate.shard_of(candidate.ep) if candidate.ep > 1 else 0
        params = (self.exchanged_bytes(candidate) // candidate.dp_shard + experts
                  + self.sharded_bytes.get(candidate.tp, 0) // candidate.shard_of(candidate.tp))
        residual = self.exchanged_bytes(candidate) if candidate.bits is not None else 0
        return int(params * (2 + self.state_factor) + residual + self.activation_bytes)


@dataclass(frozen=True)
class Entry:
    """One candidate's row of the decision: its memory per rank, whether it fits, and the median training step of
    its timed copy (None: not timed)."""

    candidate: Candidate
    memory_bytes: int
    fits: bool
    seconds: float | None = None

    def row(self, width: int = 16) -> str:
        step = "not timed" if self.seconds is None else f"{self.seconds * 1e3:.1f} ms"
        memory = (f"{self.memory_bytes / _GIB:.2f} GiB" if self.memory_bytes >= _GIB / 10 else
                  f"{self.memory_bytes / 2**20:.1f} MiB") + ("" if self.fits else " (does not fit)")
        return f"{self.candidate.label:<{width}} {step:>12}  {memory}"


@dataclass(frozen=True)
class Decision:
    """The chosen candidate, every candidate's entry (timed ones fastest first), and why.

    Args:
        tokens: rows per rank and micro-batch of the timed micro-batch (the strategy's placement reuses it).
        source: what was timed, for the printed table.
    """

    chosen: Candidate
    entries: tuple[Entry, ...]
    reason: str
    tokens: int | None = None
    source: str = ""

    def entry(self, candidate: Candidate) -> Entry:
        return next(e for e in self.entries if e.candidate == candidate)

    def table(self) -> str:
        """The lines printed at setup: every candidate's timed step and memory per rank; the choice."""
        width = max([16] + [len(e.candidate.label) for e in self.entries])
        lines = [f"{'candidate':<{width}} training step  memory per rank"]
        lines += [e.row(width) + ("  <- chosen" if e.candidate == self.chosen else "") for e in self.entries]
        lines.append(f"choice: {self.chosen.label}: {self.reason}")
        return "\n".join(lines)

    def summary(self) -> dict[str, object]:
        """Entries for the run summary (``autotune_predicted_ms``: each timed copy's step, None where untimed)."""
        return {"autotune_choice": self.chosen.label,
                "autotune_predicted_ms": {e.candidate.label: None if e.seconds is None else round(e.seconds * 1e3, 2)
                                          for e in self.entries},
                "autotune_reason": self.reason}


def candidates(world_size: int, tp_sizes: Iterable[int] = (1,), ep_sizes: Iterable[int] = (1,),
               bits: Iterable[int | None] = (None,), shard_sizes: Iterable[int] = (1,)) -> list[Candidate]:
    """Every combination whose sizes divide ``world_size`` and whose ``dp_shard`` divides or is divided by its
    ``tp`` and ``ep`` (``ParallelDims``' rule); with one data-parallel rank there is no exchange to compress, so such
    a ``tp`` comes uncompressed only, and so does parameter sharding (the copies compress DDP's exchange only)."""
    out: list[Candidate] = []
    for tp in tp_sizes:
        for ep in ep_sizes:
            for shard in shard_sizes:
                for b in bits:
                    compressible = world_size // max(tp, 1) > 1 and shard == 1
                    candidate = Candidate(tp, ep, b if compressible else None, shard)
                    cuts = shard > 1 and any(shard % m and m % shard for m in (tp, ep))
                    if not (world_size % tp or world_size % ep or world_size % shard or cuts or candidate in out):
                        out.append(candidate)
    return out


def fitting(options: Iterable[Candidate], memory: ModelMemory, budget_bytes: float, setting: str) -> list[Candidate]:
    """The memory filter: the candidates whose memory per rank fits ``budget_bytes``, simplest first.

    Raises:
        NoCandidateFitsError: none fits; the message names ``setting`` and the fixes.
    """
    options = sorted(options, key=lambda c: c.simplicity)
    if not options:
        raise ValueError(f"{setting}: there is no candidate to decide between.")
    fit = [c for c in options if memory.bytes_per_rank(c) <= budget_bytes]
    if not fit:
        smallest = min(options, key=memory.bytes_per_rank)
        raise NoCandidateFitsError(
            f"{setting}: no candidate fits the device memory: the smallest, {smallest.label}, needs "
            f"{memory.bytes_per_rank(smallest) / _GIB:.2f} GiB per rank (parameters, gradients, optimizer states x"
            f"{memory.state_factor:g}, activations {memory.activation_bytes / _GIB:.2f} GiB) against "
            f"{budget_bytes / _GIB:.2f} GiB usable. Train on more devices per node (a larger tensor_parallel_size), "
            "use a smaller micro-batch, shard the parameters (data_parallel_shard_size) or the optimizer states "
            "(shard_optimizer_states=True).")
    return fit


def choose(fit: Sequence[Candidate], seconds: Mapping[Candidate, float], margin: float = 0.05,
           untimed: str = "nothing timed") -> tuple[Candidate, str]:
    """The margin rule over the fitting candidates ``fit`` (simplest first) and their timed ``seconds``.

    The simplest keeps its place unless the fastest is timed ``margin`` or more faster; then the simplest of those
    within ``margin`` of the fastest. Where the simplest was not timed: the simplest, for ``untimed``'s reason.
    """
    simplest = fit[0]
    if simplest not in seconds:
        return simplest, f"the simplest layout that fits ({untimed})"
    timed = [c for c in fit if c in seconds]
    best = min(timed, key=seconds.__getitem__)
    if best == simplest or seconds[best] >= (1 - margin) * seconds[simplest]:
        return simplest, (f"nothing is timed {margin:.0%} or more faster" if len(timed) > 1
                          else "the only candidate")
    near = next(c for c in timed if (1 - margin) * seconds[c] <= seconds[best])
    reason = f"timed {seconds[simplest] / seconds[near]:.2f}x faster than {simplest.label}"
    if near != best:
        reason += f" (and within {margin:.0%} of the fastest, {best.label})"
    return near, reason


def decide(options: Sequence[Candidate], memory: ModelMemory, budget_bytes: float,
           seconds: Mapping[Candidate, float], setting: str, margin: float = 0.05, untimed: str = "nothing timed",
           tokens: int | None = None, source: str = "") -> Decision:
    """The memory filter and the margin rule (module docstring) over ``options`` and their timed ``seconds``.

    Args:
        budget_bytes: the memory one rank may plan for (``headroom`` of the device's).
        seconds: the median training step of each timed candidate's copy (empty: nothing timed).
        setting: the user's setting that asked for the decision, named in errors.
        untimed: why nothing was timed, for the reason where the simplest candidate was not.

    Raises:
        NoCandidateFitsError: no candidate fits ``budget_bytes``.
    """
    fit = fitting(options, memory, budget_bytes, setting)
    chosen, reason = choose(fit, seconds, margin, untimed)
    plain = min(options, key=lambda c: c.simplicity)
    if plain not in fit:
        reason = f"memory requires it ({plain.label} does not fit); {reason}"
    entries = sorted((Entry(c, memory.bytes_per_rank(c), c in fit, seconds.get(c)) for c in options),
                     key=lambda e: (not e.fits, e.seconds is None, e.seconds or 0.0, e.candidate.simplicity))
    return Decision(chosen, tuple(entries), reason, tokens, source)
