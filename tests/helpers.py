"""Run a function on N real gloo processes and collect what each rank returns.

Used by every multi-process test: real ``torch.distributed`` collectives, no mocks. A hung collective
cannot stall the suite: all children are killed after ``timeout`` seconds and the test fails. A rank that dies
without reporting (a signal, a crash in native code) fails the run within a second or two, with every rank's output.

Ranks are forked from one forkserver per test session that has already imported torch, Lightning and this
package: with the "spawn" start method every rank paid ~10 s of imports (on 2 cores) before its first collective.
Forking it is safe: the server never runs a torch op or a collective, so it holds no process group, no OpenMP
pool and no thread but its own (``test_forkserver_is_clean`` checks it), and each rank still starts its own
process group. What the server cannot inherit from the caller at fork time, the caller's current environment
variables, travels with each rank and is applied before anything else runs.

Each rank writes its stdout and stderr to a file of its own (the forkserver's terminal is not pytest's captured
output, so ranks' warnings would flood the CI log); when a run fails, the tail of every rank's output is added to
the failure message.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing import forkserver
from pathlib import Path
from queue import Empty
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the forkserver, then shared by every rank it forks (the package's own ``__init__`` is lazy, so
# its components are named). A name that fails to import is skipped; its ranks import it themselves.
COMPONENTS = ("compression", "data", "elastic", "hpo", "models", "parallel", "precision")
PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "tests.helpers",
           *(f"lightning_deepseek.{name}" for name in COMPONENTS)]


POLL_S = 1.0  # how often a run checks for ranks that died without reporting


def context() -> Any:
    """The forkserver context whose server has preloaded ``PRELOAD`` (started on first use, once per session)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_forkserver() -> None:
    """Start the server now, without waiting for its imports (they run on another core while pytest collects)."""
    context()
    forkserver.ensure_running()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _redirect_output(path: str) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2: C++ and Python alike) to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _output_tails(log_dir: str, world_size: int, chars: int = 6000) -> str:
    tails = []
    for rank in range(world_size):
        try:
            text = open(os.path.join(log_dir, f"rank{rank}.log"), errors="replace").read()
        except OSError:
            continue
        if text.strip():
            tails.append(f"--- rank {rank} output (last {chars} characters) ---\n{text[-chars:]}")
    return "\n".join(tails)


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any,
            environ: dict[str, str], log_dir: str) -> None:
    _redirect_output(os.path.join(log_dir, f"rank{rank}.log"))
    faulthandler.enable()  # a native crash (a segfault, glibc's abort) prints every thread's Python stack to that file
    os.environ.clear()  # the caller's environment now, not the one the forkserver started with
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        dist.barrier()  # a rank whose fn fails at once must not close the group while a peer is still connecting
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the rank
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _dead_ranks(procs: list[Any], results: dict[int, Any]) -> list[str]:
    """Ranks that exited without reporting (killed, or crashed in native code: a segfault, glibc's abort on a
    corrupted heap): named at once, instead of after the run's whole timeout."""
    dead = []
    for rank, proc in enumerate(procs):
        code = proc.exitcode
        if code is not None and code != 0 and rank not in results:
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            dead.append(f"rank {rank} ended by {how} without reporting (its output is below)")
    return dead


def _late_errors(queue: Any, expected: int, wait: float = 3.0) -> list[str]:
    late = []
    for _ in range(max(expected, 0)):
        try:
            rank, status, payload = queue.get(timeout=wait)
        except Exception:  # noqa: BLE001 - queue.Empty: that rank is hung or silent; it is killed below
            break
        if status != "ok":
            late.append(f"rank {rank}:\n{payload}")
    return late


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return results by rank.

    ``fn`` must be a module-level function (it is pickled into the forked processes) and return plain picklable
    data: return ``tensor.tolist()``, not tensors, which travel through shared memory that the exiting child
    may free before the parent reads it.
    """
    ctx = context()
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    log_dir = tempfile.mkdtemp(prefix="lds-ranks-")
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, environ, log_dir))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and not errors:
            try:
                rank, status, payload = queue.get(timeout=POLL_S)
            except Empty:
                if time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout}s waiting for ranks (got {sorted(results)})")
                else:
                    errors += _dead_ranks(procs, results)
                continue
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
    finally:
        if errors:  # the first failure often only echoes another rank's: give the others a moment to report theirs
            errors += _late_errors(queue, world_size - len(results) - 1)
            errors += [dead for dead in _dead_ranks(procs, results) if dead not in errors]
        for proc in procs:
            proc.join(timeout=5 if not errors else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    tails = _output_tails(log_dir, world_size) if errors else ""
    shutil.rmtree(log_dir, ignore_errors=True)
    if errors:
        raise AssertionError("\n".join(errors + ([tails] if tails else [])))
    return [results[r] for r in range(world_size)]


class Background:
    """A command started now and finished later: a test module starts its independent real processes together, so
    that one's imports (~10 s on one core) run while another test uses the other core.

    Its stdout and stderr go to files in ``folder`` (a pipe nobody reads while it runs would fill and block it).
    """

    def __init__(self, args: list[str], folder: Path, **popen_kwargs: Any) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.args, self.out, self.err = args, folder / "stdout.txt", folder / "stderr.txt"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(args, stdout=out, stderr=err, text=True, **popen_kwargs)

    def finish(self, timeout: float = 240) -> subprocess.CompletedProcess:
        """Wait for the exit (killing the command after ``timeout`` seconds); its exit code and output."""
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.kill()
        return subprocess.CompletedProcess(self.args, self.proc.returncode, self.out.read_text(errors="replace"),
                                           self.err.read_text(errors="replace"))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
