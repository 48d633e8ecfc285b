"""Reading what an elastic job did: the audit files of ``examples/elastic_train.py`` and its final weights; the
small corpus the elastic tests train on; the job the end-to-end tests resize and its uninterrupted reference run."""

from __future__ import annotations

import subprocess
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict

from lightning_deepseek.data import read_corpus
from lightning_deepseek.elastic import find_latest
from lightning_deepseek.models import GPTConfig, LightningGPT

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "elastic_train.py"
BLOCK_SIZE = 16
CORPUS_BYTES = 1139  # 64 training windows of 16 bytes: 8 optimizer steps per epoch
# The job of the end-to-end tests (torchrun, SLURM): 6 epochs, so that a resize delayed on a loaded runner still lands
# mid-training; the same options give one reference run for both.
GLOBAL_BATCH, MICRO_BATCH, MAX_STEPS, CHECKPOINT_EVERY = 8, 2, 48, 4
JOB_OPTIONS = dict(max_steps=MAX_STEPS, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH,
                   checkpoint_every=CHECKPOINT_EVERY, corpus_bytes=CORPUS_BYTES)


def write_corpus(path: Path) -> Path:
    """Write the first ``CORPUS_BYTES`` of the built-in corpus to ``path`` (parents created); return ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(read_corpus(None)[:CORPUS_BYTES])
    return path


def script_args(run_dir: Path, **options: object) -> list[str]:
    """Command line of the example training script with ``--key value`` options."""
    args = [str(SCRIPT), "--run-dir", str(run_dir), "--block-size", str(BLOCK_SIZE)]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", str(value)] if value is not True else [f"--{key.replace('_', '-')}"]
    return args


def steps_trained(audit_dir: Path) -> dict[int, dict[str, list]]:
    """For every optimizer step (1-based), what its final attempt trained: ``indices`` and ``world_size``.

    A step trained twice (redone after a crash) keeps the attempt that wrote last; ``attempts`` counts them.
    """
    lines: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    times: dict[tuple[int, str], float] = {}
    for path in audit_dir.glob("rank*.txt"):
        for line in path.read_text().splitlines():
            stamp, attempt, step, world_size, *indices = line.split()
            key = (int(step) + 1, attempt)
            lines[key[0]][attempt] += [(int(world_size), list(map(int, indices)))]
            times[key] = max(times.get(key, 0.0), float(stamp))
    result = {}
    for step, by_attempt in lines.items():
        last = max(by_attempt, key=lambda attempt: times[(step, attempt)])
        entries = by_attempt[last]
        result[step] = {
            "indices": [i for _, batch in entries for i in batch],
            "world_size": sorted({ws for ws, _ in entries}),
            "attempts": len(by_attempt),
        }
    return result


def final_loss(run_dir: Path, num_windows: int = 48) -> float:
    """Loss of the job's newest checkpoint on the first ``num_windows`` training windows of its corpus."""
    info = find_latest(run_dir / "checkpoints")
    assert info is not None, f"no complete checkpoint in {run_dir / 'checkpoints'}"
    model = LightningGPT(GPTConfig(block_size=BLOCK_SIZE, n_layer=2, n_head=2, n_embd=32))
    model_sd, _ = get_state_dict(model, [])
    state = {"model": model_sd}
    dcp.load(state, checkpoint_id=str(info.path), no_dist=True)
    model.load_state_dict(state["model"])
    tokens = np.frombuffer((run_dir / "corpus.txt").read_bytes(), dtype=np.uint8).astype(np.int64)
    windows = torch.from_numpy(tokens[: num_windows * BLOCK_SIZE + 1])
    x = torch.stack([windows[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE] for i in range(num_windows)])
    y = torch.stack([windows[i * BLOCK_SIZE + 1 : (i + 1) * BLOCK_SIZE + 1] for i in range(num_windows)])
    with torch.no_grad():
        logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).item()


@dataclass
class ReferenceRun:
    """An uninterrupted single-process run of the ``JOB_OPTIONS`` job, running in the background."""

    run_dir: Path
    process: subprocess.Popen

    def final_loss(self) -> float:
        """Wait for the run to end (it must succeed); the loss of its final weights (``final_loss``)."""
        assert self.process.wait(timeout=300) == 0, (self.run_dir / "log.txt").read_text()[-3000:]
        return final_loss(self.run_dir)
