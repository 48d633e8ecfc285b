"""``layout="auto"``'s shared cache and pruning (:mod:`lightning_deepseek.planning.cache`, :func:`.search.search`):
a search with a shared cache gives every layout the plan a fresh cache gives it (equal numbers); a layout pruned by
its model states would not have fit, one pruned by its compute would not have ranked among the ``top`` fastest; the
cached norm probes of block detection find the blocks the uncached ones do.
"""

from __future__ import annotations

import dataclasses

import pytest
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_deepseek.parallel.detection import cached_probes
from lightning_deepseek.parallel.plan import plan_blocks
from lightning_deepseek.planning import PlanLayout, pipeline, plan
from lightning_deepseek.planning.bounds import LayoutBounds, ParameterShards, _compute_key, _flops_key, _least_seconds
from lightning_deepseek.planning.cache import PlanCache
from lightning_deepseek.planning.cluster import ClusterSpec
from lightning_deepseek.planning.report import PlanReport
from lightning_deepseek.planning.search import SearchResult, search
from tests.planning.test_against_real_runs import CLUSTER, LLAMA, MOE
from tests.planning.test_against_real_runs import DEEP as TINY_4
from tests.planning.test_depth import DEEP, DENSE, MIXED, STEP

LAYOUTS = [PlanLayout(shard_optimizer_states=True), PlanLayout(shard_optimizer_states=True,
                                                               activation_checkpointing="full"),
           PlanLayout(), PlanLayout(tp=2, shard_optimizer_states=True), PlanLayout(dp_shard=4,
                                                                                   activation_checkpointing="full"),
           PlanLayout(tp=2, dp_shard=2)]


# CLUSTER's compute, links and memory so fast that a step is about its compute: a layout under full checkpointing is
# slower than the fastest one without it by its recomputation alone.
LINK = {"bandwidth_gbs": 1e6, "latency_us": 0}
FAST = ClusterSpec.from_mapping(dict(name="fast", gpus_per_node=2, peak_tflops={"fp32": 0.05}, memory_gib=16,
                                     memory_bandwidth_gbs=1e6, links={"intra": LINK, "inter": LINK}), "test")


def _numbers(report: PlanReport) -> PlanReport:
    return dataclasses.replace(report, plan_seconds=0.0)


def _states(report: PlanReport) -> int:
    m = report.memory
    return m.params + m.grads + m.states + m.ddp_buckets


@pytest.fixture(scope="module")
def uncached() -> SearchResult:
    return search(DENSE, 4, CLUSTER, STEP, LAYOUTS, cache=False)


def test_shared_cache_equals_fresh_plans(uncached: SearchResult) -> None:
    cached = search(DENSE, 4, CLUSTER, STEP, LAYOUTS)
    assert not cached.pruned and not uncached.rejected and len(uncached.fitting) == len(LAYOUTS)
    assert [_numbers(r) for r in cached.fitting] == [_numbers(r) for r in uncached.fitting]


def test_pruned_layouts_would_not_fit(uncached: SearchResult) -> None:
    zero1 = next(r for r in uncached.fitting if r.layout == LAYOUTS[0])
    capacity = _states(zero1) - 1  # ZeRO-1's model states alone exceed it: so do ac=full's and plain DDP's
    small = dataclasses.replace(CLUSTER, memory_gib=capacity / 2**30)
    assert small.memory_bytes == capacity
    cached = search(DENSE, 4, small, STEP, LAYOUTS[:3])  # ZeRO-1 ac=full planned first (planning_order)
    assert [layout for layout, _ in cached.pruned] == [LAYOUTS[0], LAYOUTS[2]]
    assert all("model states alone" in why and "exceed" in why for _, why in cached.pruned)
    by_layout = {r.layout: r for r in uncached.fitting}
    assert all(by_layout[layout].memory.steady_peak > capacity for layout, _ in cached.pruned)
    expected = sorted((r for r in uncached.fitting if r.memory.steady_peak <= capacity and r.layout in LAYOUTS[:3]),
                      key=lambda r: -r.tokens_per_second_per_gpu)
    assert [_numbers(dataclasses.replace(r, memory_capacity=capacity)) for r in expected] == [
        _numbers(r) for r in cached.fitting]


