"""The emulated links: a star of hosts, shaped by ``tc`` to a rate, measured, and removed without a trace.

Needs root and iproute2 (``tests/cluster/setup.sh``); elsewhere it skips and says why (CI: a failure).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.cluster.hosts import IFACE, Cluster
from tests.cluster.test_launch import need

SERVER = textwrap.dedent("""
    import socket, sys, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 5201)); s.listen(1); s.settimeout(30)
    c, _ = s.accept(); n = 0; t0 = None
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        t0 = t0 or time.monotonic(); n += len(b)
    print(n * 8 / (time.monotonic() - t0) / 1e6)
""")
CLIENT = textwrap.dedent("""
    import socket, sys, time
    for _ in range(100):
        try:
            s = socket.create_connection((sys.argv[1], 5201), timeout=10); break
        except OSError:
            time.sleep(0.1)
    d = b"x" * (1 << 16); t0 = time.monotonic()
    while time.monotonic() - t0 < float(sys.argv[2]):
        s.sendall(d)
    s.close()
""")


def throughput_mbit(c: Cluster, src: int, dst: int, seconds: float = 2.0) -> float:
    """TCP goodput in Mbit/s from host ``src`` to host ``dst`` over ``seconds``."""
    to = c.hosts[dst]
    server = subprocess.Popen(to.command(f"{sys.executable} -c '{SERVER}' {to.addr}"), stdout=subprocess.PIPE,
                              text=True)
    try:
        c.hosts[src].run(f"{sys.executable} -c '{CLIENT}' {to.addr} {seconds}", timeout=60, check=True)
        out, _ = server.communicate(timeout=60)
    finally:
        server.kill()
    return float(out.strip())


def namespaces() -> set[str]:
    d = Path("/run/netns")
    return {p.name for p in d.iterdir()} if d.exists() else set()


@pytest.mark.slow
def test_a_star_of_hosts_is_shaped_to_the_rate_and_unshaped_again(tmp_path):
    need()
    with Cluster(tmp_path, ("a", "b", "c"), ssh=False) as c:
        fast = throughput_mbit(c, 0, 2)
        c.shape(40)
        assert all("tbf" in q and "40Mbit" in q for q in c.qdiscs()), c.qdiscs()
        shaped = throughput_mbit(c, 0, 2)
        # goodput under a 40 Mbit/s bucket: TCP/IP headers take ~3%, the bucket's burst adds a little
        assert 0.85 * 40 < shaped < 1.05 * 40, shaped
        assert 0.85 * 40 < throughput_mbit(c, 2, 1) < 1.05 * 40  # every host's link, both directions
        c.shape(None)
        assert not any("tbf" in q for q in c.qdiscs())
        assert fast > 160 and throughput_mbit(c, 0, 2) > 160  # unshaped veth: Gbit/s
        made = {h.netns for h in c.hosts} | {c.switch}
        assert made <= namespaces()
    assert not made & namespaces()


@pytest.mark.slow
def test_a_failure_inside_the_cluster_leaves_no_namespace_or_qdisc_behind(tmp_path):
    need()
    c = Cluster(tmp_path, ("a", "b", "c", "d"), ssh=False)
    with pytest.raises(RuntimeError, match="boom"), c:
        c.shape(10)
        sleeper = c.hosts[3].start("sleeper", "exec sleep 600")
        made = {h.netns for h in c.hosts} | {c.switch}
        assert made <= namespaces()
        r = c.hosts[0].run(f"ip link show {IFACE}", timeout=10, check=True)
        assert "state UP" in r.stdout
        raise RuntimeError("boom")
    assert not made & namespaces()
    assert sleeper.poll() is not None
