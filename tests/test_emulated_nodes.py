"""The emulated nodes (benchmarks/cluster.py, ``EmulatedNodes``): a node's ranks share its NIC, talk among themselves
unshaped, get a NIC each with as many NICs as ranks, reach every rank of a flat ring across rails, and leave nothing
behind. Throughput is measured with plain TCP sockets started as ranks (``cluster.popen``): a sender binds to the
address of the NIC that ``GLOO_SOCKET_IFNAME`` names, as gloo does, and times a few MB up to the receiver's
acknowledgement. The bounds are loose (0.6-1.3x the rate a sender should get); each would fail by about 2x if a rank
had a link of its own, or if a NIC were shared where it is not. Last, what ``commfuse-dp bench --num-machines`` refuses and
what it says a NIC leaves each rank."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from benchmarks.cluster import EmulatedNodes

needs_netns = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                                 reason="the emulated nodes need root and iproute2 (ip, tc)")

NIC_MBIT = 100
MB = 1 << 20

# argv: receive ADDRESS PORT CONNECTIONS | send ADDRESS PORT BYTES START_AT
SOCKETS = textwrap.dedent(r"""
    import fcntl, json, os, socket, struct, sys, threading, time

    def nic_address():  # the address of the interface GLOO_SOCKET_IFNAME names (SIOCGIFADDR), as gloo binds
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        name = os.environ["GLOO_SOCKET_IFNAME"].encode()
        return socket.inet_ntoa(fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name[:15]))[20:24])

    def drain(conn):
        while conn.recv(1 << 20):
            pass
        conn.sendall(b"k")
        conn.close()

    role, address, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if role == "receive":
        server = socket.create_server((address, port), backlog=8)
        print("ready", flush=True)
        threads = []
        for _ in range(int(sys.argv[4])):
            threads.append(threading.Thread(target=drain, args=(server.accept()[0],)))
            threads[-1].start()
        for t in threads:
            t.join()
    else:
        size, start_at = int(sys.argv[4]), float(sys.argv[5])
        conn = socket.create_connection((address, port), timeout=60, source_address=(nic_address(), 0))
        payload = memoryview(bytes(1 << 20))
        time.sleep(max(0.0, start_at - time.time()))
        began = time.time()
        for offset in range(0, size, len(payload)):
            conn.sendall(payload[:min(len(payload), size - offset)])
        conn.shutdown(socket.SHUT_WR)
        assert conn.recv(1) == b"k"
        ended = time.time()
        env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                          "GLOO_SOCKET_IFNAME")}
        print(json.dumps({"began": began, "ended": ended, "bytes": size, "source": conn.getsockname()[0], **env}))