def test_least_states_bound_the_planned_states(uncached: SearchResult) -> None:
    shards = ParameterShards.of(DENSE, 4, STEP, (1, 2))
    for report in uncached.fitting:
        least = shards.least_states(report.layout)
        assert least is not None and 0.5 * _states(report) < least <= _states(report), report.layout


def test_compute_depends_on_no_sharding(uncached: SearchResult) -> None:
    """What pruning by compute assumes: layouts that differ only in how they shard the model states compute alike
    and send the same tensor-parallel collectives; checkpointing only adds compute."""
    by_key: dict[tuple, dict[str, set[float]]] = {}
    for report in uncached.fitting:
        by_key.setdefault(_compute_key(report.layout), {}).setdefault(report.layout.activation_checkpointing,
                                                                     set()).add(_least_seconds(report))
    tp2 = by_key[_compute_key(PlanLayout(tp=2))]["none"]
    assert len(tp2) == 1 and min(tp2) > min(by_key[_compute_key(PlanLayout())]["none"])  # ZeRO-1 and FSDP2 alike
    assert all(len(seconds) == 1 for modes in by_key.values() for seconds in modes.values())
    tp1 = by_key[_compute_key(PlanLayout())]
    assert len(tp1["full"]) == 1 and min(tp1["full"]) > max(tp1["none"])


@pytest.mark.parametrize("model, world_size, layout", [
    (MOE, 4, PlanLayout(pp=2, ep=2)),
    (LLAMA, 8, PlanLayout(pp=2, tp=2, sequence_parallel=True, loss_parallel=True))], ids=["ep", "tp-sp"])
def test_pipelined_layouts_differing_in_sharding_share_compute_and_parallel_collectives(
        model: object, world_size: int, layout: PlanLayout) -> None:
    """What pruning a pipelined layout by a sibling assumes: unsharded, ZeRO-1 and FSDP2 over the stages' ``dp``
    replay the same compute and bubble and send the same tp and ep collectives on their least loaded rank, and each
    step is at least that bound (which holds more than the compute and bubble: the collectives cost)."""
    layouts = [layout, dataclasses.replace(layout, shard_optimizer_states=True),
               dataclasses.replace(layout, dp_shard=2)]
    reports = [plan(model, world_size, lay, CLUSTER, STEP) for lay in layouts]
    bounds = {_least_seconds(report, layouts[0]) for report in reports}
    assert len(bounds) == 1
    assert all(r.pipeline.least_parallel_seconds > 0 for r in reports)
    assert all(r.pipeline.makespan - r.pipeline.p2p_exposed_seconds < min(bounds) <= r.step_seconds for r in reports)


def test_compute_depends_on_neither_experts_nor_sharding_nor_compression() -> None:
    """What the bound by the compute of any layout of the same ``tp`` assumes (pp=1): a rank's FLOPs are the same
    whatever the expert-parallel size (uniform routing), the sharding and the compression."""
    layouts = [PlanLayout(tp=tp, ep=ep, **kw) for tp in (1, 2) for ep, kw in (
        (1, {}), (2, {"shard_optimizer_states": True}), (4, {"dp_shard": 4}), (4, {"bits": 8}))]
    result = search(MOE, 8, CLUSTER, STEP, layouts)
    assert len(result.fitting) == len(layouts)
    for tp in (1, 2):
        assert len({r.compute_seconds for r in result.fitting if r.layout.tp == tp}) == 1


