"""The emulated cluster: ranks in network namespaces on one machine, joined by a bridge, their links shaped with
``tc``. Two shapes of cluster:

    # machines as they are built: 2 nodes of 4 ranks, each node one NIC of 800 Mbit/s that its 4 ranks share
    with EmulatedNodes(nodes=2, ranks_per_node=4, nic_mbit=800) as cluster:
        procs = [cluster.popen(r, [sys.executable, "-m", "benchmarks.worker", ...]) for r in range(8)]

    # one namespace per rank, each rank its own link (the single-node bench)
    with EmulatedCluster(world_size=2, rate_mbit=500) as cluster:
        cluster.set_rate(1000)                       # re-shape every link in place

``EmulatedNodes`` (``commfuse-dp bench --num-machines N --nic-gbps R``): one namespace per node.

- Node j is namespace ``cf<id>n<j>``. Its ranks ``[j·M, (j+1)·M)`` (M = ``ranks_per_node``, local rank l = r - j·M)
  all run in it and reach each other over its loopback: an address of the node's own stays on ``lo``, however many
  NICs it has. Unshaped by default (NVLink or a node's own fabric); ``intra_mbit`` caps ``lo`` with ``tbf``, one
  cap that every byte between the node's ranks crosses once, in either direction (a PCIe-only node, its ranks
  sharing the switch).
- A node has K = ``nics_per_node`` NICs (rails): NIC k of node j is ``eth<k>`` in its namespace, address
  ``198.18.k.(j+1)/24`` (198.18.0.0/15 is reserved for benchmarking; nothing else is addressed), a veth whose other
  end sits on the one bridge ``cf<id>nb``. Each NIC is shaped to R in both directions: ``tbf`` on ``eth<k>`` (what
  the node sends) and on its bridge end (what it receives, so several nodes sending to one cannot exceed R: incast).
- Local rank l uses NIC l % K: ``popen`` sets ``GLOO_SOCKET_IFNAME=eth<l % K>``, and gloo binds to that NIC's
  address, which ``address(rank)`` gives. **What a rank gets towards other nodes: R / (M / K) Mbit/s when all the
  node's ranks send at once** (``inter_mbit_per_rank``), up to R when it sends alone. One NIC for 8 ranks is 100 GbE
  shared by 8 GPUs (1.56 GB/s a GPU); K = M is one NIC per GPU (cloud H100 nodes: 8 x 400 Gb).
- Routing with K > 1: a packet leaves by the NIC of its source address (``ip rule from 198.18.k.(j+1)`` to a table
  whose one route is ``198.18.0.0/15 dev eth<k>``), and every NIC reaches every other on the bridge, so a flat ring
  that crosses rails still routes. Each NIC answers ARP only for its own address (``arp_ignore=1``,
  ``arp_announce=2``), and reverse-path filtering is off (a packet of rail 0 may arrive on rail 1). Ranks of one
  local rank on different nodes talk over their rail. Across rails, a socket bound to its NIC's address sends by
  that NIC; one that binds no address gets the address of the NIC on the peer's subnet and sends by the
  destination's rail. gloo's connections do the latter on one side: in a flat gloo ring of 2 nodes x 2 ranks with 2
  NICs, rank 1's (``eth1``) bytes to rank 2 (``eth0``) left node 0 by ``eth0``, as NCCL's PXN sends by the NIC of
  the peer's rail.
- ``popen`` also sets what a launcher sets: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``GROUP_RANK`` (the node). ``set_rate`` re-shapes every NIC in place.

``EmulatedCluster`` (the single-node bench, and ``tests/test_multinode.py``'s two machines of one NIC each):

- Rank r lives in namespace ``cf<id>r<r>`` with address 198.18.0.<r+1>/24 on a veth whose other end sits on the
  bridge ``cf<id>br``. Each rank's egress is shaped to R (both directions of its link: the ring sends to ``next`` and
  receives from ``prev`` at once). ``GLOO_SOCKET_IFNAME=eth0`` makes gloo use the shaped link. Several processes
  started in one namespace share its link (its egress) and talk over its loopback.
- ``nodes=K`` (``commfuse-dp bench --num-machines K --inter-fraction F``): ranks ``[k·n, (k+1)·n)`` form node k (n = world /
  K), and each rank's egress has two link classes (``tc htb``, classified by destination address): to ranks of its
  own node at R, to ranks of other nodes at ``R · inter_fraction``. Each rank has its own inter-node link (one NIC
  per rank) and the two classes do not share a cap.

Both:

- MTU 65000 on every veth and on the bridge: with 1500-byte packets the kernel's per-packet work stole the cores
  from compute. The ``tbf`` burst (default 128 KiB, two such packets at least) is the credit a link gathers while
  idle and then sends above its rate; at 1 MB (the default before) it gave gappy schedules (lockstep) whole hops
  for free at 4 ranks, which no real link does.
- Needs root (``ip netns``, ``tc``). Everything is torn down on exit, on an exception, and on SIGINT/SIGTERM; every
  ``ip``/``tc`` command is bounded in time.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Sequence

SUBNET_PREFIX = "198.18.0."
COMMAND_TIMEOUT_S = 30.0  # one ip/tc command; they take milliseconds


def _run(*cmd: str) -> None:
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"emulated cluster: `{' '.join(cmd)}` took over {COMMAND_TIMEOUT_S:g}s") from None
    if result.returncode != 0:
        raise RuntimeError(f"emulated cluster: `{' '.join(cmd)}` failed: {result.stderr.strip()}")


def _quiet(*cmd: str) -> None:
    """A teardown command: its failure (already gone) is no error."""
    try:
        subprocess.run(cmd, capture_output=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass


# what the clusters below name: cf<the creating process's id mod 100000> and a suffix
_OURS = re.compile(r"^cf(\d+)(?:br|nb|r\d+|v\d+|n\d+(?:k\d+)?)$")


def remove_stale() -> list[str]:
    """Namespaces and links left by an emulated cluster whose process ended without its teardown (killed by
    SIGKILL): removed; returns their names. One whose tag matches a live process is left alone."""
    live = {int(p) % 100000 for p in os.listdir("/proc") if p.isdigit()}
    found = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    for kind, names in (("link", [line.split(":")[1].strip().split("@")[0] for line in links.stdout.splitlines()
                                  if line.count(":") >= 2]),
                        ("netns", [line.split()[0] for line in netns.stdout.splitlines() if line.strip()])):
        for name in names:
            match = _OURS.match(name)
            if match and int(match.group(1)) not in live:
                _quiet("ip", kind, "del", name)
                found.append(name)
    return found


def _check_rate(name: str, mbit: float) -> None:
    if not mbit > 0:
        raise ValueError(f"{name}={mbit}: a link's rate must be above 0 Mbit/s")


class _Namespaces:
    """What both clusters share: root, the signal handlers, and teardown of ``self.namespaces``, the veths of
    ``self._host_ends()`` and ``self.bridge``."""

    namespaces: list[str]
    bridge: str

    def _host_ends(self) -> list[str]:
        raise NotImplementedError

    def __init__(self) -> None:
        if os.geteuid() != 0:
            raise RuntimeError("the emulated cluster needs root (ip netns, tc); run the benchmark as root")
        self._up = False
        self._old_handlers: dict[int, object] = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        remove_stale()  # (a cluster killed before its teardown: its namespaces, veths and bridge)
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
        raise NotImplementedError

    def _add_bridge(self, mtu: int) -> None:
        self._up = True
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "mtu", str(mtu), "up")

    def teardown(self) -> None:
        if not self._up:
            return
        self._up = False
        # A namespace's veths go with it, but only once the kernel has destroyed it, later; deleting one end of a
        # pair deletes both at once.
        for host_end in self._host_ends():
            _quiet("ip", "link", "del", host_end)
        for ns in self.namespaces:
            _quiet("ip", "netns", "del", ns)
        _quiet("ip", "link", "del", self.bridge)


class EmulatedCluster(_Namespaces):
    """One namespace per rank, each rank's link its own (see the module docstring)."""

    def __init__(self, world_size: int, rate_mbit: float, *, mtu: int = 65000, burst_bytes: int = 128 << 10,
                 nodes: int = 1, inter_fraction: float = 0.25) -> None:
        super().__init__()
        if not 1 <= world_size <= 200:
            raise ValueError(f"world_size={world_size}: must be between 1 and 200")
        if nodes < 1 or world_size % nodes:
            raise ValueError(f"nodes={nodes}: must divide world_size={world_size} (ranks per node alike)")
        if not 0 < inter_fraction <= 1:
            raise ValueError(f"inter_fraction={inter_fraction}: must be in (0, 1]")
        _check_rate("rate_mbit", rate_mbit)
        self.world_size, self.mtu, self.burst = world_size, mtu, burst_bytes
        self.nodes, self.inter_fraction = nodes, inter_fraction
        self.rate_mbit = rate_mbit
        tag = f"{os.getpid() % 100000}"
        self.bridge = f"cf{tag}br"
        self.namespaces = [f"cf{tag}r{r}" for r in range(world_size)]
        self.host_ends = [f"cf{tag}v{r}" for r in range(world_size)]

    def _host_ends(self) -> list[str]:
        return self.host_ends

    def address(self, rank: int) -> str:
        return f"{SUBNET_PREFIX}{rank + 1}"

    def _build(self) -> None:
        self._add_bridge(self.mtu)
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
        _check_rate("rate_mbit", rate_mbit)
        self.rate_mbit = rate_mbit
        for rank, ns in enumerate(self.namespaces):
            tc = ("ip", "netns", "exec", ns, "tc")
            if self.nodes == 1:
                _run(*tc, "qdisc", "replace", "dev", "eth0", "root", "tbf",
                     "rate", f"{rate_mbit}mbit", "burst", str(self.burst), "latency", "400ms")
                continue
            _quiet(*tc, "qdisc", "del", "dev", "eth0", "root")
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