""")


def _transfer(cluster: EmulatedNodes, pairs: list[tuple[int, int]], size: int) -> list[dict]:
    """Each (sender, receiver) rank pair moves ``size`` bytes, all senders starting together; a record per sender."""
    port = 20000 + os.getpid() % 20000
    receivers = {}
    for dst in sorted({d for _, d in pairs}):
        count = sum(1 for _, d in pairs if d == dst)
        proc = cluster.popen(dst, [sys.executable, "-c", SOCKETS, "receive", cluster.address(dst), str(port + dst),
                                   str(count)], stdout=subprocess.PIPE, text=True)
        receivers[dst] = proc
    try:
        for proc in receivers.values():
            assert proc.stdout.readline().strip() == "ready"
        start_at = time.time() + 1.0  # the senders' interpreters start meanwhile
        senders = [cluster.popen(src, [sys.executable, "-c", SOCKETS, "send", cluster.address(dst), str(port + dst),
                                       str(size), str(start_at)], stdout=subprocess.PIPE, text=True)
                   for src, dst in pairs]
        results = []
        for proc in senders:
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0, out
            results.append(json.loads(out))
        for proc in receivers.values():
            assert proc.wait(timeout=30) == 0
        return results
    finally:
        for proc in [*receivers.values()]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _mbit(results: list[dict]) -> float:
    """All senders together: their bytes over the span from the first start to the last acknowledgement."""
    span = max(r["ended"] for r in results) - min(r["began"] for r in results)
    return sum(r["bytes"] for r in results) * 8 / span / 1e6


def _tx_bytes(cluster: EmulatedNodes, node: int) -> dict[str, int]:
    links = json.loads(subprocess.run(["ip", "-n", cluster.namespaces[node], "-j", "-s", "link", "show"],
                                      capture_output=True, text=True, check=True).stdout)
    return {link["ifname"]: link["stats64"]["tx"]["bytes"] for link in links}


def _leftovers(tag: str) -> tuple[list[str], list[str]]:
    """The namespaces and the links of the root namespace that a cluster named ``tag`` (``cf<id>``) made."""
    namespaces = [line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                             text=True).stdout.splitlines() if line.strip()]
    links = [link["ifname"] for link in json.loads(subprocess.run(["ip", "-j", "link", "show"], capture_output=True,
                                                                  text=True, check=True).stdout)]
    return ([n for n in namespaces if re.fullmatch(rf"{tag}n\d+", n)],
            [n for n in links if re.fullmatch(rf"{tag}(n\d+k\d+|nb)", n)])


@needs_netns
@pytest.mark.slow
def test_a_node_s_ranks_share_its_nic():
    with EmulatedNodes(2, 2, NIC_MBIT) as cluster:
        alone = _transfer(cluster, [(0, 2)], 3 * MB)
        both = _transfer(cluster, [(0, 2), (1, 3)], 3 * MB)
    assert [r["source"] for r in both] == ["198.18.0.1", "198.18.0.1"]  # one NIC, both ranks on it
    single, pair = _mbit(alone), _mbit(both)
    slower = min(_mbit([r]) for r in both)
    print(f"NIC {NIC_MBIT / 8000:g} GB/s: one sender {single / 8000:.4g} GB/s; two at once {pair / 8000:.4g} together, "
          f"the slower {slower / 8000:.4g}")
    # One sender alone has the whole NIC; two at once share it: together still about the NIC's rate (with a link
    # each they would reach twice it), so each gets about half.
    assert 0.6 * NIC_MBIT <= single <= 1.3 * NIC_MBIT, (single, alone)
    assert 0.6 * NIC_MBIT <= pair <= 1.3 * NIC_MBIT, (pair, both)
    assert slower <= 0.75 * single, both


@needs_netns
def test_ranks_of_one_node_talk_unshaped():
    with EmulatedNodes(2, 2, NIC_MBIT) as cluster:
        before = _tx_bytes(cluster, 0)
        inside = _transfer(cluster, [(0, 1)], 32 * MB)
        after = _tx_bytes(cluster, 0)
    print(f"NIC {NIC_MBIT / 8000:g} GB/s: between two ranks of one node {_mbit(inside) / 8000:.2f} GB/s")
    assert _mbit(inside) > 10 * NIC_MBIT, inside
    assert after["lo"] - before["lo"] >= 32 * MB and after["eth0"] - before["eth0"] < MB  # on the loopback


@needs_netns
def test_intra_mbit_caps_the_node_s_loopback_for_all_its_ranks():
    with EmulatedNodes(2, 2, NIC_MBIT, intra_mbit=3 * NIC_MBIT) as cluster:
        both_ways = _transfer(cluster, [(0, 1), (1, 0)], 3 * MB)
    print(f"intra cap {3 * NIC_MBIT / 8000:g} GB/s: two ranks of a node sending to each other, "
          f"{_mbit(both_ways) / 8000:.4g} GB/s together")
    assert 0.6 * 3 * NIC_MBIT <= _mbit(both_ways) <= 1.3 * 3 * NIC_MBIT, both_ways  # one cap for both directions


@needs_netns
@pytest.mark.slow
def test_a_nic_per_rank_gives_each_the_whole_rate():
    with EmulatedNodes(2, 2, NIC_MBIT, nics_per_node=2) as cluster:
        both = _transfer(cluster, [(0, 2), (1, 3)], 3 * MB)
        # across rails: rank 1 (NIC 1 of node 0) to rank 2 (NIC 0 of node 1) routes, by rank 1's NIC
        before = _tx_bytes(cluster, 0)
        across = _transfer(cluster, [(1, 2)], 2 * MB)
        after = _tx_bytes(cluster, 0)
    assert [(r["GLOO_SOCKET_IFNAME"], r["source"]) for r in both] == [("eth0", "198.18.0.1"), ("eth1", "198.18.1.1")]
    rates = [_mbit([r]) for r in both]
    print(f"2 NICs of {NIC_MBIT / 8000:g} GB/s: two local ranks at once, {rates[0] / 8000:.4g} and "
          f"{rates[1] / 8000:.4g} GB/s")
    for rate in rates:
        assert 0.6 * NIC_MBIT <= rate <= 1.3 * NIC_MBIT, both
    assert _mbit(both) > 1.4 * NIC_MBIT, both  # one NIC for both would cap them at about NIC_MBIT
    assert across[0]["source"] == "198.18.1.1"
    assert after["eth1"] - before["eth1"] >= 2 * MB and after["eth0"] - before["eth0"] < MB // 2


@needs_netns
def test_popen_sets_what_a_launcher_sets():
    with EmulatedNodes(2, 4, NIC_MBIT, nics_per_node=2) as cluster:
        results = _transfer(cluster, [(6, 1), (5, 0)], 64 << 10)
    assert [{k: r[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                               "GLOO_SOCKET_IFNAME")} for r in results] == [
        {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
         "GLOO_SOCKET_IFNAME": "eth0"},
        {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
         "GLOO_SOCKET_IFNAME": "eth1"}]
    assert [r["source"] for r in results] == ["198.18.0.2", "198.18.1.2"]


GLOO_RING = textwrap.dedent("""
    import datetime, os, torch, torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    mine, theirs = torch.full((1 << 18,), float(rank)), torch.empty(1 << 18)
    for op in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, (rank + 1) % world),
                                      dist.P2POp(dist.irecv, theirs, (rank - 1) % world)]):
        op.wait()
    total = torch.ones(1)
    dist.all_reduce(total)
    print(int(theirs[0].item()), int(total.item()))
    dist.destroy_process_group()
