from pathlib import Path

import pytest
import torch

from lightning_deepseek.data import DataError, TextDataModule, read_corpus
from lightning_deepseek.data.text import default_corpus


def test_default_corpus_is_real_english_text() -> None:
    text = default_corpus()
    assert len(text.encode()) > 300_000
    assert "the" in text and "\x00" not in text


def test_split_is_deterministic_and_windows_shift_by_one(tmp_path: Path) -> None:
    dm = TextDataModule(block_size=32, batch_size=4, cache_dir=tmp_path)
    dm.prepare_data()
    dm.setup()
    x, y = dm.train_set[5]
    assert x.shape == y.shape == (32,) and x.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])
    again = TextDataModule(block_size=32, batch_size=4, cache_dir=tmp_path)
    again.setup()
    assert len(again.train_set) == len(dm.train_set) and torch.equal(again.val_set[0][0], dm.val_set[0][0])
    n = len(dm.train_set.tokens) + len(dm.val_set.tokens)
    assert len(dm.val_set.tokens) == n - int(n * 0.9)


def test_folder_of_text_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello " * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("world " * 100)
    (tmp_path / "image.png").write_bytes(b"\x89PNG\x00\x00")
    data = read_corpus(tmp_path)
    assert data.startswith(b"hello") and b"world" in data and b"PNG" not in data


@pytest.mark.parametrize("make, match", [
    (lambda p: p / "missing.txt", "does not exist"),
    (lambda p: (p / "empty.txt").write_text("   \n") and p / "empty.txt", "is empty"),
    (lambda p: (p / "blob.bin").write_bytes(b"abc\x00\x01\x02") and p / "blob.bin", "binary"),
    (lambda p: (p / "latin.txt").write_bytes("caf\xe9".encode("latin-1")) and p / "latin.txt", "not UTF-8"),
    (lambda p: (p / "dir").mkdir() or p / "dir", "no text files"),
])
def test_bad_data_path_names_the_setting(tmp_path: Path, make, match: str) -> None:
    with pytest.raises(DataError, match=match) as info:
        read_corpus(make(tmp_path))
    assert "data.path" in str(info.value)


def test_corpus_shorter_than_a_block(tmp_path: Path) -> None:
    (tmp_path / "short.txt").write_text("just a few words here")
    dm = TextDataModule(path=str(tmp_path / "short.txt"), block_size=64, cache_dir=tmp_path)
    dm.prepare_data()
    with pytest.raises(DataError, match="block_size"):
        dm.setup()