def test_recomputing_more_never_shortens_a_step_nor_raises_the_peak() -> None:
    """What the bound by the same layout's step under less recomputation assumes: its compute and repeated forward
    collectives grow, and the data-parallel collectives it hides shrink by less; and the bound by its peak under
    more recomputation: fewer activations are kept."""
    layouts = [PlanLayout(), PlanLayout(tp=2, shard_optimizer_states=True), PlanLayout(dp_shard=4), PlanLayout(pp=2),
               PlanLayout(ep=2, bits=8)]
    result = search(MOE, 4, CLUSTER, STEP, [dataclasses.replace(layout, activation_checkpointing=mode)
                                            for layout in layouts for mode in ("none", "selective", "full")])
    steps = {r.layout: r.step_seconds for r in result.fitting}
    peaks = {r.layout: r.memory.steady_peak for r in result.fitting}
    assert len(steps) == 3 * len(layouts)
    for layout in layouts:
        none, selective, full = (steps[dataclasses.replace(layout, activation_checkpointing=mode)]
                                 for mode in ("none", "selective", "full"))
        assert none <= selective * (1 + 1e-12) and selective <= full * (1 + 1e-12), layout  # equal where FSDP2's
        # collectives are longer than the compute: they hide what recomputation adds
        none, selective, full = (peaks[dataclasses.replace(layout, activation_checkpointing=mode)]
                                 for mode in ("none", "selective", "full"))
        assert none >= selective >= full, layout


def test_layouts_pruned_by_a_heavier_mode_would_not_fit(uncached: SearchResult) -> None:
    """Full checkpointing is planned first: where it does not fit, recomputing less keeps more activations."""
    full = next(r for r in uncached.fitting if r.layout == LAYOUTS[1])  # ZeRO-1, ac=full
    capacity = full.memory.steady_peak - 1
    assert _states(full) < capacity  # the model states alone would fit: the activations do not
    small = dataclasses.replace(CLUSTER, memory_gib=capacity / 2**30)
    cached = search(DENSE, 4, small, STEP, LAYOUTS[:2])
    assert cached.pruned == ((LAYOUTS[0], cached.pruned[0][1]),) and not cached.fitting
    assert "peak at least" in cached.pruned[0][1] and "which recomputes more" in cached.pruned[0][1]
    assert next(r for r in uncached.fitting if r.layout == LAYOUTS[0]).memory.steady_peak > capacity


def test_layouts_pruned_by_compute_would_not_rank() -> None:
    selective = [dataclasses.replace(layout, activation_checkpointing="selective") for layout in LAYOUTS[0:5:4]]
    layouts = [LAYOUTS[0], *selective]  # ZeRO-1; ZeRO-1 and FSDP2 under selective checkpointing
    uncached = {r.layout: r for r in search(DENSE, 4, FAST, STEP, layouts, cache=False).fitting}
    cached = search(DENSE, 4, FAST, STEP, layouts, top=1)
    assert [layout for layout, _ in cached.pruned] == [selective[1]]
    assert [r.compute_seconds for r in cached.fitting] == [uncached[lay].compute_seconds for lay in layouts[:2]]
    assert uncached[selective[1]].compute_seconds > cached.fitting[0].step_seconds  # so is its step time
    assert "compute and exposed tp / ep collectives alone at least" in cached.pruned[0][1]


def test_layouts_rank_by_tokens_per_second_not_step_time() -> None:
    """A stage's tp ranks share its micro-batches (the strategy's tp ranks without a pipeline each hold their own):
    pp=2 x tp=2's step holds half the tokens per GPU of the others', and is the shortest, not the fastest."""
    layouts = [PlanLayout(tp=2), PlanLayout(tp=2, pp=2), PlanLayout(), PlanLayout(pp=2)]
    result = search(DENSE, 4, CLUSTER, STEP, layouts)
    rates = [r.tokens_per_second_per_gpu for r in result.fitting]
    assert len(rates) == 4 and rates == sorted(rates, reverse=True)
    by_layout = {r.layout: r for r in result.fitting}
    tokens = {layout: r.tokens_per_second_per_gpu * r.step_seconds for layout, r in by_layout.items()}
    assert tokens[layouts[1]] == pytest.approx(STEP.tokens / 2)
    assert all(tokens[layout] == pytest.approx(STEP.tokens) for layout in (layouts[0], *layouts[2:]))
    assert min(by_layout.values(), key=lambda r: r.step_seconds).layout == layouts[1] != result.fitting[0].layout