""")


@needs_netns
@pytest.mark.slow
def test_a_flat_gloo_ring_across_rails_routes():
    # ranks 1 -> 2 and 3 -> 0 cross from rail 1 to rail 0
    with EmulatedNodes(2, 2, 2000, nics_per_node=2) as cluster:
        env = {**os.environ, "MASTER_ADDR": cluster.address(0), "MASTER_PORT": str(30000 + os.getpid() % 20000)}
        procs = [cluster.popen(r, [sys.executable, "-c", GLOO_RING], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for r in range(4)]
        outs = []
        try:
            for proc in procs:
                outs.append(proc.communicate(timeout=120)[0])
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert all(proc.returncode == 0 for proc in procs), outs
    assert [out.split()[-2:] for out in outs] == [[str((r - 1) % 4), "4"] for r in range(4)], outs


TEARDOWN_ON_SIGTERM = textwrap.dedent("""
    import time
    from benchmarks.cluster import EmulatedNodes
    try:
        with EmulatedNodes(2, 2, 100, nics_per_node=2, intra_mbit=1000):
            print("up", flush=True)
            time.sleep(60)
    except KeyboardInterrupt:
        print("torn down", flush=True)
""")


@needs_netns
@pytest.mark.slow
def test_teardown_leaves_nothing_behind():
    cluster = EmulatedNodes(3, 2, NIC_MBIT, nics_per_node=2, intra_mbit=500)
    tag = cluster.bridge[:-2]
    with pytest.raises(RuntimeError, match="inside"):
        with cluster:
            namespaces, links = _leftovers(tag)
            assert len(namespaces) == 3 and len(links) == 3 * 2 + 1, (namespaces, links)  # NICs' bridge ends, bridge
            raise RuntimeError("inside")
    assert _leftovers(tag) == ([], [])
    with EmulatedNodes(2, 2, NIC_MBIT):
        pass
    assert _leftovers(tag) == ([], [])
    # SIGTERM to a process holding a cluster
    proc = subprocess.Popen([sys.executable, "-c", TEARDOWN_ON_SIGTERM], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        theirs = f"cf{proc.pid % 100000}"
        assert _leftovers(theirs)[0]
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "torn down"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _leftovers(theirs) == ([], [])


@pytest.mark.parametrize("kwargs,error", [
    (dict(nodes=2, ranks_per_node=3, nic_mbit=100, nics_per_node=2), "must divide ranks_per_node=3"),
    (dict(nodes=2, ranks_per_node=2, nic_mbit=0), "above 0"),
    (dict(nodes=2, ranks_per_node=2, nic_mbit=100, intra_mbit=-1), "intra_mbit=-1"),
    (dict(nodes=255, ranks_per_node=1, nic_mbit=100), "between 1 and 254"),
])
@needs_netns
def test_bad_shapes_are_refused(kwargs, error):
    with pytest.raises(ValueError, match=error):
        EmulatedNodes(**kwargs)


@pytest.mark.parametrize("argv,error", [
    ("--num-machines 2 --num-processes 4", "--num-machines needs --nic-gbps"),
    ("--num-machines 2 --num-processes 4 --nic-gbps 0.1 --inter-fraction 0.25", "not both"),
    ("--num-machines 2 --num-processes 4 --nic-gbps 0.1,0", "every rate must be above 0"),
    ("--num-machines 2 --num-processes 4 --nic-gbps -0.0125", "every rate must be above 0"),
    ("--num-machines 3 --num-processes 4 --nic-gbps 0.1", "--num-machines 3 must divide --num-processes 4"),
    ("--num-machines 2 --num-processes 6 --nic-gbps 0.1 --nics-per-node 2", "--nics-per-node 2 must divide the 3 ranks"),
    ("--num-machines 2 --num-processes 4 --nic-gbps 0.1 --link-gbps 0.0125", "drop --link-gbps"),
    ("--num-machines 2 --num-processes 4 --nic-gbps 0.1 --intra-gbps 0", "--intra-gbps 0"),
    ("--nic-gbps 0.1", "only with --num-machines 2 or more"),
    ("--num-machines 2 --num-processes 4 --inter-fraction 0.25", "needs --link-gbps"),
])
def test_bench_refuses_bad_node_figures_in_one_line(capsys, argv, error):
    from benchmarks import bench

    with pytest.raises(SystemExit) as exit_:
        bench.main(argv.split())
    assert exit_.value.code == 2
    assert error in capsys.readouterr().err.splitlines()[-1]


def test_bench_says_what_a_nic_leaves_each_rank():
    import argparse

    from benchmarks import bench

    args = argparse.Namespace(world_size=8, nodes=2, nics_per_node=2, nic_mbit="800", intra_mbit=None)
    assert bench._share(800, args) == ("each of a node's 4 ranks: 0.1/2 = 0.05 GB/s to other nodes when all send "
                                       "at once (2 NICs, 2 ranks on each), 0.1 alone")  # (800 Mbit/s as tc shapes it)
    assert bench._node_fields(800, args) == {"nodes": 2, "nic_mbit": 800, "nics_per_node": 2, "ranks_per_node": 4,
                                             "inter_mbit_per_rank": 400, "inter_rate_mbit": 400, "intra_mbit": None}


@needs_netns
def test_a_killed_cluster_s_leftovers_are_removed_by_the_next():
    """A cluster whose process was killed before its teardown leaves its namespaces and bridge; the next cluster
    removes them (their tag names a process that has ended) and leaves a live process's alone."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tag = dead.pid % 100000
    live = {int(p) % 100000 for p in os.listdir("/proc") if p.isdigit()}
    assert tag not in live, "the ended process's id came back at once; rerun"
    subprocess.run(["ip", "netns", "add", f"cf{tag}n0"], check=True)
    subprocess.run(["ip", "link", "add", f"cf{tag}nb", "type", "bridge"], check=True)
    try:
        with EmulatedNodes(2, 1, NIC_MBIT) as cluster:
            names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert f"cf{tag}n0" not in names and cluster.namespaces[0] in names
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        assert f"cf{tag}nb" not in links
    finally:
        subprocess.run(["ip", "netns", "del", f"cf{tag}n0"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"cf{tag}nb"], capture_output=True)
