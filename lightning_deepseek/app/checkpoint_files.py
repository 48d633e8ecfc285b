"""Where ``lds-train``'s checkpoints lie on disk, and whether a file can be one: no torch needed.

``RunCheckpoint`` (``checkpointing.py``) writes ``checkpoints/step-NNNNNNN.ckpt`` (a file, or a DCP folder whose
``meta.pt`` is written last) and points ``checkpoints/last.ckpt`` at the newest; Lightning's SLURM requeue writes
``hpc_ckpt_N.ckpt`` into the run folder. ``lds-train`` and ``lds-sample`` find and vet a ``resume``/``ckpt`` path
with these functions before importing torch; reading the model shape stored inside needs torch and comes after.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

LAST = "last.ckpt"
META = "meta.pt"  # what HybridParallelStrategy writes last into a DCP folder
_PICKLE_PROTOCOL_2_PLUS = b"\x80"  # torch.save's legacy (non-zip) format starts with a pickle PROTO opcode


def is_complete(path: Path) -> bool:
    """A checkpoint file, or a DCP folder whose ``meta.pt`` (written last) is there."""
    return path.is_file() or (path.is_dir() and (path / META).is_file())


def checkpoints_in(folder: Path) -> list[Path]:
    """Complete checkpoints of a run folder (or of its ``checkpoints/``), oldest first."""
    folder = Path(folder)
    found = [p for p in (*folder.glob("checkpoints/step-*.ckpt"), *folder.glob("step-*.ckpt"),
                         *folder.glob("hpc_ckpt_*.ckpt")) if is_complete(p)]
    if not found:  # runs of older versions: only last.ckpt
        found = [p for p in (folder / "checkpoints" / LAST, folder / LAST) if p.exists() and is_complete(p)]
    return sorted(found, key=lambda p: ((p / META) if p.is_dir() else p).stat().st_mtime)


def not_a_checkpoint(path: Path) -> str | None:
    """Why ``path`` (a complete checkpoint per ``is_complete``) cannot be one ``torch.save`` wrote, or ``None``.

    Only the container is looked at (a zip archive, or a legacy pickle): a text file or an image is refused in
    microseconds; whether the content is a Lightning checkpoint of this model is ``checkpoint_model_config``'s
    question (it needs torch)."""
    source = path / META if path.is_dir() else path
    try:
        if zipfile.is_zipfile(source):
            return None
        with open(source, "rb") as f:
            head = f.read(1)
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror})"
    if head == _PICKLE_PROTOCOL_2_PLUS:
        return None
    return f"{path} is not a checkpoint (not a file that torch.save writes)"
