"""Expert parallelism against plain DDP: step time, expert bytes per rank, all-to-all bytes (counted vs formula).

Run: ``.venv/bin/python benchmarks/moe/bench_ep.py [--world 2] [--steps 15] [--repeats 3]`` (loopback, gloo).
In one run, interleaved repetitions of the same MoE GPT (16 routed experts of hidden width 256 per layer, top-2,
d=128, few tokens per micro-batch, so that the expert gradients dominate DDP's traffic) trained with SGD by:
- ``ddp``: plain torch DDP, experts replicated and all-reduced with everything else;
- ``ep``: experts sharded ``ep=world`` (``apply_expert_parallel``), DDP over the rest, experts reduced over their
  replicas (none at ep=world).
Reports the median step time (after 3 warm-up steps) of each, the ratio EP/DDP, expert parameter (+ SGD momentum)
bytes per rank, and the all-to-all bytes one rank sends to others per step, counted at the collective (forward;
the backward's reverse all-to-alls move the same bytes by construction) against the uniform-routing formula.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODEL = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=128, n_routed_experts=16, moe_top_k=2,
             n_shared_experts=1, moe_hidden=256)
MICRO, SEQ = 2, 16


def run(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import lightning_deepseek.parallel.expert as expert
    from lightning_deepseek.models import GPT, GPTConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sent = [0]
    original = expert.all_to_all_single_autograd

    def counting(tensor, output_split_sizes, input_split_sizes, group):  # noqa: ANN001, ANN202
        own = dist.get_group_rank(group, dist.get_rank())
        rows = sum(size for peer, size in enumerate(input_split_sizes) if peer != own)
        sent[0] += rows * tensor[0].numel() * tensor.element_size() if tensor.numel() else 0
        return original(tensor, output_split_sizes, input_split_sizes, group)

    expert.all_to_all_single_autograd = counting
    data = torch.randint(0, 256, (args.steps, MICRO, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    results: dict[str, dict] = {"ddp": {"times": []}, "ep": {"times": []}}
    for _ in range(args.repeats):
        for mode in ("ddp", "ep"):
            torch.manual_seed(0)
            model = GPT(GPTConfig(**MODEL))
            mesh = None
            if mode == "ep":
                mesh = expert.build_expert_mesh("cpu", expert.ExpertParallelDims(world, world))
                expert.apply_expert_parallel(model, mesh)
                ignored = [n for n, p in model.named_parameters() if expert.is_expert_param(p)]
                DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
            ddp = DistributedDataParallel(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            sent[0] = 0
            times = []
            for step in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                x, y = data[step, :, :-1], data[step, :, 1:]
                F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()
                if mesh is not None:
                    expert.reduce_expert_gradients(model.parameters(), mesh)
                optimizer.step()
                optimizer.zero_grad()
                times.append(time.perf_counter() - start)
            results[mode]["times"].append(statistics.median(times[3:]))
            local = [p.to_local() if expert.is_expert_param(p) else p for n, p in model.named_parameters()
                     if "experts." in n]
            results[mode]["expert_bytes"] = 2 * sum(p.numel() * p.element_size() for p in local)  # + momentum
            results[mode]["a2a_bytes_per_step"] = 2 * sent[0] / args.steps  # forward counted, backward the same
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def main() -> None:
    import torch.multiprocessing as mp

    from lightning_deepseek.parallel.expert import all_to_all_bytes
    from tests.helpers import free_port

    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    out = Path("/tmp") / f"bench_ep_{os.getpid()}.json"
    mp.spawn(run, args=(args.world, free_port(), args, str(out)), nprocs=args.world, join=True)
    res = json.loads(out.read_text())
    ddp, ep = (statistics.median(res[m]["times"]) for m in ("ddp", "ep"))
    layers = MODEL["n_layer"]
    formula = layers * all_to_all_bytes(MICRO * SEQ, MODEL["moe_top_k"], MODEL["n_embd"], args.world, 4)
    print(f"world={args.world} ep={args.world} steps={args.steps} repeats={args.repeats} (loopback, gloo, 1 thread)")
    print(f"step time median: ddp {ddp * 1e3:.1f} ms, ep {ep * 1e3:.1f} ms, ep/ddp {ep / ddp:.2f}")
    print(f"per-repeat medians ms: ddp {[round(t * 1e3, 1) for t in res['ddp']['times']]}, "
          f"ep {[round(t * 1e3, 1) for t in res['ep']['times']]}")
    print(f"expert param+momentum bytes per rank: ddp {res['ddp']['expert_bytes']}, ep {res['ep']['expert_bytes']} "
          f"(ratio {res['ep']['expert_bytes'] / res['ddp']['expert_bytes']:.3f}, 1/ep = {1 / args.world:.3f})")
    print(f"all-to-all bytes sent per rank and step: counted {res['ep']['a2a_bytes_per_step']:.0f}, "
          f"uniform-routing formula {formula}")
    out.unlink()


if __name__ == "__main__":
    main()
