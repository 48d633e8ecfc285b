"""``PipelinePeaks``: a lower bound of a pipelined layout's planned peak from the model, the strategy's split and
torch's action table alone, before any copy of a stage is stepped, so that ``layout="auto"`` skips a layout that
cannot fit.

A pipelined plan (:mod:`.pipeline_estimate`) holds on each pipeline rank, at its peak, its parameters, optimizer
states and torch's receive buffers, and the most its actions hold at once: each forward adds one micro-batch's
activations of its stage, a stage's first backward adds what it leaves (its gradients), and a backward (or a weight
gradient where the backward is split) frees that micro-batch's activations. The bound walks the same actions with
lower bounds of each term:

- parameters: every parameter of the rank's stages split over ``tp x dp_shard`` (the routed experts also over
  ``ep``), as many bytes as the model's; AdamW's two moments as much again each, none with ZeRO-1 (rank 0 may own
  few); gradients as much as the parameters, from a stage's first backward on; with FSDP2, unsharded over
  ``dp_shard`` (torch's stages turn FSDP2's gradient reduction off until the step's last backward, so each
  backward accumulates whole gradients), at 2 bytes under FSDP2's BF16 policy;
- activations: a micro-batch's block inputs, ``blocks - 1`` hidden states of ``micro_batch_size x seq_len`` (``/ tp``
  with sequence parallelism) x hidden size at 2 bytes (each block keeps its input for backward, under any
  checkpointing; the residual stream is at least BF16);
- buffers: the ``num_microbatches`` input buffers torch allocates per stage (the planner's, in the parameters'
  dtype) and output buffers at 2 bytes.

A layout is skipped when the largest rank's bound exceeds the device: its plan's peak, the largest rank's, is at
least that (``tests/planning/test_pipeline_bound.py`` checks the bound below the plan under every schedule). Costs:
the model built once on the meta device, one split per (``pp``, schedule) and one action table per (``pp``,
schedule, micro-batches); no step.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_deepseek.moe.protocol import find_expert_layers
from lightning_deepseek.parallel.activation_checkpointing import find_transformer_blocks
from lightning_deepseek.parallel.pipeline_split import PipelineSplit, plan_pipeline_split
from lightning_deepseek.planning.layout import PlanLayout, StepShape
from lightning_deepseek.planning.models import ModelSpec
from lightning_deepseek.planning.pipeline import action_table, built_model, hidden_size_of

LEAST_HIDDEN_BYTES = 2  # a residual stream element: BF16 at least


@dataclass(frozen=True)
class _Stage:
    blocks: int
    dense: int  # trainable elements but the routed experts'
    experts: int  # trainable elements of routed experts


class PipelinePeaks:
    """Lower bounds of pipelined layouts' peaks for ``model`` at ``world_size`` and ``step`` (see the module
    docstring)."""

    def __init__(self, model: ModelSpec, world_size: int, step: StepShape) -> None:
        self.world_size, self.step = world_size, step
        module = built_model(model, step)
        self._hidden = hidden_size_of(module)
        self._blocks = set(find_transformer_blocks(module))
        experts = {id(p) for layer in find_expert_layers(module) for p in layer.experts.parameters()}
        trainable = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._element = min((p.element_size() for _, p in trainable), default=4)
        self._params = [(name, p.numel(), id(p) in experts) for name, p in trainable]
        self._module = module
        self._splits: dict[tuple[int, str], tuple[PipelineSplit, list[_Stage]]] = {}
        self._tables: dict[tuple[int, str, int], dict[int, list[tuple[str, int, int]]]] = {}

    def least_peak(self, layout: PlanLayout) -> int:
        """Bytes the largest pipeline rank of ``layout`` holds at least at its peak (see the module docstring)."""
        split_key = (layout.pp, layout.pp_schedule)
        if split_key not in self._splits:
            split = plan_pipeline_split(self._module, layout.pp, layout.pp_schedule)
            self._splits[split_key] = split, self._stages_of(split)
        split, stages = self._splits[split_key]
        key = (layout.pp, layout.pp_schedule, layout.num_microbatches)
        if key not in self._tables:
            self._tables[key] = action_table(self.world_size, layout, split)[0]
        return max(self._rank_bound(layout, stages, actions) for actions in self._tables[key].values())

    def _stages_of(self, split: PipelineSplit) -> list[_Stage]:
        """Each stage's blocks and trainable elements (dense, routed experts), by stage index."""
        owner = {module: spec.index for spec in split.stages for module in spec.modules}
        dense, experts = [0] * split.num_stages, [0] * split.num_stages
        for name, numel, expert in self._params:
            parts = name.split(".")
            index = next((owner[prefix] for k in range(len(parts) - 1, 0, -1)
                          if (prefix := ".".join(parts[:k])) in owner), None)
            if index is not None:
                (experts if expert else dense)[index] += numel
        blocks = [sum(1 for module in spec.modules if module in self._blocks) for spec in
                  sorted(split.stages, key=lambda spec: spec.index)]
        return [_Stage(b, d, e) for b, d, e in zip(blocks, dense, experts)]

    def _rank_bound(self, layout: PlanLayout, stages: list[_Stage], actions: list[tuple[str, int, int]]) -> int:
        tokens = self.step.micro_batch_size * (self.step.seq_len // layout.tp if layout.sequence_parallel
                                               else self.step.seq_len)
        hidden = tokens * self._hidden
        def split(index: int, shards: int, element: int) -> int:
            return element * (stages[index].dense // (layout.tp * shards)
                              + stages[index].experts // (layout.ep * layout.tp * shards))

        params = {index: split(index, layout.dp_shard, self._element) for _, index, _ in actions}
        grads = {index: split(index, 1, 2 if self.step.fsdp_bf16 else self._element) if layout.dp_shard > 1
                 else params[index] for index in params}
        activations = {index: max(stages[index].blocks - 1, 0) * hidden * LEAST_HIDDEN_BYTES for index in params}
        residual = 2 if self.step.fsdp_bf16 and layout.dp_shard > 1 else 4  # the planner's input buffers' dtype
        last = len(stages) - 1
        buffers = layout.num_microbatches * sum((residual * hidden if index > 0 else 0)
                                                + (LEAST_HIDDEN_BYTES * hidden if index < last else 0)
                                                for index in params)
        split_backward = {index for kind, index, _ in actions if kind == "W"}
        held = most = 0
        backwarded: set[int] = set()
        for kind, index, _ in actions:
            if kind in ("F", "B", "I"):
                most = max(most, held)
            if kind == "F":
                held += activations[index]
            if kind in ("B", "I") and index not in backwarded:
                backwarded.add(index)
                held += grads[index]
            if kind in ("B", "W") or (kind == "I" and index not in split_backward):
                held -= activations[index]
        states = 0 if layout.shard_optimizer_states else 2 * sum(params.values())
        return sum(params.values()) + states + buffers + most

