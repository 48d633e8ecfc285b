"""The action tables of torch's pipeline schedules and their replay: which forwards each rank holds in flight, and
the step's makespan with given chunk times.

The tables are torch's own: ``pipeline_order`` of the schedule object the strategy builds (``Interleaved1F1B``,
``ZBVZeroBubble``, ``DualPipeV``: every rank's list of actions). ``Schedule1F1B`` runs its order in code (its
``pipeline_order`` is a drawing that numbers the last stage's micro-batches from 1), so 1F1B's is written out as its
``_step_microbatches`` runs it: ``min(M, P - stage)`` forwards, then a backward and a forward in turn, then the
remaining backwards. An action is ``(kind, stage, micro-batch)`` with ``kind`` in ``F`` (forward), ``B`` (full
backward), ``I`` (input gradient) and ``W`` (weight gradient); DualPipeV's overlapped ``F&B`` is its two actions one
after the other, started together (:func:`overlapped`: torch receives both inputs before the pair).

The replay: each rank runs its actions in order, each as soon as the rank is free and its inputs have arrived (the
previous stage's forward, the next stage's input gradient, plus the point-to-point transfer between ranks); it gives
the step's makespan and each rank's busy time. Costs: microseconds per action; no process group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KINDS = ("F", "B", "I", "W")
Action = tuple[str, int, int]


@dataclass(frozen=True)
class Replay:
    """The makespan of one step's actions (seconds) and each pipeline rank's busy seconds."""

    makespan: float
    busy: dict[int, float]

    @property
    def bubble(self) -> float:
        """The slowest rank's idle seconds: makespan minus its compute."""
        return self.makespan - max(self.busy.values())


def one_f_one_b(pp_size: int, num_microbatches: int) -> dict[int, list[Action]]:
    """1F1B's order per rank, as ``Schedule1F1B._step_microbatches`` runs it (see the module docstring)."""
    order = {}
    for rank in range(pp_size):
        warmup = min(num_microbatches, pp_size - rank)
        actions: list[Action] = [("F", rank, mb) for mb in range(warmup)]
        for mb in range(num_microbatches):
            actions.append(("B", rank, mb))
            if warmup + mb < num_microbatches:
                actions.append(("F", rank, warmup + mb))
        order[rank] = actions
    return order


def _parse(text: str) -> Action | None:
    """``"2F5"`` -> ``("F", 2, 5)``; None for the actions that are not compute (sends, receives, reductions)."""
    digits = 0
    while digits < len(text) and text[digits].isdigit():
        digits += 1
    end = digits
    while end < len(text) and not text[end].isdigit():
        end += 1
    kind = text[digits:end]
    if kind not in KINDS or not digits or end == len(text):
        return None
    return kind, int(text[:digits]), int(text[end:])


def torch_order(pipeline_order: Mapping[int, list[Any]]) -> dict[int, list[Action]]:
    """The compute actions of torch's ``pipeline_order`` per rank (overlapped pairs as their two actions)."""
    order: dict[int, list[Action]] = {}
    for rank, actions in pipeline_order.items():
        parsed: list[Action] = []
        for action in actions:
            if action is None:
                continue
            subs = getattr(action, "sub_actions", None) or (action,)
            parsed += [a for a in (_parse(str(sub)) for sub in subs) if a is not None]
        order[int(rank)] = parsed
    return order


def overlapped(pipeline_order: Mapping[int, list[Any]]) -> dict[Action, Action]:
    """DualPipeV's overlapped pairs in torch's table: the first action of each pair to its second."""
    pairs = {}
    for actions in pipeline_order.values():
        for action in actions:
            subs = [a for a in (_parse(str(sub)) for sub in getattr(action, "sub_actions", None) or ()) if a]
            if len(subs) == 2:
                pairs[subs[0]] = subs[1]
    return pairs


def schedule_order(schedule_name: str, schedule: Any, pp_size: int, num_microbatches: int
                   ) -> dict[int, list[Action]]:
    """Every rank's actions: torch's table from the schedule object, 1F1B's written out."""
    if schedule_name == "1F1B":
        return one_f_one_b(pp_size, num_microbatches)
    return torch_order(schedule.pipeline_order)


def held_forwards(actions: list[Action]) -> dict[int, int]:
    """The most micro-batches each stage of one rank holds between its forward and the backward that frees its
    activations (its full backward, or its weight gradient where the backward is split; DualPipeV splits some of a
    stage's backwards only)."""
    split = {stage for kind, stage, _ in actions if kind == "W"}
    held: dict[int, int] = {}
    most: dict[int, int] = {}
    for kind, stage, _ in actions:
        if kind == "F":
            held[stage] = held.get(stage, 0) + 1
            most[stage] = max(most.get(stage, 0), held[stage])
        elif kind in ("B", "W") or (kind == "I" and stage not in split):
            held[stage] -= 1
    return most


def replay(order: Mapping[int, list[Action]], stage_rank: Mapping[int, int], cost: Mapping[tuple[str, int], float],
           transfer: Mapping[tuple[str, int], float] | None = None,
           together: Mapping[Action, Action] | None = None) -> Replay:
    """Run ``order`` with ``cost[(kind, stage)]`` seconds per action and ``transfer[(kind, stage)]`` seconds for a
    forward's output (``"F"``) or an input gradient (``"I"``) to reach the neighbouring stage on another rank; the
    first action of a pair in ``together`` waits for its partner's inputs too (:func:`overlapped`)."""
    transfer, together = transfer or {}, together or {}
    last = max(stage_rank)
    done: dict[Action, float] = {}
    queues = {rank: list(actions) for rank, actions in order.items()}
    clock = dict.fromkeys(queues, 0.0)
    busy = dict.fromkeys(queues, 0.0)

    def arrival(kind: str, stage: int, mb: int, to_stage: int) -> tuple[Action, float]:
        delay = transfer.get((kind, stage), 0.0) if stage_rank[stage] != stage_rank[to_stage] else 0.0
        return (kind, stage, mb), delay

    def deps(kind: str, stage: int, mb: int) -> list[tuple[Action, float]]:
        if kind == "F":
            return [arrival("F", stage - 1, mb, stage)] if stage > 0 else []
        if kind in ("B", "I"):
            return [(("F", stage, mb), 0.0)] + ([arrival("I", stage + 1, mb, stage)] if stage < last else [])
        return [(("I", stage, mb), 0.0)]

    while any(queues.values()):
        progressed = False
        for rank, queue in queues.items():
            while queue:
                kind, stage, mb = queue[0]
                needed = deps(kind, stage, mb) + (deps(*together[queue[0]]) if queue[0] in together else [])
                if any(action not in done for action, _ in needed):
                    break
                start = max([clock[rank], *(done[action] + delay for action, delay in needed)])
                seconds = cost[kind, stage]
                clock[rank] = done[kind, stage, mb] = start + seconds
                if kind == "B":
                    done["I", stage, mb] = clock[rank]
                busy[rank] += seconds
                queue.pop(0)
                progressed = True
        if not progressed:
            heads = {rank: queue[0] for rank, queue in queues.items() if queue}
            raise RuntimeError(f"the action table does not progress with these dependencies: {heads}")
    return Replay(max(clock.values()), busy)
