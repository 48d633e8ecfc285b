"""``GradientCompression``: a Lightning ``Callback`` that installs the compressed gradient exchange.

Supports: Lightning's ``DDPStrategy`` (``"ddp"``, ``"ddp_spawn"``, ...) on CPU and CUDA, and any strategy exposing
its data-parallel ``DistributedDataParallel`` as ``strategy.ddp_module`` or ``strategy.model`` (such as
``HybridParallelStrategy``); gradient accumulation and mixed precision. The hook is attached by this callback
itself because Lightning 2.6 registers a ``ddp_comm_hook`` only on CUDA (on CPU it would silently never run).

Costs: see :mod:`lightning_deepseek.compression.hook` (~0.25x / 0.13x the bytes of fp32, one fp32 residual per
parameter, quantization compute that overlaps with backward). Telemetry costs two norms per bucket on logging
steps only.

``bits="auto"``: at fit start the training step of a DDP-wrapped copy of the model is timed with fp32, int8 and
int4 exchanges (:mod:`lightning_deepseek.autotune`), and the hook is installed with the fastest by the margin (none
where fp32 wins). Under ``HybridParallelStrategy`` with an ``"auto"`` size, the callback asks the strategy
(``strategy.request_compression``) to decide the bits with the sizes, in the same comparison, and reads them from
``strategy.layout`` (:mod:`lightning_deepseek.parallel.layout`).

Pipelines: under ``HybridParallelStrategy(pipeline_parallel_size=P)`` (found by its ``pipeline_group``) the stages'
gradient exchange over ``data_parallel_group`` is compressed with the same exchange, once per optimizer step after
the schedule's backward (:mod:`lightning_deepseek.parallel.pipeline_exchange`; not overlapped, so its time is all
exposed); not with ``bits="auto"`` or FSDP2-sharded stages (refused by the strategy).

Parameter sharding: under ``HybridParallelStrategy(data_parallel_shard_size>1)`` every FSDP2 unit's gradient
reduce-scatter is compressed instead (:mod:`lightning_deepseek.compression.reduce_scatter`; a DDP wrapper of
parameters left unsharded stays fp32). Does not support: HSDP (``data_parallel_replicate`` > 1: FSDP's replicate
all-reduce, the inter-node one, is issued by FSDP itself, uncompressed), ``bits="auto"`` with sharding (the timed
copies do not shard), and Lightning's DeepSpeed, FSDP and ``ModelParallelStrategy`` (their own sharded exchanges):
clear errors. One device: a warning, nothing to compress.

Checkpoints: the callback's state (every rank's residuals, the step counter, the stochastic-rounding generators)
is gathered to rank 0 when the checkpoint is written, over a gloo group of its own (so that, on NCCL, every rank's
residuals never land in rank 0's GPU memory: they are host copies), and handed back to each rank on resume.

Telemetry on CUDA, where the host only launches kernels and NCCL futures complete at launch, is read from CUDA
events and logged one step late (reading it at once would make the host wait for the device every step).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_deepseek.compression import fused, native
from lightning_deepseek.compression.config import CompressionConfig
from lightning_deepseek.compression.hook import register_compression_hook
from lightning_deepseek.compression.reduce_scatter import FSDPCompressionState, install_fsdp_compression
from lightning_deepseek.compression.state import CompressionState
from lightning_deepseek.parallel.groups import reused
from lightning_deepseek.parallel.topology import discover_topology

if TYPE_CHECKING:
    from lightning_deepseek.autotune.decision import Decision


class CompressionStrategyError(ValueError):
    """The Trainer's strategy has no data-parallel reduction the hook can sit on."""


