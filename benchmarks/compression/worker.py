"""One rank of the gradient-compression benchmark (started by ``bench.py``, one process per emulated host).

``--mode time``: for every configuration, a fresh DDP module of the same GPT, interleaved over repetitions; step time,
the same step under ``no_sync`` (no communication: the compute-only reference of the same process at the same moment),
and counted bytes. Each step is also split at the moment its last gradient is accumulated (a post-accumulate-grad hook
on every parameter, which runs before DDP's): ``compute_s`` before it, ``wait_s`` after it (the last bucket's exchange,
and whatever the hook still does then, while backward has nothing left to compute). ``--mode loss``: the same number of
training steps of the example GPT on the built-in corpus per configuration, final validation loss. Rank 0 writes a JSON
file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from lightning_deepseek import register_compression_hook
from lightning_deepseek.compression.hook import _all_gather_single
from lightning_deepseek.compression.quantize import payload_bytes
from lightning_deepseek.compression.state import fp32_allreduce_bytes
from lightning_deepseek.data.text import read_corpus
from lightning_deepseek.models import GPT, GPTConfig

CONFIGS = ["fp32", "fp16_hook", "powersgd_r4"] + [
    f"int{bits}{'_ef' if ef else ''}{'' if overlap else '_nooverlap'}"
    for bits in (8, 4) for ef in (True, False) for overlap in (True, False)
]
# Also accepted: any of ours with an "_eager" suffix runs the eager torch quantizer instead of the native CPU
# kernels (same numerics), e.g. "int8_ef_eager", to measure what the kernels buy side by side; with a "_nohold"
# suffix, the final writes of early buckets run as their data arrive instead of being held until the last bucket is
# launched (CompressionConfig.hold_writes; same numerics); and "wire_int8" / "wire_int4", a timing oracle (see
# WireOnly).


class WireOnly:
    """Timing oracle, not a compressor: per bucket, the one all-gather our two-rank exchange sends (each rank's
    quantized bucket, codes and scales, the same bytes), of a buffer nobody quantized; gradients stay unaveraged.
    Its step time is what ours would be if compression compute were free, on the same wire, threads and cores."""

    def __init__(self, bits: int, block_size: int) -> None:
        self.bits, self.block_size = bits, block_size
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.bytes_sent = 0

    @staticmethod
    def hook(oracle, bucket):  # noqa: ANN001, ANN205 - DDP rejects string annotations (PEP 563) on comm hooks
        flat, ws = bucket.buffer(), dist.get_world_size()
        assert ws == 2, "the oracle mirrors the two-rank exchange"
        if bucket.index() == 0:
            oracle.bytes_sent = 0
        if flat.numel() not in oracle.buffers:  # by size: DDP rebuilds its buckets after the first step
            unit = ws * oracle.block_size
            row = payload_bytes(-(-flat.numel() // unit) * unit, oracle.bits, oracle.block_size)
            oracle.buffers[flat.numel()] = (torch.zeros(row, dtype=torch.uint8),
                                            torch.empty(ws * row, dtype=torch.uint8))
        send, recv = oracle.buffers[flat.numel()]
        oracle.bytes_sent += (ws - 1) * send.numel()
        fut = _all_gather_single(recv, send, async_op=True).get_future()
        return fut.then(lambda _: flat)


def powersgd_bytes(model: torch.nn.Module, world_size: int, rank: int = 4) -> int:
    """Bytes of PowerSGD's all-reduces: P and Q for each compressed matrix, the rest uncompressed (ring)."""
    numel = 0
    for p in model.parameters():
        n, m = p.shape[0], p.numel() // p.shape[0]
        compress = p.dim() > 1 and (n + m) * rank * 2 < n * m  # torch's default min_compression_rate=2
        numel += (n + m) * rank if compress else p.numel()
    return fp32_allreduce_bytes(numel, world_size)


def bucket_caps(spec: str) -> dict:
    """DDP's bucket keyword for ``--bucket-mb``: ``"4"`` (every bucket up to 4 MB) or ``"4,4,2,1"`` (one cap per
    bucket in the order their gradients become ready, the last repeating: DDP's ``bucket_cap_mb_list``)."""
    caps = [float(c) for c in spec.split(",")]
    return {"bucket_cap_mb": caps[0]} if len(caps) == 1 else {"bucket_cap_mb_list": caps}


def wrap(model: torch.nn.Module, name: str, bucket_mb: str = "25") -> tuple[DistributedDataParallel, object]:
    # torch's PowerSGD issues collectives from future callbacks on DDP's own group: with several buckets their
    # order differs between ranks and gloo aborts ("collective mismatch"), so it gets a single bucket.
    ddp = DistributedDataParallel(model, **bucket_caps("1024" if name == "powersgd_r4" else bucket_mb))
    os.environ["LDS_NATIVE_KERNELS"] = "0" if name.endswith("_eager") else "1"  # our hook's quantizer
    state: object = None
    if name == "fp16_hook":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "powersgd_r4":
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    elif name.startswith("wire_int"):
        bits = int(name[len("wire_int")])
        state = WireOnly(bits, 128 if bits == 8 else 64)
        ddp.register_comm_hook(state, WireOnly.hook)
    elif name.startswith("int"):
        bits = int(name[3])  # the presets' block sizes (conf/compression): int8 128, int4 64 (0.133x the fp32 bytes)
        state = register_compression_hook(ddp, bits=bits, block_size=128 if bits == 8 else 64,
                                          error_feedback="_ef" in name, warmup_steps=1, min_bucket_numel=4096,
                                          overlap="nooverlap" not in name, hold_writes="_nohold" not in name)
    return ddp, state


