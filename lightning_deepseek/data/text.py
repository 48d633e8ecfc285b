"""``TextDataModule``: byte-level language-model data from any text, with a built-in default corpus.

Text is encoded as UTF-8 bytes (vocabulary of 256, no tokenizer to download), written once to a memory-mapped
``uint8`` file in the cache folder, and cut into non-overlapping windows of ``block_size + 1`` bytes. The last
``val_fraction`` of the bytes is validation: the split is deterministic and never shuffled across.
The default corpus is the Python documentation's topic help (``pydoc_data.topics``, ~465 KB of English),
which ships with every CPython, so the example trains with no download.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from typing_extensions import override

from lightning_deepseek.data.corpus import VOCAB_SIZE, DataError, check_splits, default_corpus, read_corpus
from lightning_deepseek.data.loader import LoaderPosition, ResumableDataLoader

__all__ = ["VOCAB_SIZE", "DataError", "TextDataModule", "TokenWindows", "default_corpus", "read_corpus"]

class TokenWindows(Dataset):
    """Non-overlapping ``(input, target)`` windows of a memory-mapped byte array."""

    def __init__(self, tokens: np.ndarray, block_size: int) -> None:
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        chunk = torch.from_numpy(self.tokens[start : start + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class TextDataModule(pl.LightningDataModule):
    """Byte-level text for next-token prediction.

    Args:
        path: a UTF-8 text file or a folder of them; ``None`` uses the built-in corpus.
        block_size: tokens per training sequence.
        batch_size: sequences per micro-batch on each process.
        val_fraction: trailing fraction of the corpus held out for validation.
        cache_dir: where the tokenised array is cached (the run folder in ``lds-train``).
        num_workers: ``DataLoader`` workers.

    Attributes:
        train_sampler: when set (e.g. by ``ElasticTraining``), the training ``DataLoader`` draws its indices from
            this sampler instead of shuffling; the sampler then keeps its own position across a resume.
            Otherwise the training loader is a ``ResumableDataLoader``: a resumed run continues the epoch at
            the next unused batch.
    """

    def __init__(
        self,
        path: str | None = None,
        block_size: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        cache_dir: str | Path = ".",
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise DataError(f"data.val_fraction={val_fraction} must lie strictly between 0 and 1, e.g. 0.1.")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise DataError(f"data.batch_size={batch_size} must be a positive integer.")
        self.path = path
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.cache_dir = Path(cache_dir)
        self.num_workers = num_workers
        self.vocab_size = VOCAB_SIZE
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None
        self.train_sampler: Sampler | None = None
        self.train_position = LoaderPosition()

    def validate(self) -> None:
        """Read the corpus once and check both splits hold a sequence, to fail before any process starts."""
        self._check_splits(len(read_corpus(self.path)))

    def _check_splits(self, num_tokens: int) -> int:
        return check_splits(num_tokens, self.block_size, self.val_fraction)

    @property
    def cache_file(self) -> Path:
        key = hashlib.sha1(str(Path(self.path).expanduser().resolve() if self.path else "<default>").encode())
        return self.cache_dir / f"tokens-{key.hexdigest()[:12]}.u8"

    @override
    def prepare_data(self) -> None:
        if self.cache_file.exists():
            return
        data = read_corpus(self.path)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_file.with_suffix(".tmp")
        np.frombuffer(data, dtype=np.uint8).tofile(tmp)
        tmp.replace(self.cache_file)

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if not self.cache_file.exists():  # a process that did not run prepare_data (e.g. another node)
            self.prepare_data()
        tokens = np.memmap(self.cache_file, dtype=np.uint8, mode="r")
        split = self._check_splits(len(tokens))
        train, val = tokens[:split], tokens[split:]
        self.train_set = TokenWindows(train, self.block_size)
        self.val_set = TokenWindows(val, self.block_size)

    @override
    def train_dataloader(self) -> DataLoader:
        if self.train_sampler is not None:
            return DataLoader(self.train_set, batch_size=self.batch_size, sampler=self.train_sampler,
                              drop_last=True, num_workers=self.num_workers)
        return ResumableDataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
                                   num_workers=self.num_workers, position=self.train_position)

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Runs once per batch the training step uses (Lightning fetches one ahead): the loader's resume position.
        if self.trainer is not None and self.trainer.training:
            self.train_position.consumed += 1
        return batch

    @override
    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, drop_last=False,
                          num_workers=self.num_workers)
