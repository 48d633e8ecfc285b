"""Representative layers: a deep model planned from shallow copies of it, three or four blocks of each kind.

A plan's cost grows with the ops its fake step runs (layers x ops per layer): DeepSeek-V3's 61 blocks at 2,048
ranks took minutes, most of it the same block's ops over and over. Every per-step quantity a plan measures is a sum
over blocks plus the rest of the model: the bytes of parameters, gradients and optimizer states, the FLOPs, the
collectives (each block's all-gathers, reduce-scatters, all-to-alls), the activations held at the end of forward.
So :func:`lightning_deepseek.planning.plan` steps, on the same fake world, a *base* copy that keeps the first three
blocks of each kind (same class and parameter shapes: DeepSeek-V3 has a dense and a MoE kind) and, per kind with
more, a copy with its fourth block too; the difference of the two is one more block of that kind, and the full model
is the base plus the missing blocks' differences.

Exact: the model states, the FLOPs, the bytes and calls per collective (DDP's buckets are cut again from the full
model's parameter sizes, DDP's rule). Approximate: the peak, extrapolated per phase (forward, backward, optimizer
step: the largest of the three at the full depth) and ZeRO-1's most loaded rank; both are measured against full
plans in benchmarks/planning/REPORT.md. A model whose blocks do not repeat (or whose copies would be as deep) is
planned whole. Blocks are the strategy's own (``find_transformer_blocks``); a copy keeps their original attributes
(HF's ``layer_idx``), and HF models run the blocks their list holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import nn

from lightning_deepseek.parallel.activation_checkpointing import find_transformer_blocks
from lightning_deepseek.planning.counting import CollectiveCall
from lightning_deepseek.planning.estimate import StepMeasurement
from lightning_deepseek.planning.report import RankMemory

DEPTHS = ("representative", "full")
# Blocks of each kind in the base copy: with fewer, one more block also moves where backward peaks (FSDP2 with
# full checkpointing: +300, +266, then +100 KB per block of lds-tiny, from the fourth block on)
BASE_BLOCKS = 3


@dataclass(frozen=True)
class LayerKinds:
    """The kind (index of its first appearance) of each transformer block of a model, in order."""

    kinds: tuple[int, ...]

    @property
    def counts(self) -> dict[int, int]:
        return dict(Counter(self.kinds))

    def _first(self, kind: int, n: int) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == kind][:n]

    @property
    def base(self) -> tuple[int, ...]:
        """The first ``BASE_BLOCKS`` blocks of each kind: the base copy's blocks."""
        return tuple(sorted(i for kind in self.counts for i in self._first(kind, BASE_BLOCKS)))

    def in_base(self, kind: int) -> int:
        return min(self.counts[kind], BASE_BLOCKS)

    def with_one_more(self, kind: int) -> tuple[int, ...]:
        """The base copy's blocks and the next block of ``kind``."""
        return tuple(sorted({*self.base, *self._first(kind, BASE_BLOCKS + 1)}))

    @property
    def extended(self) -> list[int]:
        """The kinds with more blocks than the base holds."""
        return [kind for kind, n in self.counts.items() if n > BASE_BLOCKS]

    @property
    def worth_it(self) -> bool:
        """Whether the copies are shallower than the model (else it is planned whole)."""
        return bool(self.extended) and len(self.base) + 1 < len(self.kinds)


def layer_kinds(module: nn.Module) -> LayerKinds:
    """Each block's kind: blocks with the same class and parameter names, shapes and dtypes are one kind."""
    modules = dict(module.named_modules())
    signatures: list[tuple] = []
    kinds = []
    for name in find_transformer_blocks(module):
        block = modules[name]
        signature = (type(block).__name__,
                     tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()))
        if signature not in signatures:
            signatures.append(signature)
        kinds.append(signatures.index(signature))
    return LayerKinds(tuple(kinds))


def keep_blocks(module: nn.Module, keep: tuple[int, ...]) -> dict[str, int]:
    """Remove every transformer block of ``module`` but those at positions ``keep`` (in place); returns the position
    of each kept block's parameters in the copy, by parameter name."""
    modules = dict(module.named_modules())
    names = find_transformer_blocks(module)
    kept = {names[i] for i in keep}
    for parent_name in dict.fromkeys(name.rpartition(".")[0] for name in names):
        children = [child for child_name, child in modules[parent_name].named_children()
                    if f"{parent_name}.{child_name}" not in names or f"{parent_name}.{child_name}" in kept]
        grand, _, attribute = parent_name.rpartition(".")
        setattr(modules[grand] if grand else module, attribute, nn.ModuleList(children))
    position = {id(p): i for i, name in enumerate(n for n in names if n in kept)
                for p in modules[name].parameters()}
    return {name: position[id(p)] for name, p in module.named_parameters() if id(p) in position}


