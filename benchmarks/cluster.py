"""The emulated cluster: N ranks in their own network namespaces, joined by a bridge, each link
shaped with ``tc tbf rate R``.

    with EmulatedCluster(world_size=2, rate_mbit=500) as cluster:
        cluster.set_rate(1000)                       # re-shape every link in place
        procs = [cluster.popen(r, [sys.executable, "-m", "benchmarks.worker", ...]) for r in range(2)]

- Rank r lives in namespace ``cf<id>r<r>`` with address 198.18.0.<r+1>/24 (198.18.0.0/15 is reserved for
  benchmarking) on a veth whose other end sits on the bridge ``cf<id>br``. Nothing else is addressed.
- MTU 65000 on every veth and on the bridge: with 1500-byte packets the kernel's per-packet work stole the cores
  from compute. The ``tbf`` burst (default 128 KiB, two such packets at least) is the credit a link gathers while
  idle and then sends above its rate; at 1 MB (the default before) it gave gappy schedules (lockstep) whole hops
  for free at 4 ranks, which no real link does.
- Each rank's egress is shaped to R (both directions of its link: the ring sends to ``next`` and receives from
  ``prev`` at once). ``GLOO_SOCKET_IFNAME=eth0`` makes gloo use the shaped link.
- ``nodes=K`` (``commfuse-dp bench --nodes K``): ranks ``[k·n, (k+1)·n)`` form node k (n = world / K), and each
  rank's egress has two link classes (``tc htb``, classified by destination address): to ranks of its own node at
  R, to ranks of other nodes at ``R · inter_fraction``. Each rank has its own inter-node link (one NIC per rank)
  and the two classes do not share a cap (NVLink and the NIC are separate wires).
- Needs root (``ip netns``, ``tc``). Everything is torn down on exit, on an exception, and on SIGINT/SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence

SUBNET_PREFIX = "198.18.0."


def _run(*cmd: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"emulated cluster: `{' '.join(cmd)}` failed: {result.stderr.strip()}")


class EmulatedCluster:
    def __init__(self, world_size: int, rate_mbit: float, *, mtu: int = 65000, burst_bytes: int = 128 << 10,
                 nodes: int = 1, inter_fraction: float = 0.25) -> None:
        if os.geteuid() != 0:
            raise RuntimeError("the emulated cluster needs root (ip netns, tc); run the benchmark as root")
        if not 1 <= world_size <= 200:
            raise ValueError(f"world_size={world_size}: must be between 1 and 200")
        if nodes < 1 or world_size % nodes:
            raise ValueError(f"nodes={nodes}: must divide world_size={world_size} (ranks per node alike)")
        if not 0 < inter_fraction <= 1:
            raise ValueError(f"inter_fraction={inter_fraction}: must be in (0, 1]")
        self.world_size, self.mtu, self.burst = world_size, mtu, burst_bytes
        self.nodes, self.inter_fraction = nodes, inter_fraction
        self.rate_mbit = rate_mbit
        tag = f"{os.getpid() % 100000}"
        self.bridge = f"cf{tag}br"
        self.namespaces = [f"cf{tag}r{r}" for r in range(world_size)]
        self.host_ends = [f"cf{tag}v{r}" for r in range(world_size)]
        self._up = False
        self._old_handlers: dict[int, object] = {}

    def address(self, rank: int) -> str:
        return f"{SUBNET_PREFIX}{rank + 1}"

    def __enter__(self) -> EmulatedCluster:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame) -> None:
        self.teardown()
        raise KeyboardInterrupt(f"signal {signum}")

    def _build(self) -> None:
        self._up = True
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "mtu", str(self.mtu), "up")
        for rank, (ns, host_end) in enumerate(zip(self.namespaces, self.host_ends)):
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", host_end, "mtu", str(self.mtu), "type", "veth", "peer", "name", "eth0",
                 "mtu", str(self.mtu), "netns", ns)
            _run("ip", "link", "set", host_end, "master", self.bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        self.set_rate(self.rate_mbit)

    def node_of(self, rank: int) -> int:
        return rank // (self.world_size // self.nodes)

    def set_rate(self, rate_mbit: float) -> None:
        """Shape every rank's egress to ``rate_mbit`` Mbit/s, and with nodes its traffic to other nodes to
        ``rate_mbit * inter_fraction`` (``replace``: works on a live cluster)."""
        self.rate_mbit = rate_mbit
        for rank, ns in enumerate(self.namespaces):
            tc = ("ip", "netns", "exec", ns, "tc")
            if self.nodes == 1:
                _run(*tc, "qdisc", "replace", "dev", "eth0", "root", "tbf",
                     "rate", f"{rate_mbit}mbit", "burst", str(self.burst), "latency", "400ms")
                continue
            subprocess.run([*tc, "qdisc", "del", "dev", "eth0", "root"], capture_output=True)
            _run(*tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "10")
            for cls, rate in (("1:10", rate_mbit), ("1:20", rate_mbit * self.inter_fraction)):
                _run(*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", cls, "htb", "rate",
                     f"{rate:g}mbit", "ceil", f"{rate:g}mbit", "burst", str(self.burst), "cburst", str(self.burst))
            for other in range(self.world_size):
                if self.node_of(other) != self.node_of(rank):
                    _run(*tc, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                         "match", "ip", "dst", f"{self.address(other)}/32", "flowid", "1:20")

    def popen(self, rank: int, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside rank ``rank``'s namespace."""
        full_env = dict(os.environ if env is None else env)
        full_env["GLOO_SOCKET_IFNAME"] = "eth0"
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[rank], *argv], env=full_env, **kwargs)

    def teardown(self) -> None:
        if not self._up:
            return
        self._up = False
        for ns in self.namespaces:  # deleting a namespace deletes its veth end, and the pair with it
            subprocess.run(["ip", "netns", "pids", ns], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
