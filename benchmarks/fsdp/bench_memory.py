"""Parameter sharding (FSDP2 through ``HybridParallelStrategy``): per-rank memory, activations under checkpointing,
the largest model that trains, and step time, on 4 real gloo processes side by side with plain DDP.

Run: ``.venv/bin/python benchmarks/fsdp/bench_memory.py --part memory|activations|largest|step-time|compression|all
[--smoke] [--testbed --rate 1gbit]`` (``--testbed``: step time on 2 emulated nodes x 2 ranks, root). Each
configuration of ``memory``, ``activations`` and every trial of ``largest`` is a fresh set of 4 processes (peak
RSS is per process); ``step-time`` trains its configurations interleaved in one set. Configurations:

- ``ddp``: Lightning's ``strategy="ddp"``, the model built eagerly on every rank (DDP cannot take a meta model);
- ``lightning-fsdp2``: Lightning's ``ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1)`` with
  ``fully_shard`` per block then the root on ``self.device_mesh["data_parallel"]`` in ``configure_model`` (what a
  Lightning user writes today), the model built under ``trainer.init_module(empty_init=True)``;
- ``fsdp4``, ``hsdp2x2``, ``fsdp4+ac``: ``HybridParallelStrategy(tensor_parallel_size=1,
  data_parallel_shard_size=4|2)``, ``activation_checkpointing="full"`` for the last, built the same way (meta);
- ``fsdp4+int8``, ``fsdp4+int4`` (``--part compression``, against ``fsdp4``): ``fsdp4`` with
  ``GradientCompression(bits=8|4, warmup_steps=0)`` compressing FSDP's reduce-scatter; the bytes each rank sends in
  the reduce-scatters of a step are read from the compression's counters (deterministic).

Memory per rank (``benchmarks/README.md``): peak RSS minus the RSS right after imports = training memory; the
same read at ``on_fit_start`` = what building and materialising the model cost; the max over ranks. Activations
(``--part activations``): bytes of the distinct storages autograd saves in the first step's forward
(``saved_tensors_hooks``), read when the forward returns (FSDP's resharded parameters then count 0), attributed to
the block whose forward saved them. ``largest``: doubles, then bisects, ``n_layer`` at a fixed width, each trial a
set of 4 processes killed at ``--cap-gib`` of their summed RSS (or when the machine's available memory falls below
2 GiB) or at ``--trial-timeout``; it stops growing at the first failure.

The ranks run with ``MALLOC_MMAP_THRESHOLD_=65536`` (``--malloc-mmap-threshold``): with glibc's default, dynamic
threshold, the blocks FSDP all-gathers and frees every step (tens of MiB) move from ``mmap`` to the heap after the
first free, where freed memory stays resident, and every sharded layout (Lightning's FSDP2 as much as ours) then
peaks near DDP's RSS. Pass 0 to measure glibc's default.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

WORLD = 4
MMAP_THRESHOLD = [65536]  # --malloc-mmap-threshold
MIB = 2 ** 20
# name: (strategy, data_parallel_shard_size, activation_checkpointing, built on the meta device)
CONFIGS = {
    "ddp": ("ddp", None, "none", False),
    "lightning-fsdp2": ("lightning", 4, "none", True),
    "fsdp4": ("hybrid", 4, "none", True),
    "hsdp2x2": ("hybrid", 2, "none", True),
    "fsdp4+ac": ("hybrid", 4, "full", True),
    "fsdp4+int8": ("hybrid", 4, "none", True),
    "fsdp4+int4": ("hybrid", 4, "none", True),
}
BITS = {"fsdp4+int8": 8, "fsdp4+int4": 4}  # GradientCompression on FSDP's reduce-scatter
# Model sizes per part: (n_layer, n_embd, n_head, seq, batch per rank); --smoke replaces them with tiny ones.
SIZES = {"memory": (8, 768, 12, 32, 1), "activations": (6, 192, 4, 1024, 2), "largest": (None, 1024, 16, 32, 1),
         "step-time": (4, 512, 8, 64, 1), "compression": (4, 512, 8, 64, 1)}
SMOKE = {"memory": (2, 64, 4, 16, 1), "activations": (2, 32, 4, 64, 1), "largest": (None, 64, 4, 16, 1),
         "step-time": (2, 64, 4, 16, 1), "compression": (2, 64, 4, 16, 1)}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


# ----------------------------------------------------------------------------------------------------- the ranks
def worker(job: dict[str, Any]) -> None:
    """One rank: train ``job["configs"]`` in turn; rank files ``out/rank<r>.json``."""
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_deepseek import GradientCompression, HybridParallelStrategy
    from lightning_deepseek.models import GPT, GPTConfig

    torch.set_num_threads(1)
    base_kib = _status_kib("VmRSS")
    n_layer, n_embd, n_head, seq, batch = job["size"]
    config = GPTConfig(vocab_size=256, block_size=seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd)

    class BenchLM(pl.LightningModule):
        def __init__(self, hand_fsdp: bool, count_activations: bool) -> None:
            super().__init__()
            self.model = GPT(config)
            self.hand_fsdp, self.count_activations = hand_fsdp, count_activations
            self.fit_start_kib, self.step_s, self.activations, self._t0 = 0, [], {}, 0.0

        def configure_model(self) -> None:
            if self.hand_fsdp:  # Lightning's documented FSDP2 recipe for ModelParallelStrategy
                mesh = self.device_mesh["data_parallel"]
                for block in self.model.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(self.model, mesh=mesh)

        def on_fit_start(self) -> None:
            self.fit_start_kib = _status_kib("VmHWM")

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.step_s.append(time.perf_counter() - self._t0)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            if self.count_activations and batch_idx == 0:
                return self._counted_loss(*batch)
            return self._loss(*batch)

        def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

        def _counted_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            local = (p.to_local() if isinstance(p, DTensor) else p for p in self.parameters())
            ignored = {t.untyped_storage().data_ptr() for t in local}
            saved: dict[int, tuple[Any, int]] = {}  # data_ptr -> (storage, block index; -1 outside the blocks)
            current = [-1]
            handles = []
            for i, block in enumerate(self.model.blocks):
                handles.append(block.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
                handles.append(block.register_forward_hook(lambda m, a, o: current.__setitem__(0, -1)))

            def pack(t: torch.Tensor) -> torch.Tensor:
                storage = t.untyped_storage()
                if storage.data_ptr() not in ignored:
                    saved[storage.data_ptr()] = (storage, current[0])
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = self._loss(x, y)
            per_block = [0] * (len(self.model.blocks) + 1)
            for storage, block in saved.values():
                per_block[block] += storage.nbytes()  # index -1: outside the blocks
            self.activations = {"per_block": per_block[:-1], "outside": per_block[-1]}
            for handle in handles:
                handle.remove()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def strategy_of(name: str) -> Any:
        kind, shard, checkpointing, _ = CONFIGS[name]
        if kind == "ddp":
            return "ddp"
        if kind == "lightning":
            return ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
        return HybridParallelStrategy(tensor_parallel_size=1, data_parallel_shard_size=shard,
                                      activation_checkpointing=checkpointing)

    rank = int(os.environ["RANK"])
    tokens = torch.randint(0, 256, (job["steps"] * WORLD * batch, seq + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)
    results = []
    for name in job["configs"]:
        pl.seed_everything(0, verbose=False)
        compression = [GradientCompression(bits=BITS[name], warmup_steps=0)] if name in BITS else []
        trainer = pl.Trainer(accelerator="cpu", devices=WORLD // job["nodes"], num_nodes=job["nodes"],
                             strategy=strategy_of(name), max_steps=job["steps"], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, callbacks=compression)
        meta = CONFIGS[name][3]
        with trainer.init_module(empty_init=True) if meta else torch.device("cpu"):
            module = BenchLM(hand_fsdp=CONFIGS[name][0] == "lightning", count_activations=job["activations"])
        trainer.fit(module, data)
        steps = torch.tensor(module.step_s)
        torch.distributed.all_reduce(steps, op=torch.distributed.ReduceOp.MAX)  # a step ends on its last rank
        local = [t.to_local() if isinstance(t, DTensor) else t for p in module.parameters() for t in (p, p.grad)
                 if t is not None]
        local += [t for state in trainer.optimizers[0].state.values() for t in state.values()
                  if torch.is_tensor(t) and t.dim()]
        local = [t.to_local() if isinstance(t, DTensor) else t for t in local]
        results.append(dict(config=name, states_mib=sum(t.numel() * t.element_size() for t in local) / MIB,
                            fit_start_mib=(module.fit_start_kib - base_kib) / 1024,
                            peak_mib=(_status_kib("VmHWM") - base_kib) / 1024, step_s=steps.tolist(),
                            activations=module.activations, load=os.getloadavg()[0],
                            params=sum(p.numel() for p in module.parameters()),
                            rs_bytes=[compression[0].hook_state.bytes_sent, compression[0].hook_state.bytes_fp32]
                            if compression else None))
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps(results))


# ---------------------------------------------------------------------------------------------------- the parent
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _available_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    raise RuntimeError("MemAvailable not in /proc/meminfo")


def launch(configs: list[str], size: tuple, steps: int, timeout: float, cap_gib: float = 14.0,
           activations: bool = False, bed: Any = None) -> tuple[str, list[list[dict]], float]:
    """Run ``configs`` on 4 fresh ranks; return (outcome, each rank's results, peak summed RSS in GiB). Outcome:
    ``ok``, ``memory cap``, ``machine low on memory``, ``timeout`` or ``exit <codes>``; the ranks are killed on any
    but the first."""
    out = tempfile.mkdtemp(prefix="lds-fsdp-")
    job = dict(configs=configs, size=list(size), steps=steps, activations=activations, out=out,
               nodes=2 if bed is not None else 1)
    argv = [sys.executable, __file__, "--worker", json.dumps(job)]
    port = 29671 if bed is not None else _free_port()
    procs = []
    for rank in range(WORLD):
        node, local = divmod(rank, 2) if bed is not None else (0, rank)
        env = dict(MASTER_ADDR=bed.ip(0) if bed is not None else "127.0.0.1", MASTER_PORT=str(port),
                   RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(local), NODE_RANK=str(node),
                   PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        if MMAP_THRESHOLD[0]:  # a fixed threshold: glibc unmaps every freed large block (see the module docstring)
            env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD[0])
        if bed is not None:
            env["LDS_TOPOLOGY"] = "0,1;2,3"
            procs.append(subprocess.Popen(bed.command(node, argv, env), cwd=ROOT, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE))
        else:
            procs.append(subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE))
    outcome, peak_kib, deadline = "ok", 0, time.time() + timeout
    stderr_tails = []
    try:
        while any(p.poll() is None for p in procs):
            total = sum(_rss_kib(p.pid) for p in procs)
            peak_kib = max(peak_kib, total)
            if total > cap_gib * 2 ** 20:
                outcome = "memory cap"
                break
            if _available_kib() < 2 * 2 ** 20:  # others' work counts too: the trial says so, and stops
                outcome = "machine low on memory"
                break
            if time.time() > deadline:
                outcome = "timeout"
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            _, err = proc.communicate()
            stderr_tails.append(err.decode(errors="replace")[-1500:])
    codes = [p.returncode for p in procs]
    if outcome == "ok" and any(codes):
        outcome = f"exit {codes}"
        sys.stderr.write(stderr_tails[codes.index(next(c for c in codes if c))])
    results = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)] if outcome == "ok" else []
    shutil.rmtree(out, ignore_errors=True)
    return outcome, results, peak_kib / 2 ** 20


def _by_config(results: list[list[dict]], name: str) -> list[dict]:
    return [r for rank in results for r in rank if r["config"] == name]


def part_memory(args: argparse.Namespace, size: tuple) -> None:
    names = args.configs
    rows = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            outcome, results, _ = launch([name], size, args.steps, args.trial_timeout)
            if outcome != "ok":
                raise SystemExit(f"{name}: {outcome}")
            rows[name].append(results)
    params = rows["ddp"][0][0][0]["params"]
    print(f"GPT n_layer={size[0]} n_embd={size[1]} seq={size[3]} batch={size[4]}/rank: {params / 1e6:.1f}M params "
          f"({params * 4 / MIB:.0f} MiB FP32), AdamW, {args.steps} steps, {WORLD} processes, {args.repeats} runs each, "
          f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD[0] or 'glibc default'}")
    print("| configuration | training memory (MiB, max over ranks) | vs DDP | vs Lightning FSDP2 | "
          "at on_fit_start (MiB) | parameters + gradients + AdamW states (MiB/rank) |\n|---|---|---|---|---|---|")
    median = {name: statistics.median(max(r["peak_mib"] for r in _by_config(run, name)) for run in rows[name])
              for name in names}
    for name in names:
        fit = statistics.median(max(r["fit_start_mib"] for r in _by_config(run, name)) for run in rows[name])
        spread = [max(r["peak_mib"] for r in _by_config(run, name)) for run in rows[name]]
        print(f"| {name} | {median[name]:.0f} ({min(spread):.0f}-{max(spread):.0f}) | "
              f"{median[name] / median['ddp']:.3f}x | {median[name] / median['lightning-fsdp2']:.2f}x | {fit:.0f} | "
              f"{max(r['states_mib'] for r in _by_config(rows[name][0], name)):.0f} |")
    ratio = median["fsdp4"] / median["ddp"]
    print(f"\ntarget: fsdp4 <= 0.35x DDP: {ratio:.3f}x, {'met' if ratio <= 0.35 else 'missed'}")


def part_activations(args: argparse.Namespace, size: tuple) -> None:
    runs = {}
    for name in ("fsdp4", "fsdp4+ac"):
        outcome, results, _ = launch([name], size, args.steps, args.trial_timeout, activations=True)
        if outcome != "ok":
            raise SystemExit(f"{name}: {outcome}")
        runs[name] = max(_by_config(results, name), key=lambda r: sum(r["activations"]["per_block"]))
    none = runs["fsdp4"]
    total = {name: sum(r["activations"]["per_block"]) + r["activations"]["outside"] for name, r in runs.items()}
    blocks = size[0]
    one_block = max(none["activations"]["per_block"])
    budget = total["fsdp4"] / blocks + one_block
    print(f"FSDP-4, GPT n_layer={blocks} n_embd={size[1]} seq={size[3]} batch={size[4]}/rank, one step's forward; "
          f"one block saves {one_block / MIB:.1f} MiB under none")
    print("| checkpointing | saved in blocks (MiB) | outside blocks (MiB) | total (MiB) | vs none | "
          "training memory (MiB) |\n|---|---|---|---|---|---|")
    for name, run in runs.items():
        acts = run["activations"]
        print(f"| {'full' if name.endswith('ac') else 'none'} | {sum(acts['per_block']) / MIB:.1f} | "
              f"{acts['outside'] / MIB:.1f} | {total[name] / MIB:.1f} | {total[name] / total['fsdp4']:.3f} | "
              f"{max(r['peak_mib'] for r in _by_config([[run]], name)):.0f} |")
    met = "met" if total["fsdp4+ac"] <= budget else "missed"
    print(f"\ntarget: full <= none/{blocks} + one block = {budget / MIB:.1f} MiB: {total['fsdp4+ac'] / MIB:.1f} MiB, "
          f"{met}")


def _trial(name: str, n_layer: int, size: tuple, args: argparse.Namespace, params: dict[int, int]) -> bool:
    """One trial of ``--part largest``: prints its row, records its parameter count; whether it trained."""
    if n_layer > args.max_layers:
        print(f"| {name} | {n_layer} | - | above --max-layers, not run | - |", flush=True)
        return False
    for _ in range(2):  # a trial stopped by others' memory use is run once more, after a pause
        outcome, results, peak = launch([name], (n_layer, *size[1:]), args.largest_steps, args.trial_timeout,
                                        args.cap_gib)
        if outcome != "machine low on memory":
            break
        time.sleep(30)
    if outcome == "ok":
        params[n_layer] = results[0][0]["params"]
    shown = f"{params[n_layer] / 1e6:.0f}" if n_layer in params else "-"
    print(f"| {name} | {n_layer} | {shown} | {outcome} | {peak:.1f} |", flush=True)
    return outcome == "ok"


def part_largest(args: argparse.Namespace, size: tuple) -> None:
    print(f"GPT n_embd={size[1]} seq={size[3]} batch={size[4]}/rank, n_layer searched; AdamW, {args.largest_steps} "
          f"steps; each trial killed at {args.cap_gib} GiB summed RSS or {args.trial_timeout:.0f} s")
    print("| configuration | n_layer | params (M) | outcome | peak summed RSS (GiB) |\n|---|---|---|---|---|")
    best = {}
    for name in ("ddp", "fsdp4+ac"):
        # Sharding's search starts at 4x DDP's largest (the target), then doubles or bisects from there.
        passed, failed, n_layer = 0, None, args.start_layers if name == "ddp" else 4 * best["ddp"][0]
        params: dict[int, int] = {}
        upper: int | None = None
        while failed is None:  # doubling (halving while the first guess fails)
            if _trial(name, n_layer, size, args, params):
                passed, n_layer = n_layer, n_layer * 2
            elif passed == 0 and n_layer > 1:
                upper, n_layer = n_layer, n_layer // 2
                continue
            else:
                failed = n_layer
            if passed and upper is not None and n_layer >= upper:
                failed = upper
        while failed - passed > max(1, passed // 8):  # bisection, to 1/8 of the last pass
            middle = (passed + failed) // 2
            if _trial(name, middle, size, args, params):
                passed = middle
            else:
                failed = middle
        best[name] = (passed, params.get(passed, 0))
    ratio = best["fsdp4+ac"][1] / max(best["ddp"][1], 1)
    print(f"\nlargest: DDP n_layer={best['ddp'][0]} ({best['ddp'][1] / 1e6:.0f}M), FSDP-4 + full checkpointing "
          f"n_layer={best['fsdp4+ac'][0]} ({best['fsdp4+ac'][1] / 1e6:.0f}M): {ratio:.2f}x the parameters; "
          f"target >= 4x: {'met' if ratio >= 4 else 'missed'}")


def part_step_time(args: argparse.Namespace, size: tuple, names: tuple[str, ...] = ("ddp", "fsdp4", "hsdp2x2"),
                   ) -> list[list[dict]]:
    """Step time of ``names`` (the first the baseline), trained interleaved in one set of 4 ranks."""
    from contextlib import nullcontext

    from benchmarks.testbed import Testbed

    k = len(names)
    order = [n for repeat in range(args.repeats) for n in names[repeat % k:] + names[:repeat % k]]
    bed = Testbed(num_hosts=2, rate=args.rate, prefix=args.prefix, subnet=args.subnet) if args.testbed else None
    with bed if bed is not None else nullcontext():
        outcome, results, _ = launch(order, size, args.steps + 2, args.trial_timeout * 2, bed=bed)
    if outcome != "ok":
        raise SystemExit(f"step time: {outcome}")
    per_run = {n: [statistics.median(r["step_s"][2:]) for r in results[0] if r["config"] == n] for n in names}
    loads = [r["load"] for r in results[0]]
    link = f"testbed 2 x 2, {args.rate}" if bed is not None else "loopback"
    print(f"{link}; GPT n_layer={size[0]} n_embd={size[1]} seq={size[3]} batch={size[4]}/rank, AdamW; "
          f"{args.repeats} interleaved runs x {args.steps} steps (after 2 warm-up); load {min(loads):.1f}-"
          f"{max(loads):.1f} on {os.cpu_count()} CPUs")
    print(f"| configuration | step time vs {names[0]} (median of runs) | spread over runs |\n|---|---|---|")
    for name in names:
        ratios = [a / b for a, b in zip(per_run[name], per_run[names[0]])]
        print(f"| {name} | {statistics.median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f}x |")
    return results


def part_compression(args: argparse.Namespace, size: tuple) -> None:
    """FSDP-4's reduce-scatter in fp32, int8 and int4: step time (interleaved) and the bytes sent per step."""
    results = part_step_time(args, size, ("fsdp4", "fsdp4+int8", "fsdp4+int4"))
    print("\n| configuration | reduce-scatter bytes sent per rank and step | vs fp32 |\n|---|---|---|")
    for name in BITS:
        sent, fp32 = _by_config(results, name)[0]["rs_bytes"]
        if name == "fsdp4+int8":
            print(f"| fsdp4 (fp32) | {fp32:,} | 1.000x |")
        print(f"| {name} | {sent:,} | {sent / fp32:.3f}x |")


PARTS = {"memory": part_memory, "activations": part_activations, "largest": part_largest,
         "step-time": part_step_time, "compression": part_compression}


def main() -> None:
    from benchmarks.testbed import add_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=(*PARTS, "all"), default="all")
    parser.add_argument("--smoke", action="store_true", help="tiny models (seconds per configuration)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per configuration")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration (memory, step-time)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS),
                        help="configurations of --part memory (ddp and lightning-fsdp2 among them)")
    parser.add_argument("--largest-steps", type=int, default=2)
    parser.add_argument("--start-layers", type=int, default=4, help="n_layer of DDP's first trial (--part largest)")
    parser.add_argument("--max-layers", type=int, default=512, help="n_layer not tried above (--smoke: 4)")
    parser.add_argument("--cap-gib", type=float, default=14.0, help="summed RSS of a trial's 4 processes")
    parser.add_argument("--trial-timeout", type=float, default=600.0, help="seconds per set of 4 processes")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=65536,
                        help="glibc's MALLOC_MMAP_THRESHOLD_ in the ranks (0: glibc's default, a dynamic one)")
    add_arguments(parser, prefix="ldsf", subnet="10.213.41")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    MMAP_THRESHOLD[0] = args.malloc_mmap_threshold
    if args.smoke:
        args.max_layers = min(args.max_layers, 4)
    for part in PARTS if args.part == "all" else [args.part]:
        print(f"\n## {part}\n")
        PARTS[part](args, (SMOKE if args.smoke else SIZES)[part])


if __name__ == "__main__":
    main()