def find_ddp_module(strategy: Strategy) -> DistributedDataParallel | None:
    """The strategy's data-parallel ``DistributedDataParallel``; ``None`` (with a warning) with one data-parallel rank.

    Raises:
        CompressionStrategyError: for sharded strategies, or a multi-process strategy without a DDP module.
    """
    name = type(strategy).__name__
    if isinstance(strategy, (DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy)):
        raise CompressionStrategyError(
            f"GradientCompression does not support strategy={name}: it reduce-scatters sharded gradients itself "
            "and has no DDP communication hook. Use strategy='ddp' or 'hybrid', or remove GradientCompression.")
    module = getattr(strategy, "ddp_module", None) or strategy.model
    is_ddp = isinstance(module, DistributedDataParallel)
    # Lightning wraps even one device in DDP (strategy='ddp', devices=1), and a pure tensor-parallel run has one
    # data-parallel rank: either way nothing crosses a wire, so a hook would only cost time.
    dp_size = dist.get_world_size(module.process_group) if is_ddp else strategy.world_size
    if dp_size <= 1:
        rank_zero_warn(f"GradientCompression does nothing with strategy={name} on a single data-parallel rank (a "
                       f"single device, or world size {strategy.world_size} all tensor-parallel): there is no "
                       "gradient exchange to compress. Remove it, or train on several devices.")
        return None
    if is_ddp:
        return module
    raise CompressionStrategyError(
        f"GradientCompression found no DistributedDataParallel module on strategy={name} "
        f"(world_size={strategy.world_size}; strategy.model is {type(module).__name__}). Use strategy='ddp' or "
        "'hybrid', or a strategy that exposes its data-parallel DDP module as `strategy.ddp_module`.")


def _pipeline_replicas(strategy: Strategy) -> bool:
    """Whether a pipelined strategy has stage replicas to exchange gradients with (else a warning)."""
    size = dist.get_world_size(strategy.data_parallel_group)
    if size <= 1:
        rank_zero_warn(f"GradientCompression does nothing with a pipeline over all {strategy.world_size} ranks: every "
                       "rank holds other stages, so no gradient is exchanged. Remove it, or train on 2 or more "
                       "times pipeline_parallel_size ranks (replicas of each stage).")
    return size > 1


def shards_with_fsdp(strategy: Strategy, config: CompressionConfig) -> bool:
    """Whether ``strategy`` shards parameters with FSDP2, whose reduce-scatter is then compressed.

    Raises:
        CompressionStrategyError: HSDP (its replicate all-reduce stays uncompressed) or ``bits="auto"``.
    """
    layout = getattr(strategy, "layout", None)
    if layout is None or not layout.dims.fsdp_enabled:
        return False
    dims = layout.dims
    if dims.dp_replicate > 1:
        raise CompressionStrategyError(
            f"GradientCompression compresses FSDP's gradient reduce-scatter, but with data_parallel_shard_size="
            f"{dims.dp_shard} of {dims.dp_shard * dims.dp_replicate} data-parallel ranks the shards are replicated "
            f"(HSDP, {dims.dp_replicate} replicas) and FSDP all-reduces them across the replicas itself, "
            "uncompressed: that is the slow, inter-node exchange. Set data_parallel_shard_size="
            f"{dims.dp_shard * dims.dp_replicate} (FSDP over every data-parallel rank), or remove GradientCompression.")
    if config.bits == "auto":
        raise CompressionStrategyError(
            f"GradientCompression(bits='auto') with data_parallel_shard_size={dims.dp_shard}: the timed copies that "
            "decide the bits do not shard parameters. Pass bits=8 or bits=4.")
    return True