class EmulatedNodes(_Namespaces):
    """``nodes`` namespaces of ``ranks_per_node`` ranks each; a node's ranks share its ``nics_per_node`` NICs of
    ``nic_mbit`` Mbit/s each towards other nodes and talk among themselves over its loopback (unshaped, or capped at
    ``intra_mbit`` for all of them together). The module docstring says how it is built."""

    def __init__(self, nodes: int, ranks_per_node: int, nic_mbit: float, *, nics_per_node: int = 1,
                 intra_mbit: float | None = None, mtu: int = 65000, burst_bytes: int = 128 << 10) -> None:
        super().__init__()
        if not 1 <= nodes <= 254:
            raise ValueError(f"nodes={nodes}: must be between 1 and 254 (node j is host j+1 of each NIC's /24)")
        if ranks_per_node < 1 or nodes * ranks_per_node > 1024:
            raise ValueError(f"ranks_per_node={ranks_per_node}: must be at least 1, and at most 1024 ranks in all")
        if not 1 <= nics_per_node <= 64 or ranks_per_node % nics_per_node:
            raise ValueError(f"nics_per_node={nics_per_node}: must divide ranks_per_node={ranks_per_node}, so that "
                             f"every NIC carries as many ranks")
        _check_rate("nic_mbit", nic_mbit)
        if intra_mbit is not None:
            _check_rate("intra_mbit", intra_mbit)
        self.nodes, self.ranks_per_node, self.nics_per_node = nodes, ranks_per_node, nics_per_node
        self.world_size = nodes * ranks_per_node
        self.nic_mbit, self.intra_mbit, self.mtu, self.burst = nic_mbit, intra_mbit, mtu, burst_bytes
        tag = f"{os.getpid() % 100000}"
        self.bridge = f"cf{tag}nb"
        self.namespaces = [f"cf{tag}n{j}" for j in range(nodes)]
        # the bridge end of NIC k of node j
        self.host_ends = [[f"cf{tag}n{j}k{k}" for k in range(nics_per_node)] for j in range(nodes)]

    def _host_ends(self) -> list[str]:
        return [end for ends in self.host_ends for end in ends]

    @property
    def rate_mbit(self) -> float:
        """The rate swept (``set_rate``): each NIC's."""
        return self.nic_mbit

    @property
    def inter_mbit_per_rank(self) -> float:
        """What each rank gets towards other nodes when all of its node's ranks send at once."""
        return self.nic_mbit * self.nics_per_node / self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def nic_of(self, rank: int) -> int:
        return self.local_rank(rank) % self.nics_per_node

    def interface(self, rank: int) -> str:
        """The NIC ``rank`` uses, inside its node's namespace."""
        return f"eth{self.nic_of(rank)}"

    def node_address(self, node: int, nic: int = 0) -> str:
        return f"198.{18 + nic // 256}.{nic % 256}.{node + 1}"

    def address(self, rank: int) -> str:
        """The address ``rank``'s gloo binds to (its NIC's); ``address(0)`` serves as the master address."""
        return self.node_address(self.node_of(rank), self.nic_of(rank))

    def _build(self) -> None:
        self._add_bridge(self.mtu)
        conf = "/proc/sys/net/ipv4/conf"
        for j, ns in enumerate(self.namespaces):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            nics = [f"eth{k}" for k in range(self.nics_per_node)]
            for k, (nic, host_end) in enumerate(zip(nics, self.host_ends[j])):
                _run("ip", "link", "add", host_end, "mtu", str(self.mtu), "type", "veth", "peer", "name", nic,
                     "mtu", str(self.mtu), "netns", ns)
                _run("ip", "link", "set", host_end, "master", self.bridge, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.node_address(j, k)}/24", "dev", nic)
            # Rails on one bridge: each NIC answers ARP for its own address only, and a packet may come in by
            # another NIC than the one its reply leaves by (no reverse-path filter).
            writes = [f"echo {value} > {conf}/{dev}/{key}" for dev in ("all", "default", *nics)
                      for key, value in (("rp_filter", 0), ("arp_ignore", 1), ("arp_announce", 2))]
            _run("ip", "netns", "exec", ns, "sh", "-c", " && ".join(writes))
            for k, nic in enumerate(nics):
                _run("ip", "-n", ns, "link", "set", nic, "up")
                if self.nics_per_node > 1:  # a packet leaves by the NIC of its source address
                    table = str(100 + k)
                    _run("ip", "-n", ns, "route", "add", "198.18.0.0/15", "dev", nic, "src",
                         self.node_address(j, k), "table", table)
                    _run("ip", "-n", ns, "rule", "add", "from", f"{self.node_address(j, k)}/32", "lookup", table,
                         "pref", table)
            if self.intra_mbit is not None:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "lo", "root",
                     *self._tbf(self.intra_mbit))
        self.set_rate(self.nic_mbit)

    def _tbf(self, mbit: float) -> tuple[str, ...]:
        return "tbf", "rate", f"{mbit:g}mbit", "burst", str(self.burst), "latency", "400ms"

    def set_rate(self, nic_mbit: float) -> None:
        """Shape every NIC to ``nic_mbit`` Mbit/s each way (``replace``: works on a live cluster)."""
        _check_rate("nic_mbit", nic_mbit)
        self.nic_mbit = nic_mbit
        for ns, host_ends in zip(self.namespaces, self.host_ends):
            for k, host_end in enumerate(host_ends):
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", f"eth{k}", "root",
                     *self._tbf(nic_mbit))
                _run("tc", "qdisc", "replace", "dev", host_end, "root", *self._tbf(nic_mbit))

    def popen(self, rank: int, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` as rank ``rank``, inside its node's namespace, its gloo on its NIC, with the variables a
        launcher sets (``env``'s own of these are replaced)."""
        full_env = dict(os.environ if env is None else env)
        full_env.update(GLOO_SOCKET_IFNAME=self.interface(rank), RANK=str(rank), WORLD_SIZE=str(self.world_size),
                        LOCAL_RANK=str(self.local_rank(rank)), LOCAL_WORLD_SIZE=str(self.ranks_per_node),
                        GROUP_RANK=str(self.node_of(rank)))
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[self.node_of(rank)], *argv], env=full_env,
                                **kwargs)
