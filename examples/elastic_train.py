"""Train the example GPT as an elastic job: run it under ``torchrun --nnodes=MIN:MAX`` (or ``lds-elastic``).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 .venv/bin/torchrun --nnodes=1:2 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo --max-restarts=100 \\
        examples/elastic_train.py --run-dir runs/elastic-demo

Start a second copy of that command to grow the job to 2 nodes; stop one with SIGTERM to shrink it.
``--audit-dir`` writes, for every optimizer step, the dataset indices each rank trained on: the evidence,
used by the tests, that no sample is skipped or repeated across resizes. ``--step-sleep`` slows each step
so that resizes happen mid-training in tests and benchmarks.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import Dataset

from lightning_deepseek.data import TextDataModule, read_corpus
from lightning_deepseek.elastic import ElasticStop, ElasticTraining
from lightning_deepseek.models import GPTConfig, LightningGPT


class IndexedWindows(Dataset):
    """A dataset that also returns each sample's index, for the audit."""

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x, y = self.base[index]
        return x, y, index


class AuditedTextData(TextDataModule):
    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if not isinstance(self.train_set, IndexedWindows):
            self.train_set = IndexedWindows(self.train_set)


class AuditedGPT(LightningGPT):
    """``LightningGPT`` that appends audit lines to a per-process file.

    Each line: ``time attempt global_step world_size index...``; ``attempt`` is the rendezvous round's
    ``MASTER_PORT``, shared by the ranks of one round, so a step that was redone after a crash can be told apart.
    """

    def __init__(self, *args, audit_dir: str | None = None, step_sleep: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.audit_dir = audit_dir
        self.step_sleep = step_sleep

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        if self.audit_dir is not None:
            path = Path(self.audit_dir) / f"rank{self.global_rank}-pid{os.getpid()}.txt"
            with open(path, "a") as handle:
                attempt = os.environ.get("MASTER_PORT", "0")
                indices = " ".join(map(str, index.tolist()))
                handle.write(f"{time.time():.6f} {attempt} {self.global_step} {self.trainer.world_size} {indices}\n")
        if self.step_sleep:
            time.sleep(self.step_sleep)
        return super().training_step((x, y), batch_idx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True, help="checkpoints, reports and data cache go here")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--batch-policy", default="accumulate", choices=["accumulate", "micro_batch", "lr"])
    parser.add_argument("--sync-save", action="store_true", help="write checkpoints synchronously")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--corpus-bytes", type=int, default=0, help="train on this prefix of the corpus (0: all)")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--audit-dir", default=None)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(args.seed, verbose=False)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    corpus = read_corpus(None)
    if args.corpus_bytes:
        corpus = corpus[: args.corpus_bytes]
    corpus_file = run_dir / "corpus.txt"
    if not corpus_file.exists():
        tmp = corpus_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(corpus)
        tmp.replace(corpus_file)
    data = AuditedTextData(path=str(corpus_file), block_size=args.block_size, batch_size=args.micro_batch_size,
                           cache_dir=run_dir / f"cache-{os.getpid()}")
    config = GPTConfig(block_size=args.block_size, n_layer=2, n_head=2, n_embd=32)
    model = AuditedGPT(config, learning_rate=3e-3, warmup_steps=5, audit_dir=args.audit_dir,
                       step_sleep=args.step_sleep)
    elastic = ElasticTraining(run_dir / "checkpoints", global_batch_size=args.global_batch_size,
                              checkpoint_every_n_steps=args.checkpoint_every, batch_policy=args.batch_policy,
                              async_save=not args.sync_save, report_path=run_dir / "reports.jsonl",
                              report_every_n_steps=1, seed=args.seed)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=local_world_size, num_nodes=world_size // local_world_size,
        strategy=DDPStrategy(process_group_backend="gloo") if "WORLD_SIZE" in os.environ else "auto",
        max_steps=args.max_steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[elastic],
    )
    try:
        trainer.fit(model, datamodule=data)
    except ElasticStop as stop:
        # The stop checkpoint is complete and Lightning has torn down: skip the interpreter's teardown of torch and
        # Lightning (a second or more of CPU), which the resize's rendezvous would otherwise wait for.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(stop.code)


if __name__ == "__main__":
    main()