def bytes_per_step(name: str, model: torch.nn.Module, state: object, world_size: int) -> int:
    numel = sum(p.numel() for p in model.parameters())
    if name == "fp32":
        return fp32_allreduce_bytes(numel, world_size)
    if name == "fp16_hook":
        return fp32_allreduce_bytes(numel, world_size) // 2
    if name == "powersgd_r4":
        return powersgd_bytes(model, world_size)
    return state.bytes_sent  # type: ignore[attr-defined]


def batch(data: torch.Tensor, gen: torch.Generator, batch_size: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, data.numel() - block - 1, (batch_size,), generator=gen)
    x = torch.stack([data[i:i + block + 1] for i in idx.tolist()]).long()
    return x[:, :-1], x[:, 1:]


def step(ddp: DistributedDataParallel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = ddp(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    loss.backward()
    return loss


def time_mode(args: argparse.Namespace, rank: int, world_size: int, data: torch.Tensor) -> dict:
    cfg = GPTConfig(**json.loads(args.model))
    gen = torch.Generator().manual_seed(rank)
    x, y = batch(data, gen, args.batch_size, cfg.block_size)
    configs = args.configs.split(",")
    samples: dict[str, dict[str, list[float]]] = {
        key: {c: [] for c in configs} for key in ("step_s", "no_comm_s", "wait_s", "compute_s", "no_comm_compute_s")}
    nbytes: dict[str, int] = {}
    ready = [0.0]  # when the step's last gradient was accumulated (DDP then launches the last bucket)

    def stamp(_: torch.Tensor) -> None:
        ready[0] = time.perf_counter()

    for _ in range(args.reps):
        for name in configs:  # interleaved: every configuration sees the same share of the machine's noise
            torch.manual_seed(0)
            ddp, state = wrap(GPT(cfg), name, args.bucket_mb)
            for p in ddp.module.parameters():
                p.register_post_accumulate_grad_hook(stamp)  # runs before DDP's own hook on the same gradient
            for i in range(args.steps + 2):  # two untimed steps: DDP's bucket rebuild, hook warm-ups
                dist.barrier()
                t0 = time.perf_counter()
                step(ddp, x, y)
                t_end = time.perf_counter()
                sync = {"step_s": t_end - t0, "wait_s": t_end - ready[0], "compute_s": ready[0] - t0}
                dist.barrier()  # the peer has finished its exchange too: nothing of it runs during the reference
                with ddp.no_sync():
                    t1 = time.perf_counter()
                    step(ddp, x, y)
                    sync.update(no_comm_s=time.perf_counter() - t1, no_comm_compute_s=ready[0] - t1)
                ddp.zero_grad(set_to_none=True)
                if i >= 2:
                    for key, value in sync.items():
                        samples[key][name].append(value)
            nbytes[name] = bytes_per_step(name, ddp.module, state, world_size)
            del ddp, state
    medians = {key: {c: statistics.median(v) for c, v in per.items()} for key, per in samples.items()}
    return {**medians, "bytes": nbytes, "num_params": sum(p.numel() for p in GPT(cfg).parameters())}


def loss_mode(args: argparse.Namespace, rank: int, world_size: int, data: torch.Tensor) -> dict:
    cfg = GPTConfig(**json.loads(args.model))
    split = int(0.9 * data.numel())
    val_gen = torch.Generator().manual_seed(1234)
    val = [batch(data[split:], val_gen, 16, cfg.block_size) for _ in range(4)]
    names = ["fp32", "fp16_hook", "powersgd_r4", "int8_ef", "int8", "int4_ef", "int4"]
    out: dict[str, list[float]] = {name: [] for name in names}
    for seed in range(args.seeds):  # one 200-step run of int4 varies by +/-1.5% between seeds: average several
        for name in names:
            torch.manual_seed(seed)
            ddp, _ = wrap(GPT(cfg), name)
            opt = torch.optim.AdamW(ddp.parameters(), lr=2e-3, weight_decay=0.0)
            gen = torch.Generator().manual_seed(100 + rank + 1000 * seed)
            for _ in range(args.train_steps):
                step(ddp, *batch(data[:split], gen, args.batch_size, cfg.block_size))
                opt.step()
                opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                losses = [F.cross_entropy(ddp.module(x).reshape(-1, 256), y.reshape(-1)) for x, y in val]
            out[name].append(float(torch.stack(losses).mean()))
    return {"val_loss": out}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["time", "loss"], required=True)
    parser.add_argument("--model", default='{"n_layer": 4, "n_embd": 256, "n_head": 4, "block_size": 64}')
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=1, help="loss mode: seeds 0..N-1 (model init and data order)")
    parser.add_argument("--bucket-mb", default="25", help="DDP bucket caps of every configuration (see bucket_caps)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset (fp32 first)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = torch.frombuffer(bytearray(read_corpus(None)), dtype=torch.uint8)
    result = (time_mode if args.mode == "time" else loss_mode)(args, rank, world_size, data)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({**result, "world_size": world_size, "args": vars(args), "pid": os.getpid()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