def full_sizes(sizes: list[tuple[int, int]], kinds: LayerKinds) -> list[int]:
    """The full model's parameter sizes in order, from the base copy's ``(block position, bytes)`` pairs: the last
    base block of each kind repeated for the blocks the base lacks (kinds in contiguous runs keep DDP's order)."""
    last = {kinds.kinds[block]: position for position, block in enumerate(kinds.base)}
    repeats = {position: kinds.counts[kind] - kinds.in_base(kind) + 1 for kind, position in last.items()}
    out: list[int] = []
    run: list[int] = []
    current = -1
    for position, size in [*sizes, (-2, 0)]:
        if position != current and run:
            out += run * repeats.get(current, 1)
            run = []
        current = position
        run.append(size)
    return out


def extrapolate(base: StepMeasurement, extras: dict[int, StepMeasurement], kinds: LayerKinds) -> StepMeasurement:
    """The full model's measurement from the base copy's and, per kind with more blocks, the copy with one more
    block of it: each quantity the base's plus the missing blocks times the difference. Collectives by (op, group,
    phase): their calls and bytes so (each call then carries their mean). The peak: the largest of the phases'."""
    missing = {kind: kinds.counts[kind] - kinds.in_base(kind) for kind in extras}

    def scaled(value: Callable[[StepMeasurement], float]) -> float:
        return value(base) + sum(missing[kind] * (value(extra) - value(base)) for kind, extra in extras.items())

    memory = RankMemory(**{name: int(scaled(lambda m, name=name: getattr(m.memory, name)))
                           for name in vars(base.memory)})
    peaks = tuple(int(scaled(lambda m, i=i: m.phase_peaks[i])) for i in range(len(base.phase_peaks)))
    calls = scale_calls(base.calls, [(missing[kind], extra.calls, base.calls) for kind, extra in extras.items()])
    return replace(base, memory=replace(memory, peak=max(peaks)), phase_peaks=peaks, calls=calls,
                   flops=scaled(lambda m: m.flops), fp8_flops=scaled(lambda m: m.fp8_flops),
                   cast_bytes=round(scaled(lambda m: m.cast_bytes)),
                   owned_state_elements=round(scaled(lambda m: m.owned_state_elements)),
                   num_sharded_layers=round(scaled(lambda m: m.num_sharded_layers)),
                   buffer_bytes=round(scaled(lambda m: m.buffer_bytes)))


Calls = tuple[CollectiveCall, ...]


def scale_calls(base: Calls, terms: list[tuple[float, Calls, Calls]]) -> Calls:
    """Collectives by (op, group, phase), in order of first appearance: the base's calls and bytes plus, per term
    ``(weight, plus, minus)``, ``weight`` times the difference of ``plus``'s and ``minus``'s; each call then carries
    their mean."""
    keys = dict.fromkeys((c.op, c.group, c.phase) for calls in (base, *(t[1] for t in terms)) for c in calls)
    out = []
    for op, group, phase in keys:
        def of(calls: tuple[CollectiveCall, ...], op: str = op, group: str = group, phase: str = phase) -> list[int]:
            return [c.num_bytes for c in calls if (c.op, c.group, c.phase) == (op, group, phase)]

        def scaled(value: Callable[[list[int]], int]) -> int:
            return round(value(of(base)) + sum(weight * (value(of(plus)) - value(of(minus)))
                                               for weight, plus, minus in terms))
        num_calls, num_bytes = scaled(len), scaled(sum)
        out += [CollectiveCall(op, group, num_bytes // num_calls + (i < num_bytes % num_calls), phase)
                for i in range(num_calls)]
    return tuple(out)


def check_depth(depth: str) -> None:
    """Raise ``ValueError`` unless ``depth`` is one of :data:`DEPTHS`."""
    if depth not in DEPTHS:
        raise ValueError(f"depth={depth!r} must be one of {DEPTHS} ('full' steps every block: exact, slower).")
