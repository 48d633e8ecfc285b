"""Expert load with and without aux-loss-free bias balancing, on the embedded text, through ``lds-train``.

Run: ``.venv/bin/python benchmarks/moe/bench_balance.py [--model moe-tiny] [--steps 300] [--rates 0 1e-3 1e-2]``.
Trains the same model (same seed, one CPU process, no compression) once per ``update_rate`` of
``ExpertLoadBalancing`` (0 = no balancing, the load only logged) and reports, from each run's ``summary.json``,
the expert load imbalance (max over experts of tokens / mean; max and mean over layers) averaged over the last
100 steps and the final validation loss.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def train(model: str, steps: int, rate: float, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "lightning_deepseek.cli", f"model={model}", "trainer.devices=1", "strategy=ddp",
           "compression=none", f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}",
           f"callbacks.expert_balancing.update_rate={rate}", "plot=false", f"hydra.run.dir={run_dir}"]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="moe-tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 1e-3, 1e-2])
    args = parser.parse_args()
    print(f"model={args.model} steps={args.steps} (1 CPU process, lds-train defaults otherwise)")
    print(f"{'update_rate':>11} {'max/mean (max over layers)':>27} {'(mean over layers)':>19} {'val_loss':>9} "
          f"{'tokens/s':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for rate in args.rates:
            summary = train(args.model, args.steps, rate, Path(tmp) / f"rate{rate}")
            worst = next(v for k, v in summary.items() if k.startswith("moe_load_imbalance_max_last"))
            mean = next(v for k, v in summary.items() if k.startswith("moe_load_imbalance_mean_last"))
            print(f"{rate:>11g} {worst:>27.3f} {mean:>19.3f} {summary['val_loss_final']:>9.4f} "
                  f"{summary['tokens_per_s']:>9}")


if __name__ == "__main__":
    main()
