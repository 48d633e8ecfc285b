"""The compressed exchange on real gloo processes: error bound, error feedback, byte count, DDP, non-finite."""

from __future__ import annotations

import copy
import math
import os
import shutil
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_deepseek.compression import CompressionConfig, CompressionState, native
from lightning_deepseek.compression.hook import _exchange_group, compressed_average, register_compression_hook
from lightning_deepseek.compression.quantize import qmax
from lightning_deepseek.compression.state import compressed_bytes, fp32_allreduce_bytes
from tests.helpers import run_distributed

_EXCHANGE_GROUPS: list[dist.ProcessGroup] = []


def _state(bits: int, block_size: int, error_feedback: bool = True) -> CompressionState:
    cfg = CompressionConfig(bits=bits, block_size=block_size, error_feedback=error_feedback, warmup_steps=0)
    if not _EXCHANGE_GROUPS:  # one per process: creating gloo groups dominates these small exchanges
        _EXCHANGE_GROUPS.append(_exchange_group(dist.group.WORLD))
    return CompressionState(cfg, dist.group.WORLD, _EXCHANGE_GROUPS[0])


def _exchange(state: CompressionState, grad: torch.Tensor) -> torch.Tensor:
    state.begin_step()
    out = grad.clone()
    compressed_average(state, [out], ["g"], out).wait()
    state.end_step()
    return out


def _all_grads(ws: int, numel: int) -> torch.Tensor:
    """Every rank's gradient (each rank builds all of them): values of widely different magnitudes."""
    gen = torch.Generator().manual_seed(7)
    magnitude = torch.logspace(-3, 2, numel)[torch.randperm(numel, generator=gen)]
    return torch.randn(ws, numel, generator=gen) * magnitude


def _padded_blocks(x: torch.Tensor, ws: int, block_size: int) -> torch.Tensor:
    padded = math.ceil(x.shape[-1] / (ws * block_size)) * ws * block_size
    return torch.nn.functional.pad(x, (0, padded - x.shape[-1])).view(*x.shape[:-1], -1, block_size)


def _one_step_bound(grads: torch.Tensor, ws: int, bits: int, block_size: int) -> torch.Tensor:
    """Per-element bound of |compressed average - exact average| for round-to-nearest, no residual.

    Phase 1 errs by at most half a step of each rank's block (averaged over ranks); phase 2 by half a step of
    the block of the averaged value, whose absmax is at most the exact one plus the phase-1 error.
    """
    absmax = _padded_blocks(grads, ws, block_size).abs().amax(-1)  # (ws, blocks)
    phase1 = 0.5 * absmax.mean(0) / qmax(bits)
    exact = _padded_blocks(grads.mean(0), ws, block_size).abs().amax(-1)
    phase2 = 0.5 * (exact + phase1) / qmax(bits)
    bound = (phase1 + phase2) * (1 + 2**-6)  # bfloat16 scale rounding
    return bound.repeat_interleave(block_size)[: grads.shape[-1]]


def _check_exchange(rank: int, ws: int) -> dict:
    out = {}
    for bits, block_size, numel in [(8, 128, 5000), (4, 64, 3001), (8, 64, 77)]:
        state = _state(bits, block_size, error_feedback=False)
        grads = _all_grads(ws, numel)
        got = _exchange(state, grads[rank])
        exact = grads.mean(0)
        bound = _one_step_bound(grads, ws, bits, block_size)
        gathered = [torch.empty_like(got) for _ in range(ws)]
        dist.all_gather(gathered, got)
        out[(bits, block_size, numel)] = {
            "within_bound": bool(((got - exact).abs() <= bound).all()),
            "nonzero_error": bool((got - exact).abs().max() > 0),
            "replicas_equal": all(torch.equal(g, got) for g in gathered),
            "bytes_sent": state.bytes_sent, "bytes_fp32": state.bytes_fp32,
            "rel_error": float((got - exact).norm() / exact.norm()),
            "single": [plan.single for plan in state.plans.values()],
        }
    return out