class GradientCompression(Callback):
    """Compress data-parallel gradient traffic to 8 or 4 bits with error feedback, overlapped with backward.

    ``GradientCompression(bits=4, block_size=64)``: the exchange's settings are the fields of
    :class:`~lightning_deepseek.compression.CompressionConfig` (``bits``, ``block_size``, ``error_feedback``,
    ``warmup_steps``, ``min_bucket_numel``, ``stochastic_rounding``, ``overlap``, ``seed``...), where each one's
    default and meaning are documented. ``bits="auto"``: fp32, 8 or 4 by timed copies, at fit start.

    Args:
        config: the exchange's settings as one value; or pass them as keyword arguments (``**settings``).
        checkpoint_residuals: store every rank's error-feedback residuals in checkpoints, so that a resume continues
            exactly. They cost world size x one fp32 gradient in rank 0's host memory while a checkpoint is written,
            and as much in the file; with False a resume starts them from zero (the quantization error of one step
            is lost, once).
        **settings: fields of ``CompressionConfig``, when ``config`` is not given.
    """

    def __init__(self, config: CompressionConfig | None = None, *, checkpoint_residuals: bool = True,
                 **settings: Any) -> None:
        self.config = CompressionConfig.from_settings("GradientCompression", config, settings)
        if not isinstance(checkpoint_residuals, bool):
            raise ValueError(f"GradientCompression checkpoint_residuals={checkpoint_residuals!r} must be True or "
                             "False.")
        self.checkpoint_residuals = checkpoint_residuals
        self.hook_state: CompressionState | FSDPCompressionState | None = None
        self._pending: dict[str, Any] | None = None
        self._step_before_backward = 0
        self._log_step = False
        self._exposed_ms: list[float] = []
        self._last_rel_error: float | None = None
        self._device = torch.device("cpu")
        self._gather_group: dist.ProcessGroup | None = None
        self._gpu_step: tuple | None = None  # CUDA: the last step's events, read at the next step (_gpu_timings)
        self.decision: Decision | None = None  # bits="auto": the timed copies' table and choice
        self._decided_by_strategy = False
        self._on_pipeline = False  # the strategy runs a pipeline: its stages' dp exchange is compressed

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # A strategy that decides its layout (HybridParallelStrategy) weighs the compression with it: tell it what
        # this callback asks for; it hands back the decided bits in `strategy.layout` (lightning_deepseek.parallel
        # .layout). Lightning runs callbacks' setup before the strategy's.
        request = getattr(trainer.strategy, "request_compression", None)
        if request is not None:
            request(self.config)

    @property
    @override
    def state_key(self) -> str:
        # Callback's protected helper, the way Lightning's docs tell subclasses to build a state key.
        return self._generate_state_key(bits=self.config.bits, block_size=self.config.block_size)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        config = self.config
        self._on_pipeline = getattr(trainer.strategy, "pipeline_group", None) is not None
        fsdp = not self._on_pipeline and shards_with_fsdp(trainer.strategy, config)
        if config.bits == "auto":
            bits = self._decide_bits(trainer, pl_module)
            if bits is None:
                return
            config = dataclasses.replace(config, bits=bits)
        ddp_module = None if fsdp or self._on_pipeline else find_ddp_module(trainer.strategy)
        if ddp_module is None and not fsdp and not (self._on_pipeline and _pipeline_replicas(trainer.strategy)):
            return
        self._device = pl_module.device
        if self._device.type == "cpu":
            native.library()  # build the CPU kernels (or warn) now, not inside the first compressed step
        try:
            if self._on_pipeline:  # the stages' dp exchange (lightning_deepseek.parallel.pipeline_exchange)
                self.hook_state = trainer.strategy.compress_pipeline_gradients(config)
            else:
                self.hook_state = (install_fsdp_compression(pl_module, config) if ddp_module is None
                                   else register_compression_hook(ddp_module, config))
        except RuntimeError as exc:
            raise CompressionStrategyError(
                f"GradientCompression could not install its hook ({exc}). A DDP module takes one comm hook: "
                "drop the strategy's `ddp_comm_hook` argument when using GradientCompression.") from exc
        # collective: every rank gets here, in this order; a later fit in the same processes reuses it
        self._gather_group = reused(("gather_group", "gloo"), lambda: dist.new_group(backend="gloo"))
        if self._pending is not None:
            self._restore(self._pending)
            self._pending = None

    def _decide_bits(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int | None:
        """``bits="auto"``: the strategy's decision where it made one, else timed copies here (collective)."""
        from lightning_deepseek.autotune.auto_parallel import decide_compression  # autotune imports our kernels

        strategy = trainer.strategy
        layout = getattr(strategy, "layout", None)
        if layout is not None and layout.bits is not None:
            self.decision, self._decided_by_strategy = layout.decision, True
            return None if layout.bits == 32 else layout.bits
        module = getattr(strategy, "ddp_module", None) or strategy.model
        dp_size = dist.get_world_size(module.process_group) if isinstance(module, DistributedDataParallel) else 1
        if dp_size <= 1:
            raise ValueError(f"GradientCompression(bits='auto') with {dp_size} data-parallel rank (world size "
                             f"{strategy.world_size}): there is no gradient exchange to decide about. Train on 2 or "
                             "more devices, or remove GradientCompression (bits=8 or 4 only warns).")
        topology = discover_topology(strategy.root_device, strategy.local_rank)
        bucket = getattr(module, "bucket_bytes_cap", 25 * 2**20)
        self.decision = decide_compression(pl_module, trainer, topology, dp_size, bucket,
                                           bool(getattr(module, "gradient_as_bucket_view", False)))
        return self.decision.chosen.bits

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self.hook_state is None:
            return
        self._step_before_backward = self.hook_state.step
        # Metrics only on the steps Lightning's loggers write (as Lightning's own monitors do): a log_dict of four
        # scalars costs ~1.4 ms of Python a step (benchmarks/compression/bench_logging.py). The relative error (two
        # norms per bucket, a host sync) on the same steps.
        self._log_step = trainer._logger_connector.should_update_logs  # private: no public "logging step" predicate
        self.hook_state.track_error = self._log_step

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = self.hook_state
        if state is None or state.step == self._step_before_backward:
            return  # no_sync micro-batch: nothing was exchanged
        if isinstance(state, FSDPCompressionState):  # FSDP calls the comm synchronously: its time is exposed
            timings = state.timings_ms(self._device)
        elif self._device.type == "cuda":
            timings = self._gpu_timings(state)
        else:
            # DDP's backward returns only once every bucket's future is done: the time since DDP handed the hook
            # its last bucket (all backward compute finished) is communication, and compression, nothing overlapped.
            timings = (1e3 * (time.perf_counter() - state.last_bucket_time), 1e3 * state.compress_seconds)
        self._record(pl_module, state, timings)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        # Under a pipeline the strategy runs the backward without Lightning's backward hooks: decide here.
        if self._on_pipeline and self.hook_state is not None:
            self._log_step = trainer._logger_connector.should_update_logs  # private: see on_before_backward
            self.hook_state.track_error = self._log_step

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        state = self.hook_state
        if not self._on_pipeline or state is None:
            return
        # The exchange ran at the end of the step's closure, after the schedule's backward: all of it is exposed
        # (host time; on CUDA, where the host only launches work, not measured).
        timings = None if self._device.type == "cuda" else (
            1e3 * (time.perf_counter() - state.last_bucket_time), 1e3 * state.compress_seconds)
        self._record(pl_module, state, timings)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._on_pipeline and stage == "fit" and self.hook_state is not None:
            trainer.strategy.compress_pipeline_gradients(None)  # the split outlives the fit: a later one is plain

    def _record(self, pl_module: pl.LightningModule, state: CompressionState | FSDPCompressionState,
                timings: tuple[float, float] | None) -> None:
        """Keep the exposed time for the summary; on logging steps, log the step's bytes, times and error."""
        if timings is not None:
            self._exposed_ms.append(timings[0])  # every step: the run summary's median
        if not self._log_step:
            return
        metrics = {
            "compression/bytes_per_step": float(state.bytes_sent),
            "compression/bytes_ratio": state.bytes_sent / max(1, state.bytes_fp32),
        }
        if timings is not None:
            metrics["compression/exposed_comm_ms"], metrics["compression/compress_ms"] = timings
        rel_error = state.relative_error() if state.track_error else None
        if rel_error is not None:
            self._last_rel_error = rel_error
            metrics["compression/rel_error"] = rel_error
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    def _gpu_timings(self, state: CompressionState | None) -> tuple[float, float] | None:
        """CUDA: record this step's end of backward; return the previous step's (exposed, compress) milliseconds.

        The exposed time runs from the last bucket's hand-over to the end of backward on the stream that runs it
        (DDP made that stream wait for every bucket); the compression time sums the hook's kernels on all streams.
        With ``state=None`` (end of training) only the pending step is read.
        """
        previous = self._gpu_step
        self._gpu_step = None
        if state is not None and state.last_bucket_event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._gpu_step = (state.last_bucket_event, end, state.take_gpu_spans())
        if previous is None:
            return None
        start, end, spans = previous
        end.synchronize()  # a step ago: long done unless the host runs more than a step ahead of the device
        return start.elapsed_time(end), sum(a.elapsed_time(b) for a, b in spans)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._device.type == "cuda" and (timings := self._gpu_timings(None)) is not None:
            self._exposed_ms.append(timings[0])

    def _kernels(self, stochastic: bool) -> str:
        """Which quantizer ran: the native CPU kernels, the fused GPU kernels or the eager torch ops."""
        if not stochastic and self._device.type == "cpu" and native.library() is not None:
            return "native CPU"
        if not stochastic and fused.available(self._device):
            return "fused (torch.compile)"
        return "torch"

    def summary(self) -> dict[str, object]:
        """A few figures for a run summary (:mod:`lightning_deepseek.reporting`)."""
        state = self.hook_state
        auto = {} if self.decision is None or self._decided_by_strategy else self.decision.summary()
        if state is None:
            off = "fp32: no compressed copy was faster" if self.decision is not None else "single device"
            return {"compression": f"off ({off})", **auto}
        cfg = state.config
        return {
            **auto,
            "compression": f"int{cfg.bits} block={cfg.block_size} ef={cfg.error_feedback}"
                           + (" (FSDP reduce-scatter)" if isinstance(state, FSDPCompressionState) else "")
                           + (" (bits='auto')" if self.config.bits == "auto" else ""),
            "compression_kernels": self._kernels(cfg.stochastic_rounding),
            "compression_bytes_ratio": round(state.total_bytes_sent / max(1, state.total_bytes_fp32), 4),
            "compression_rel_error": self._last_rel_error,
            "compression_exposed_comm_ms_median": round(statistics.median(self._exposed_ms), 2)
            if self._exposed_ms else None,
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.hook_state is None:
            return {} if self._pending is None else self._pending
        world_size, rank = dist.get_world_size(), dist.get_rank()
        if not self.checkpoint_residuals:
            return {"world_size": world_size, "step": self.hook_state.step, "ranks": None}
        own = self.hook_state.state_dict()
        # Lightning builds the checkpoint on every rank and rank 0 writes it: gather every rank's residuals there.
        gathered: list[dict | None] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(own, gathered, dst=0, group=self._gather_group)
        if gathered is None:
            gathered = [own if r == rank else None for r in range(world_size)]
        return {"world_size": world_size, "ranks": gathered}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.hook_state is None:
            self._pending = state_dict  # the DDP module does not exist yet; applied in on_fit_start
        else:
            self._restore(state_dict)

    def _restore(self, state_dict: dict[str, Any]) -> None:
        assert self.hook_state is not None
        world_size, rank = dist.get_world_size(), dist.get_rank()
        ranks = state_dict["ranks"]
        if ranks is None:  # saved with checkpoint_residuals=False
            rank_zero_info("GradientCompression: the checkpoint holds no error-feedback residuals (saved with "
                           "checkpoint_residuals=False): they start from zero.")
            self.hook_state.step = state_dict["step"]
            return
        own = ranks[rank] if state_dict["world_size"] == world_size else None
        if own is None:
            rank_zero_warn(f"GradientCompression: the checkpoint holds error-feedback residuals for "
                           f"world_size={state_dict['world_size']}, this run has world_size={world_size}: "
                           "residuals start from zero (at most one step of quantization error is lost).")
            self.hook_state.step = max(r["step"] for r in ranks if r is not None)
            return
        self.hook_state.load_state_dict(own, self._device)
