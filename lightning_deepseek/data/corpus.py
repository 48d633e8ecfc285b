"""The corpus of ``TextDataModule``, read and checked without torch (``lds-train`` checks it before importing
torch and Lightning, so that a bad ``data.path`` is reported in about a second)."""

from __future__ import annotations

from pathlib import Path

VOCAB_SIZE = 256
_TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".yaml", ".yml", ".csv", ".tex", ".html", ".xml", ""}


class DataError(ValueError):
    """Bad data input (missing, empty or binary file); the message names ``data.path`` and the fix."""


def default_corpus() -> str:
    """The text of CPython's ``pydoc_data.topics``, topics in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def _read_text_file(path: Path) -> bytes:
    raw = path.read_bytes()
    if b"\x00" in raw[:65536]:
        raise DataError(f"data.path: {path} looks like a binary file (it contains NUL bytes). "
                        "Point data.path at UTF-8 text, or at a folder of .txt files.")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"data.path: {path} is not UTF-8 text ({exc.reason} at byte {exc.start}). "
                        "Convert it to UTF-8, or point data.path at another file.") from None
    return raw


def text_files(path: str | Path) -> list[Path]:
    """The files ``path`` names (itself, or the text files under a folder in sorted order); checks they exist."""
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"data.path={str(path)!r} does not exist. Pass an existing text file or folder, "
                        "or drop data.path to train on the built-in corpus.")
    if not root.is_dir():
        return [root]
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in _TEXT_SUFFIXES)
    if not files:
        raise DataError(f"data.path={str(path)!r} is a folder with no text files (.txt, .md, ...). "
                        "Add text files to it or point data.path at a file.")
    return files


def read_corpus(path: str | Path | None) -> bytes:
    """UTF-8 bytes of ``path`` (a file, or every text file under a folder in sorted order), or the default."""
    if path is None or str(path) == "":
        return default_corpus().encode("utf-8")
    data = b"\n\n".join(_read_text_file(p) for p in text_files(path))
    if not data.strip():
        raise DataError(f"data.path={str(path)!r} is empty. Point data.path at a file with text in it.")
    return data


def check_splits(num_tokens: int, block_size: int, val_fraction: float) -> int:
    """The number of training bytes; raises ``DataError`` unless both splits hold one sequence."""
    split = int(num_tokens * (1 - val_fraction))
    for name, size in (("training", split), ("validation", num_tokens - split)):
        if size <= block_size + 1:
            raise DataError(
                f"data.path: the {name} split has {size} bytes, fewer than one sequence of "
                f"block_size={block_size}. Use more text, a smaller data.block_size, or change "
                f"data.val_fraction={val_fraction}."
            )
    return split
