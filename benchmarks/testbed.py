"""Emulated hosts joined by a throttled link: Linux network namespaces, veth pairs and ``tc``.

Needs root. ``Testbed(num_hosts=2, rate="1gbit")`` creates namespaces ``<prefix>0..N-1``, each joined by a veth
pair to a bridge in one "switch" namespace, each host link throttled with a token bucket on both ends.
Ranks inside one namespace talk over its loopback (intra-node, fast); ranks in different namespaces cross the
throttled links (inter-node). Everything is torn down on exit, also on failure. Traffic never leaves the
namespaces this module creates (addresses come from a private /24 that exists only inside them).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


def add_arguments(parser: argparse.ArgumentParser, prefix: str, subnet: str) -> None:
    """The testbed's command-line options: ``--testbed``, ``--rate``, and a namespace prefix and a private /24 that
    each concurrent user of the machine must choose apart (``prefix`` and ``subnet`` are the script's defaults)."""
    parser.add_argument("--testbed", action="store_true", help="2 emulated nodes x 2 ranks over a throttled link")
    parser.add_argument("--rate", default="1gbit", help="the link between the emulated nodes (tc's rate)")
    parser.add_argument("--prefix", default=prefix, help="the testbed's namespace prefix (one per concurrent user)")
    parser.add_argument("--subnet", default=subnet, help="the testbed's private /24 (one per concurrent user)")


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


@contextlib.contextmanager
def workers(timeout: float) -> Iterator[list[subprocess.Popen]]:
    """Collect the worker processes the block starts; on leaving it, wait for them all (``timeout`` seconds in all),
    kill any still running (also when the block or a wait fails), and fail if one exited non-zero."""
    procs: list[subprocess.Popen] = []
    try:
        yield procs
        deadline = time.time() + timeout
        for proc in procs:
            proc.wait(timeout=max(1, deadline - time.time()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: return codes {[p.returncode for p in procs]}")


def available() -> tuple[bool, str]:
    """Whether the testbed can be built here, and why not."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return False, "needs iproute2 (`ip`, `tc`): apt-get install iproute2"
    return True, ""


@dataclass
class Testbed:
    """``num_hosts`` namespaces on a star through a switch namespace; each host link limited to ``rate``.

    Args:
        num_hosts: number of emulated hosts.
        rate: ``tc`` rate of each host's link (for example ``"1gbit"``, ``"10gbit"``).
        prefix: namespace name prefix; use a distinct one per benchmark so that runs never collide.
        subnet: first three octets of the private /24 used inside the namespaces.
        latency: ``tc tbf`` queueing latency.
    """

    num_hosts: int = 2
    rate: str = "1gbit"
    prefix: str = "lds"
    subnet: str = "10.213.7"
    latency: str = "50ms"
    burst: str = "256kb"
    hosts: list[str] = field(default_factory=list, init=False)

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    def ip(self, host: int) -> str:
        return f"{self.subnet}.{host + 1}"

    def iface(self, host: int) -> str:
        return f"{self.prefix}h{host}"

    def __enter__(self) -> Testbed:
        ok, why = available()
        if not ok:
            raise RuntimeError(f"network testbed unavailable: {why}")
        self.down()
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _up(self) -> None:
        _sh("ip", "netns", "add", self.switch)
        _sh("ip", "netns", "exec", self.switch, "ip", "link", "add", "br0", "type", "bridge")
        _sh("ip", "netns", "exec", self.switch, "ip", "link", "set", "br0", "up")
        for h in range(self.num_hosts):
            ns, inside, outside = f"{self.prefix}{h}", self.iface(h), f"{self.prefix}p{h}"
            _sh("ip", "netns", "add", ns)
            self.hosts.append(ns)
            _sh("ip", "link", "add", inside, "netns", ns, "type", "veth", "peer", "name", outside, "netns", self.switch)
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.ip(h)}/24", "dev", inside)
            for cmd in (["ip", "link", "set", inside, "up"], ["ip", "link", "set", "lo", "up"]):
                _sh("ip", "netns", "exec", ns, *cmd)
            _sh("ip", "netns", "exec", self.switch, "ip", "link", "set", outside, "master", "br0")
            _sh("ip", "netns", "exec", self.switch, "ip", "link", "set", outside, "up")
            for netns, dev in ((ns, inside), (self.switch, outside)):
                _sh("ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                    "rate", self.rate, "burst", self.burst, "latency", self.latency)

    def down(self) -> None:
        names = [f"{self.prefix}{h}" for h in range(self.num_hosts)] + [self.switch]
        existing = _sh("ip", "netns", "list", check=False).stdout
        for ns in names:
            if any(line.split()[0] == ns for line in existing.splitlines() if line.strip()):
                _sh("ip", "netns", "del", ns, check=False)
        self.hosts = []

    def command(self, host: int, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
        """``argv`` wrapped to run inside host ``host``; gloo is pinned to that host's interface."""
        env = dict(env or {})
        env.setdefault("GLOO_SOCKET_IFNAME", self.iface(host))
        assigns = [f"{k}={v}" for k, v in env.items()]
        return ["ip", "netns", "exec", f"{self.prefix}{host}", "env", *assigns, *argv]


def run_ranks(argv: list[str], port: int, timeout: float, root: os.PathLike | str, bed: Testbed | None = None) -> None:
    """Run ``argv`` as the ranks of one gloo world, 1 thread each, and wait for them (see :func:`workers`): 2
    processes on loopback, or, with ``bed``, 2 processes in each of its 2 hosts (islands declared ``0,1;2,3``)."""
    # The repository first, then any path the caller set (packages carried to a machine without them).
    pythonpath = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    with workers(timeout) as procs:
        if bed is None:
            for rank in range(2):
                env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "NODE_RANK": "0", "PYTHONPATH": pythonpath,
                       "OMP_NUM_THREADS": "1"}
                procs.append(subprocess.Popen(argv, env=env, cwd=root))
            return
        for rank in range(4):
            node, local = divmod(rank, 2)
            env = dict(MASTER_ADDR=bed.ip(0), MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="4",
                       LOCAL_RANK=str(local), NODE_RANK=str(node), NUM_NODES="2", LDS_TOPOLOGY="0,1;2,3",
                       PYTHONPATH=pythonpath, OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen(bed.command(node, argv, env), cwd=root))


def run_ranks_as_asked(args: argparse.Namespace, argv: list[str], port: int, timeout: float,
                       root: os.PathLike | str) -> None:
    """:func:`run_ranks` on loopback, or with ``--testbed`` (:func:`add_arguments`) in a :class:`Testbed` of the
    asked rate, prefix and subnet, on ``port + 1``."""
    if not args.testbed:
        run_ranks(argv, port, timeout, root)
        return
    with Testbed(num_hosts=2, rate=args.rate, prefix=args.prefix, subnet=args.subnet) as bed:
        run_ranks(argv, port + 1, timeout, root, bed)


def _loopback_rank(rank: int, world: int, port: int, run: Callable[..., None], args: argparse.Namespace,
                   out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run(rank, world, args, out)


def spawn_loopback(run: Callable[..., None], world: int, args: argparse.Namespace, out: os.PathLike | str) -> None:
    """``run(rank, world, args, out)`` on ``world`` spawned processes of one loopback world (``MASTER_*`` set)."""
    import torch.multiprocessing as mp

    from tests.helpers import free_port

    mp.spawn(_loopback_rank, args=(world, free_port(), run, args, str(out)), nprocs=world, join=True)


def spawn_on_testbed(args: argparse.Namespace, argv: list[str], port: int, root: os.PathLike | str) -> None:
    """``argv`` as the 4 ranks of one world, 2 in each of 2 hosts of a :class:`Testbed` at ``args.rate`` (its
    ``--prefix``/``--subnet``), ``RANK``/``WORLD_SIZE``/``MASTER_*`` in the environment, 1 thread each; waits for them
    within ``args.timeout``."""
    with Testbed(num_hosts=2, rate=args.rate, prefix=args.prefix, subnet=args.subnet) as bed:
        with workers(args.timeout) as procs:
            for rank in range(4):
                env = dict(MASTER_ADDR=bed.ip(0), MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="4",
                           PYTHONPATH=str(root), OMP_NUM_THREADS="1")
                procs.append(subprocess.Popen(bed.command(rank // 2, argv, env), cwd=root))