def _run_steps(ddp: DistributedDataParallel, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * step + rank))
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()


def _check_resume(rank: int, ws: int) -> dict:
    """Save hook state + model + optimizer after 4 steps into fresh objects; the next 4 steps must match."""
    def fresh() -> tuple[DistributedDataParallel, CompressionState, torch.optim.Optimizer]:
        torch.manual_seed(0)
        # One bucket (the default cap): DDP's rebuild after the first iteration then only reorders parameters
        # inside it, which the hook undoes, so the fresh module quantizes exactly like the uninterrupted one.
        ddp = DistributedDataParallel(_Net())
        state = register_compression_hook(ddp, bits=4, block_size=32, warmup_steps=1, min_bucket_numel=256,
                                          stochastic_rounding=True, seed=3)
        return ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    ddp, state, opt = fresh()
    _run_steps(ddp, opt, rank, range(4))
    saved = copy.deepcopy((state.state_dict(), ddp.state_dict(), opt.state_dict()))
    _run_steps(ddp, opt, rank, range(4, 8))
    ddp2, state2, opt2 = fresh()
    state2.load_state_dict(saved[0], torch.device("cpu"))
    ddp2.load_state_dict(saved[1])
    opt2.load_state_dict(saved[2])
    _run_steps(ddp2, opt2, rank, range(4, 8))
    return {"max_diff": max(float((a - b).abs().max()) for a, b in zip(ddp.parameters(), ddp2.parameters())),
            "had_residuals": bool(saved[0]["residuals"]), "step": state2.step}


def _check_native_matches_eager(rank: int, ws: int) -> dict:
    """The same training under the native CPU kernels and under eager torch: the quantizer is bitwise equal, so
    the parameters must be too (int8 and int4, error feedback, several buckets, non-aligned tiles). Also with
    DDP's ``gradient_as_bucket_view=True``, where the gradients the hook writes are the parameters' own, and with
    one cap per bucket (DDP's ``bucket_cap_mb_list``, small last buckets: the layout docs/compression.md suggests)."""
    tapered = {"bucket_cap_mb_list": [0.01, 0.002]}
    variants = {"native": {"bucket_cap_mb": 0.02}, "eager": {"bucket_cap_mb": 0.02},
                "view": {"bucket_cap_mb": 0.02, "gradient_as_bucket_view": True},
                "tapered": tapered, "tapered_eager": tapered}
    out = {}
    for bits, block_size in ((8, 128), (4, 32)):
        params, buckets = {}, {}
        for name, kwargs in variants.items():
            os.environ["LDS_NATIVE_KERNELS"] = "0" if name.endswith("eager") else "1"
            torch.manual_seed(0)
            ddp = DistributedDataParallel(_Net(), **kwargs)
            state = register_compression_hook(ddp, bits=bits, block_size=block_size, warmup_steps=1,
                                              min_bucket_numel=256)
            _run_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9), rank, range(5))
            params[name] = [p.detach().clone() for p in ddp.parameters()]
            buckets[name] = len(state.plans)
        os.environ.pop("LDS_NATIVE_KERNELS")

        def same(a: str, b: str, params: dict = params) -> bool:
            return all(torch.equal(x, y) for x, y in zip(params[a], params[b]))

        out[bits] = {"native_built": native.library() is not None, "equal": same("native", "eager"),
                     "view_equal": same("native", "view"), "tapered_equal": same("tapered", "tapered_eager"),
                     "compressed_buckets": buckets,
                     "moved": any(not torch.equal(a, b) for a, b in zip(params["native"], _Net().parameters()))}
    return out