def test_cached_probes_find_the_same_blocks() -> None:
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = MIXED.build()
    with cached_probes():
        cached = plan_blocks(model)
    assert cached == plan_blocks(model) and cached


def test_pipelined_plans_share_copies_and_equal_fresh_plans() -> None:
    """Pipelined layouts (:mod:`lightning_deepseek.planning.stage_depth`): the V schedules share their stepped copies
    (the same split and stages per rank), and each plan equals the one a fresh cache gives."""
    layouts = [PlanLayout(pp=2, pp_schedule="ZBVZeroBubble", reshard_after_forward=False),
               PlanLayout(pp=2, pp_schedule="DualPipeV", reshard_after_forward=False)]
    fresh = {r.layout: r for r in search(DEEP, 4, FAST, STEP, layouts, cache=False).fitting}
    shared = PlanCache()
    zbv = plan(DEEP, 4, layouts[0], FAST, STEP, cache=shared)
    before = shared.misses
    dual = plan(DEEP, 4, layouts[1], FAST, STEP, cache=shared)
    assert shared.misses - before == 2  # DualPipeV's split and action table: every stepped copy shared
    assert [_numbers(zbv), _numbers(dual)] == [_numbers(fresh[layout]) for layout in layouts[:2]]


def test_copies_without_fsdp2_are_shared_across_pipeline_sizes_and_equal_fresh_plans(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without FSDP2 or ZeRO-1 a stage's stepped copy measures the same at any ``pp``
    (:func:`lightning_deepseek.planning.pipeline.across_pp`): at 8 ranks, pp=4 (dp=2) after pp=2 (dp=4) steps only
    its middle ranks' copy (pp=2 has no middle rank), and its plan equals a fresh one, calls on its own groups."""
    layouts = [PlanLayout(pp=2), PlanLayout(pp=4)]
    fresh = plan(DEEP, 8, layouts[1], FAST, STEP)
    shared = PlanCache()
    plan(DEEP, 8, layouts[0], FAST, STEP, cache=shared)
    stepped: list[int] = []
    original = pipeline._stepped

    def counted(*args: object, **kwargs: object) -> object:
        stepped.append(args[5])  # the pipeline rank
        return original(*args, **kwargs)

    monkeypatch.setattr(pipeline, "_stepped", counted)
    assert _numbers(plan(DEEP, 8, layouts[1], FAST, STEP, cache=shared)) == _numbers(fresh)
    assert stepped == [1]
    assert not pipeline.across_pp(PlanLayout(pp=4, dp_shard=2)) and not pipeline.across_pp(
        PlanLayout(pp=4, shard_optimizer_states=True))


def test_the_v_schedules_bound_neither_other_schedules_compute_nor_their_lighter_checkpointing() -> None:
    """The V schedules' split backward recomputes a checkpointed forward again and keeps it from its input part to its
    weight part: their compute bounds no other schedule's, and where their full checkpointing does not fit, less
    recomputation may (on ``tiny-4`` its real peak is 10% above none's)."""
    zbv = PlanLayout(pp=2, pp_schedule="ZBVZeroBubble", activation_checkpointing="full", reshard_after_forward=False)
    one = PlanLayout(pp=2, activation_checkpointing="full")
    assert _flops_key(zbv) != _flops_key(one) == _flops_key(dataclasses.replace(one, pp_schedule="Interleaved1F1B"))
    bounds = LayoutBounds(2, 2**40, ParameterShards.of(TINY_4, 2, STEP, (1,)), None)
    for layout in (zbv, one):  # each planned and, as if over the device, not fitting
        bounds.add(dataclasses.replace(plan(TINY_4, 2, layout, CLUSTER, STEP), memory_capacity=1))
    assert bounds.why_not(dataclasses.replace(zbv, activation_checkpointing="none")) is None
    assert "recomputes more" in bounds.why_not(dataclasses.replace(one, activation_checkpointing="none"))
