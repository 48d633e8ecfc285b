"""Expert parallelism against plain DDP: step time, expert bytes per rank, all-to-all bytes (counted vs formula),
and node-limited routing's bytes over the slow link.

Run (loopback, gloo): ``.venv/bin/python benchmarks/moe/bench_ep.py [--world 4] [--steps 15] [--repeats 3]``;
on the network testbed (needs root; 2 emulated nodes x 2 ranks joined by ``--rate``, default 1 Gbit; namespaces
``--prefix``, addresses ``--subnet``, unique per concurrent user):
``.venv/bin/python benchmarks/moe/bench_ep.py --testbed [--rate 1gbit] [--prefix ldse --subnet 10.213.41]``. The
islands are declared ``0,1;2,3`` (2 ranks per node) in both. In one run, interleaved repetitions of the same MoE
GPT (16 routed experts of hidden width 256 per layer, top-2, d=128; by default few tokens per micro-batch
(``--micro``), so that the expert gradients dominate DDP's traffic) trained with SGD by:
- ``ddp``: plain torch DDP, experts replicated and all-reduced with everything else;
- ``ep2``: experts sharded over the 2 ranks of a node (``ep=2 x edp=2``: the all-to-all stays inside the node, the
  expert gradients are all-reduced across the nodes over their 2 replicas);
- ``ep4``: experts sharded over all 4 ranks (the all-to-all crosses nodes; no expert all-reduce), flat dispatch (one
  row per (token, expert) pair);
- ``ep4_m1``: ``ep4`` with node-limited routing, each token's experts on one node (``max_islands_per_token=1``);
- ``ep4_island``: ``ep4`` with the per-island dispatch (:mod:`lightning_deepseek.parallel.expert_dispatch`: one row
  per (token, node used), fanned out inside the node), what ``expert_dispatch="auto"`` picks for ep=4 here;
- ``ep4_island_m1``: ``ep4_island`` with ``max_islands_per_token=1``.
(With ``--world 2``: ``ddp`` and ``ep2`` only.) Reports the median step time (after 3 warm-up steps) of each, the
ratio to DDP, expert parameter (+ SGD momentum) bytes per rank, and per rank (mean over the ranks) and step the
all-to-all bytes sent to other ranks and to the other node, counted at the collective (forward sends, and in
backward what the forward received through the differentiable all-to-alls: the reverse exchange), against the
uniform-routing formula (``all_to_all_bytes``, ``cross_island_bytes``; the expected rows crossing per token from
``cross_island_rows``). The exchanges of the split counts (``E`` int64 per layer) are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODEL = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=128, n_routed_experts=16, moe_top_k=2,
             n_shared_experts=1, moe_hidden=256)
SEQ, TOPOLOGY = 16, "0,1;2,3"


def modes(world: int) -> list[str]:
    return ["ddp", "ep2", "ep4", "ep4_m1", "ep4_island", "ep4_island_m1"] if world == 4 else ["ddp", "ep2"]


def _limit(mode: str) -> int | None:
    return 1 if mode.endswith("_m1") else None


def run(rank: int, world: int, args: argparse.Namespace, out: str) -> None:
    """One rank: every mode, interleaved repetitions; rank 0 writes the results to ``out``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import lightning_deepseek.parallel.expert as expert
    import lightning_deepseek.parallel.expert_dispatch as expert_dispatch
    from lightning_deepseek.models import GPT, GPTConfig
    from lightning_deepseek.moe.node_limited import limit_routing
    from lightning_deepseek.parallel.dims import ParallelDims
    from lightning_deepseek.parallel.topology import parse_topology

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    topology = parse_topology(TOPOLOGY if world == 4 else "0,1")
    sent = {"peers": 0, "nodes": 0}
    original = expert.all_to_all_rows  # torch's autograd all-to-all outside a DualPipeV overlap

    def count(ranks: list[int], splits: list[int], row: int) -> None:
        for peer, size in zip(ranks, splits):
            if peer != rank:
                sent["peers"] += size * row
                sent["nodes"] += size * row if topology.island_of(peer) != topology.island_of(rank) else 0

    def counting(tensor, output_split_sizes, input_split_sizes, group):  # noqa: ANN001, ANN202
        ranks = dist.get_process_group_ranks(group)
        row = tensor[0].numel() * tensor.element_size() if tensor.numel() else 0
        count(ranks, input_split_sizes, row)
        if tensor.requires_grad:  # backward sends back the gradients of what each peer sent
            count(ranks, output_split_sizes, row)
        return original(tensor, output_split_sizes, input_split_sizes, group)

    expert.all_to_all_rows = expert_dispatch.all_to_all_single_autograd = counting
    data = torch.randint(0, 256, (args.steps, args.micro, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    results: dict[str, dict] = {mode: {"times": []} for mode in modes(world)}
    for _ in range(args.repeats):
        for mode in modes(world):
            torch.manual_seed(0)
            model = GPT(GPTConfig(**MODEL))
            mesh = None
            if mode != "ddp":
                mesh = ParallelDims(world, ep=2 if mode == "ep2" else 4).build_mesh("cpu")["edp", "ep"]
                layers = expert.apply_expert_parallel(model, mesh)
                if _limit(mode):
                    limit_routing(layers, topology, mesh.mesh.tolist(), 1)
                if "island" in mode:
                    dispatch = expert_dispatch.build_island_dispatch(topology, mesh.mesh.tolist())
                    expert_dispatch.apply_island_dispatch(layers, dispatch)
                ignored = [n for n, p in model.named_parameters() if expert.is_expert_param(p)]
                DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
            ddp = DistributedDataParallel(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            sent.update(peers=0, nodes=0)
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
            counted = torch.tensor([sent["peers"], sent["nodes"]], dtype=torch.float64)
            dist.all_reduce(counted)  # the mean over the ranks
            results[mode]["a2a_bytes_per_step"] = counted[0].item() / world / args.steps
            results[mode]["a2a_cross_node_bytes_per_step"] = counted[1].item() / world / args.steps
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def loopback(args: argparse.Namespace, out: Path) -> None:
    from benchmarks.testbed import spawn_loopback

    spawn_loopback(run, args.world, args, out)


def testbed(args: argparse.Namespace, out: Path) -> None:
    """4 worker processes, 2 in each of 2 network namespaces joined by ``args.rate``."""
    from benchmarks.testbed import spawn_on_testbed

    argv = [sys.executable, __file__, "--worker", "--out", str(out), "--steps", str(args.steps),
            "--repeats", str(args.repeats), "--micro", str(args.micro)]
    spawn_on_testbed(args, argv, 29641, ROOT)


def report(res: dict, args: argparse.Namespace) -> None:
    from lightning_deepseek.parallel.expert import all_to_all_bytes
    from lightning_deepseek.parallel.expert_dispatch import cross_island_bytes, cross_island_rows

    where = f"testbed 2 nodes x 2 ranks, {args.rate}" if args.testbed else f"loopback, {args.world} ranks"
    print(f"{where}; steps={args.steps} repeats={args.repeats} micro-batch={args.micro}x{SEQ} tokens per rank "
          f"(gloo, 1 thread per rank); load: {os.getloadavg()}")
    ddp = statistics.median(res["ddp"]["times"])
    print("| mode | step time (median of repetition medians) | per repetition | / DDP | expert bytes per rank "
          "| all-to-all B/step to other ranks (flat formula) | ... to the other node (formula) "
          "| rows crossing per token and layer (formula) |")
    print("|---|---|---|---|---|---|---|---|")
    tokens, top_k, dim, experts = args.micro * SEQ, MODEL["moe_top_k"], MODEL["n_embd"], MODEL["n_routed_experts"]
    for mode, row in res.items():
        median = statistics.median(row["times"])
        ep = {"ddp": 1, "ep2": 2}.get(mode, 4)
        flat = MODEL["n_layer"] * all_to_all_bytes(tokens, top_k, dim, ep, 4) if "island" not in mode else None
        cross, rows = "0", "0"
        if ep == 4:  # ep4*: the group spans both nodes
            dispatch = "per_island" if "island" in mode else "flat"
            per_layer = cross_island_bytes(tokens, top_k, dim, experts, 2, dispatch, _limit(mode))
            cross = f"{MODEL['n_layer'] * per_layer:,.0f}"
            rows = f"{cross_island_rows(experts, top_k, 2, dispatch, _limit(mode)):.3f}"
        print(f"| {mode} | {median * 1e3:.1f} ms | {' / '.join(f'{t * 1e3:.0f}' for t in row['times'])} ms "
              f"| {median / ddp:.2f}x | {row['expert_bytes']:,} B | {row['a2a_bytes_per_step']:,.0f} "
              f"({'-' if flat is None else f'{flat:,}'}) | {row['a2a_cross_node_bytes_per_step']:,.0f} ({cross}) "
              f"| {rows} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, choices=[2, 4])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro", type=int, default=2, help="sequences per rank and step (of 16 tokens)")
    parser.add_argument("--testbed", action="store_true")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--prefix", default="ldse", help="testbed namespace prefix (unique per concurrent user)")
    parser.add_argument("--subnet", default="10.213.41", help="testbed /24 (unique per concurrent user)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, args.out)
        return
    out = Path(tempfile.mkdtemp(prefix="ldse-")) / "results.json"
    (testbed if args.testbed else loopback)(args, out)
    report(json.loads(out.read_text()), args)


if __name__ == "__main__":
    main()