def _check_rebuild(rank: int, ws: int) -> dict:
    """DDP regroups parameters into new buckets: each residual must follow its parameter into the new plan."""
    state = _state(8, 64)
    gen = torch.Generator().manual_seed(rank)
    a, b = torch.randn(1000, generator=gen), torch.randn(3000, generator=gen)
    state.begin_step()
    compressed_average(state, [a, b], ["a", "b"], a).wait()
    state.end_step()
    old_a, old_b = state.residuals["a"].clone(), state.residuals["b"].clone()
    every_b = [torch.empty_like(old_b) for _ in range(ws)]
    dist.all_gather(every_b, old_b)
    zero = torch.zeros(3000)  # a zero gradient: what gets exchanged is the carried residual alone
    state.begin_step()
    compressed_average(state, [zero], ["b"], zero).wait()
    state.end_step()
    expected = torch.stack(every_b).mean(0)
    return {"plans": sorted(state.plans), "a_kept": torch.equal(state.residuals["a"], old_a),
            "b_carried": float((zero - expected).abs().max()), "b_scale": float(expected.abs().max())}


def _check_hold(rank: int, ws: int) -> dict:
    """A held final write (CPU, hold=True) waits for release() or the next step, then equals the unheld one."""
    state = _state(8, 64, error_feedback=False)  # no residual: every call with the same input gives the same output
    grads = _all_grads(ws, 3000)
    state.begin_step()
    plain = grads[rank].clone()
    compressed_average(state, [plain], ["g"], plain).wait()
    out = {}
    for release in ("release", "next_step"):
        held = grads[rank].clone()
        fut = compressed_average(state, [held], ["g"], held, hold=True)
        time.sleep(0.5)  # the exchange of 3000 values has long arrived: only the hold keeps the future open
        pending = not fut.done()
        if release == "release":
            state.release()
        else:
            state.begin_step()
        fut.wait()
        out[release] = {"pending": pending, "equal": torch.equal(held, plain)}
        state.begin_step()
    return out


def _check_overlap_off(rank: int, ws: int) -> dict:
    """``overlap=False`` (the hook waits for its own exchange) must neither hang on a held write nor change the
    numbers: the same training with and without overlap, bit for bit."""
    params = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(_Net(), bucket_cap_mb=0.01)
        register_compression_hook(ddp, bits=8, block_size=64, warmup_steps=1, min_bucket_numel=256, overlap=overlap)
        _run_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9), rank, range(4))
        params[overlap] = [p.detach().clone() for p in ddp.parameters()]
    return {"equal": all(torch.equal(a, b) for a, b in zip(params[True], params[False]))}


def _check_all(rank: int, ws: int) -> dict:
    out = {"exchange": _check_exchange(rank, ws), "ef": _check_error_feedback(rank, ws, 4 if ws == 2 else 8),
           "rebuild": _check_rebuild(rank, ws), "hold": _check_hold(rank, ws),
           "overlap_off": _check_overlap_off(rank, ws)}
    if ws == 2:
        out["ddp"] = _check_ddp(rank, ws)
        out["resume"] = _check_resume(rank, ws)
    out["native"] = _check_native_matches_eager(rank, ws)  # 2 ranks: one all-gather; 4: the two-phase exchange
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["ws2", "ws4"])
def gloo_results(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    """One real gloo run per world size doing every check (process start-up dominates the cost)."""
    return request.param, run_distributed(_check_all, request.param, timeout=240)


def test_compressed_average_within_quantization_bound_and_byte_formula(gloo_results: tuple[int, list[dict]]
                                                                       ) -> None:
    ws, results = gloo_results
    results = [r["exchange"] for r in results]
    for (bits, block_size, numel), res in results[0].items():
        assert res["within_bound"] and res["nonzero_error"] and res["replicas_equal"], (bits, block_size, res)
        # Two ranks: one all-gather of the whole quantized bucket; more: all-to-all, then all-gather of the chunks.
        assert res["single"] == [ws == 2]
        # Counted from the buffers the collectives send; the formula, written out: W-1 chunks of codes + 2-byte
        # scales, twice (both exchanges send the same bytes with two ranks).
        blocks_per_chunk = math.ceil(numel / (ws * block_size))
        chunk_bytes = blocks_per_chunk * block_size * bits // 8 + 2 * blocks_per_chunk
        assert res["bytes_sent"] == 2 * (ws - 1) * chunk_bytes == compressed_bytes(numel, ws, bits, block_size)
        assert res["bytes_fp32"] == 2 * (ws - 1) * 4 * numel // ws
        assert res["rel_error"] < (0.03 if bits == 8 else 0.3)
    assert all(r == results[0] for r in results[1:])
    big = compressed_bytes(1 << 24, ws, 8, 128) / fp32_allreduce_bytes(1 << 24, ws)
    big4 = compressed_bytes(1 << 24, ws, 4, 128) / fp32_allreduce_bytes(1 << 24, ws)
    assert big <= 0.27 and big4 <= 0.14


def _check_error_feedback(rank: int, ws: int, bits: int) -> dict:
    # A constant gradient is the worst case for round-to-nearest: the same error every step, a bias that grows
    # linearly in the sum of updates. Error feedback must keep the sum's error bounded.
    steps = 25
    grads = _all_grads(ws, 2000)
    sums = {}
    for error_feedback in (True, False):
        state = _state(bits, 128, error_feedback)
        applied = torch.zeros(2000)
        for _ in range(steps):
            applied += _exchange(state, grads[rank])
        sums[error_feedback] = float((applied - steps * grads.mean(0)).abs().max())
    bound = float(_one_step_bound(grads, ws, bits, 128).max())
    return {"ef": sums[True], "no_ef": sums[False], "one_step": bound}


def test_error_feedback_keeps_the_sum_of_updates_unbiased(gloo_results: tuple[int, list[dict]]) -> None:
    ws, results = gloo_results
    res = results[0]["ef"]
    # The error of the sum with feedback is the last residual: a few one-step errors, whatever the step count.
    assert res["ef"] < 3 * res["one_step"] * ws, res
    assert res["no_ef"] > 5 * res["ef"], res


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 96)
        self.fc2 = torch.nn.Linear(96, 48)
        self.fc3 = torch.nn.Linear(48, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _check_ddp(rank: int, ws: int) -> dict:
    torch.manual_seed(0)
    ref_model, model = _Net(), _Net()
    model.load_state_dict(ref_model.state_dict())
    # Small buckets so that the exchange really runs several buckets concurrently (and one stays fp32: 1-D only).
    ref = DistributedDataParallel(ref_model, bucket_cap_mb=0.01)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
    state = register_compression_hook(ddp, bits=8, block_size=64, warmup_steps=1, min_bucket_numel=256)
    gen = torch.Generator().manual_seed(rank)
    rel_errors, num_buckets = [], []
    for step in range(4):
        x = torch.randn(16, 64, generator=gen)
        for net in (ref, ddp):
            if step == 3:  # gradient accumulation: the hook does not run under no_sync
                with net.no_sync():
                    net(x.flip(0)).square().mean().backward()
            net(x).square().mean().backward()
        num_buckets.append(state.num_compressed_buckets)
        got = torch.cat([p.grad.view(-1) for p in ddp.parameters()])
        exact = torch.cat([p.grad.view(-1) for p in ref.parameters()])
        rel_errors.append(float((got - exact).norm() / exact.norm()))
        for net in (ref, ddp):
            for p in net.parameters():
                p.grad = None
    gathered = [torch.empty_like(got) for _ in range(ws)]
    dist.all_gather(gathered, got)
    # Non-finite gradient on one rank: every rank must see it, and the residuals must be reset afterwards.
    x = torch.randn(16, 64, generator=gen)
    if rank == 1:
        x[0, 0] = float("inf")
    ddp(x).square().mean().backward()
    saw_nonfinite = not all(torch.isfinite(p.grad).all() for p in ddp.parameters())
    poisoned = not all(torch.isfinite(r).all() for r in state.residuals.values())
    for p in ddp.parameters():
        p.grad = None
    ready: list[float] = []  # when each gradient was accumulated (before DDP's own hook on it)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: ready.append(time.perf_counter()))
    loss = ddp(torch.randn(16, 64, generator=gen)).square().mean()
    started = time.perf_counter()
    loss.backward()
    # The exposed time the callback logs starts when DDP hands over the last bucket: after every gradient.
    last_bucket_in_backward = started < max(ready) <= state.last_bucket_time < time.perf_counter()
    residuals_finite = all(torch.isfinite(r).all() for r in state.residuals.values())
    return {"steps": state.step, "rel_errors": rel_errors, "replicas_equal": all(torch.equal(g, got) for g in gathered),
            "num_buckets": num_buckets, "saw_nonfinite": saw_nonfinite, "residual_names": sorted(state.residuals),
            "finite_after": all(torch.isfinite(p.grad).all() for p in ddp.parameters()),
            "residuals_finite": residuals_finite, "poisoned": poisoned,
            "last_bucket_in_backward": last_bucket_in_backward}


def test_hook_under_ddp_matches_fp32_ddp_and_propagates_non_finite(gloo_results: tuple[int, list[dict]]) -> None:
    ws, results = gloo_results
    if ws != 2:
        return  # the DDP scenario runs in the 2-process run only
    results = [r["ddp"] for r in results]
    for res in results:
        assert res["steps"] == 6  # 4 synchronising steps + 2 more; the no_sync micro-batch is not one
        assert res["num_buckets"][0] == 0 and min(res["num_buckets"][1:]) >= 2  # warm-up, then compressed
        assert res["rel_errors"][0] < 1e-6 and 0 < max(res["rel_errors"][1:]) < 0.02
        assert res["replicas_equal"] and res["saw_nonfinite"] and res["finite_after"]
        # Residuals live per parameter of the compressed buckets. The non-finite step left NaN residuals (at least
        # on the rank whose gradient overflowed); had they not been reset, the next step's gradients (finite_after)
        # and residuals would be NaN too.
        assert {"fc1.weight", "fc2.weight"} <= set(res["residual_names"])
        assert res["residuals_finite"]
        assert res["last_bucket_in_backward"]
    assert any(res["poisoned"] for res in results)
    assert results[0]["rel_errors"] == results[1]["rel_errors"]


def test_residuals_follow_their_parameters_into_rebuilt_buckets(gloo_results: tuple[int, list[dict]]) -> None:
    _, results = gloo_results
    for res in (r["rebuild"] for r in results):
        assert res["plans"] == [("b",)] and res["a_kept"]
        # The carried residuals were averaged: int8 errs by about 1/127 of the block's absmax, per phase.
        assert 0 < res["b_carried"] < 2 * res["b_scale"] / 127, res


def test_resume_from_saved_state_continues_bit_identically(gloo_results: tuple[int, list[dict]]) -> None:
    ws, results = gloo_results
    if ws != 2:
        return  # runs in the 2-process run only
    for res in (r["resume"] for r in results):
        # Residuals, step counter and stochastic-rounding generators restored: the continuation is bit-identical.
        assert res["had_residuals"] and res["step"] == 8
        assert res["max_diff"] == 0.0, res


def test_held_writes_wait_for_release_and_change_nothing(gloo_results: tuple[int, list[dict]]) -> None:
    _, results = gloo_results
    for res in results:
        for release, check in res["hold"].items():
            assert check["pending"] and check["equal"], (release, check)
        assert res["overlap_off"]["equal"], res["overlap_off"]


def test_register_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        register_compression_hook(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bits=5"):
        CompressionConfig(bits=5)
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        CompressionConfig(warmup_steps=-1)


def test_native_kernels_train_bit_identically_to_eager_torch(gloo_results: tuple[int, list[dict]]) -> None:
    _, results = gloo_results
    for res in (r["native"] for r in results):
        for bits, check in res.items():
            assert check["native_built"] or shutil.which("cc") is None, "a C compiler is here: the kernels must build"
            assert check["equal"] and check["view_equal"] and check["moved"], (bits, check)
            assert check["tapered_equal"], (bits, check)
            assert check["compressed_buckets"]["tapered"] > check["compressed_buckets"]["native"], (bits, check)
