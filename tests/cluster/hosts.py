"""Emulated hosts on one machine: network namespaces joined through a switch namespace, one sshd per host.

``with Cluster(tmp_path, ["n1", "n2"]) as c:`` gives hosts ``c.hosts[i]`` with a name, an address on the
``dsnv0`` interface (10.77.0.1, 10.77.0.2, ...; the namespaces are private, so clusters of concurrent tests do not
see each other) and:

- ``host.run(cmd, timeout)``: run a shell command "on" the host: in its network namespace, with its hostname and a
  private mount namespace where ``/etc/hosts`` and ``/etc/ssh`` are bind-mounted from the test directory (the
  machine's own files are never written; the bind mounts vanish with the process);
- ``host.start(name, cmd)``: a daemon on the host, stopped (process group, then any process left in the namespace)
  when the cluster closes, also on failure.

Topology: a star, like hosts on one switch. Each host's ``dsnv0`` is one end of a veth pair whose other end
(``port<i>``) sits on a bridge in a third namespace, the switch. ``c.shape(rate_mbit)`` gives every host a full-duplex
NIC of that rate: a token bucket (``tc tbf``) on the host's egress (its transmit side) and one on its switch port's
egress (its receive side); ``c.shape(None)`` removes them. The kernel of this project's machines has no ``netem``,
so no delay is added: the link's own latency (tens of microseconds) stays.

What the launch note (../shared/notes/launch.md) says matters: ``ip netns exec`` remounts /sys (slurmd then dies), so
commands enter with ``nsenter --net`` + ``unshare --mount --uts``; gloo binds to what the host name resolves to, so
/etc/hosts maps every name to its veth address.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

IFACE = "dsnv0"
SSH_PORT = 22


class ClusterUnavailable(Exception):
    """This machine cannot emulate hosts (not root, no namespaces, a tool missing): the reason says which."""


def requirements(*tools: str) -> str | None:
    """Why emulated hosts cannot run here (None when they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, sshd)"
    missing = [t for t in ("ip", "nsenter", "unshare", *tools) if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (CI installs them: see .ci/run)"
    return None


def _sh(cmd: list[str], timeout: int = 30, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise ClusterUnavailable(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


@dataclass
class Host:
    name: str
    addr: str
    netns: str
    root: Path                       # the cluster's directory (shared by all hosts, like an NFS home)
    daemons: list[subprocess.Popen] = field(default_factory=list)

    def command(self, cmd: str) -> list[str]:
        """argv that runs the shell command ``cmd`` on this host (see the module docstring)."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", "unshare", "--mount", "--uts", "--propagation",
                "private", "bash", str(self.root / "enter.sh"), self.name, cmd]

    def run(self, cmd: str, timeout: int = 60, env: dict | None = None, check: bool = False
            ) -> subprocess.CompletedProcess:
        r = subprocess.run(self.command(cmd), capture_output=True, text=True, env=env, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"on {self.name}: {cmd}\nexit {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
        return r

    def start(self, name: str, cmd: str, env: dict | None = None) -> subprocess.Popen:
        log = open(self.root / f"{name}-{self.name}.log", "w")  # noqa: SIM115 (owned by the process)
        p = subprocess.Popen(self.command(cmd), stdout=log, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
        self.daemons.append(p)
        return p


ENTER = r"""#!/bin/bash
# enter.sh HOST CMD: become HOST (hostname, /etc/hosts, /etc/ssh of the test) in a private mount namespace
set -e
host=$1; shift
dir=$(cd "$(dirname "$0")" && pwd)
hostname "$host"
mount --bind "$dir/etc-hosts" /etc/hosts
mount --bind "$dir/etc-ssh" /etc/ssh
exec bash -c "$1"
"""


class Managed:
    """A context manager whose ``close`` also undoes a set-up (``_start``) that failed half-way."""

    def _start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Cluster(Managed):
    """Context manager: N emulated hosts (2 to 200) on one switch (see the module docstring)."""

    def __init__(self, root: Path, names: tuple[str, ...] = ("n1", "n2"), ssh: bool = True) -> None:
        if not 2 <= len(names) <= 200 or len(set(names)) != len(names):
            raise ValueError(f"a cluster needs 2 to 200 distinct host names, not {list(names)}")
        self.root = Path(root)
        self.ssh = ssh
        tag = f"{os.getpid() % 100000}{int(time.time() * 1000) % 1000}"
        self.hosts = [Host(n, f"10.77.0.{i + 1}", f"dsnv{tag}{n}", self.root) for i, n in enumerate(names)]
        self.switch = f"dsnv{tag}switch"
        self.rate_mbit: float | None = None
        self._made_run_sshd = False

    # -- set-up -------------------------------------------------------------------------------------------------
    def _start(self) -> None:
        self._network()
        self._files()
        if self.ssh:
            self._sshd()

    def _network(self) -> None:
        sw = ["ip", "-n", self.switch]
        _sh(["ip", "netns", "add", self.switch])
        _sh([*sw, "link", "add", "br0", "type", "bridge"])
        _sh([*sw, "link", "set", "br0", "up"])
        for i, h in enumerate(self.hosts):
            _sh(["ip", "netns", "add", h.netns])
            _sh(["ip", "link", "add", IFACE, "netns", h.netns, "type", "veth", "peer", "name", f"port{i}",
                 "netns", self.switch])
            _sh([*sw, "link", "set", f"port{i}", "master", "br0"])
            _sh([*sw, "link", "set", f"port{i}", "up"])
            ns = ["ip", "-n", h.netns]
            _sh([*ns, "addr", "add", f"{h.addr}/24", "dev", IFACE])
            _sh([*ns, "link", "set", IFACE, "up"])
            _sh([*ns, "link", "set", "lo", "up"])

    def shape(self, rate_mbit: float | None) -> None:
        """Limit every host's link to ``rate_mbit`` Mbit/s in each direction (``None``: unlimited again).

        A token bucket on both ends of each host's veth pair. Its bucket holds 2 ms at the rate (at least 64 KiB):
        smaller buckets cap the rate below the setting once a timer tick's worth of tokens exceeds them. Packets
        wait up to 200 ms in its queue; TCP backs off beyond that.
        """
        burst_kbit = max(512, int(rate_mbit * 2)) if rate_mbit is not None else 0
        for i, h in enumerate(self.hosts):
            for netns, dev in ((h.netns, IFACE), (self.switch, f"port{i}")):
                tc = ["ip", "netns", "exec", netns, "tc", "qdisc"]
                _sh([*tc, "del", "dev", dev, "root"], check=False)
                if rate_mbit is not None:
                    _sh([*tc, "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit", "burst",
                         f"{burst_kbit}kbit", "latency", "200ms"])
        self.rate_mbit = rate_mbit

    def qdiscs(self) -> list[str]:
        """The root qdisc of every link end (``tc qdisc show``), hosts first, then the switch ports."""
        out = []
        for i, h in enumerate(self.hosts):
            for netns, dev in ((h.netns, IFACE), (self.switch, f"port{i}")):
                r = _sh(["ip", "netns", "exec", netns, "tc", "qdisc", "show", "dev", dev, "root"], check=False)
                out.append(r.stdout.strip())
        return out

    def _files(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "enter.sh").write_text(ENTER)
        hosts = "127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.name}\n" for h in self.hosts)
        (self.root / "etc-hosts").write_text(hosts)
        ssh_dir = self.root / "etc-ssh"
        ssh_dir.mkdir(exist_ok=True)
        key = self.root / "id_ed25519"
        if not key.exists():
            _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)])
            _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh_dir / "host_key")])
        (self.root / "authorized_keys").write_text((self.root / "id_ed25519.pub").read_text())
        (self.root / "authorized_keys").chmod(0o600)
        # client side: what pdsh, mpirun and the job scripts' `ssh` read (through the bind-mounted /etc/ssh)
        (ssh_dir / "ssh_config").write_text(
            f"Host *\n  IdentityFile {key}\n  User root\n  Port {SSH_PORT}\n  BatchMode yes\n"
            "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  ConnectTimeout 10\n")
        (ssh_dir / "sshd_config").write_text(
            f"Port {SSH_PORT}\nHostKey {ssh_dir / 'host_key'}\nAuthorizedKeysFile {self.root / 'authorized_keys'}\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "UsePAM no\nStrictModes no\nPrintMotd no\nAcceptEnv *\nSubsystem sftp internal-sftp\n"
            f"PidFile {self.root / 'sshd-%h.pid'}\n".replace("%h", "host"))

    def _sshd(self) -> None:
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        if not Path("/run/sshd").exists():  # sshd's privilege-separation directory (the package creates it too)
            Path("/run/sshd").mkdir(mode=0o755)
            self._made_run_sshd = True
        for h in self.hosts:
            h.start("sshd", f"exec {sshd} -D -e -f /etc/ssh/sshd_config -o ListenAddress={h.addr} "
                            f"-o PidFile={self.root / f'sshd-{h.name}.pid'}")
        deadline = time.monotonic() + 30
        for a in self.hosts:
            for b in self.hosts:
                while True:
                    r = a.run(f"ssh {b.name} hostname", timeout=20)
                    if r.returncode == 0 and r.stdout.strip() == b.name:
                        break
                    if time.monotonic() > deadline:
                        raise ClusterUnavailable(f"ssh {a.name} -> {b.name} did not work within 30 s: "
                                                 f"{r.stderr.strip()} (sshd log: {self.root}/sshd-{b.name}.log)")
                    time.sleep(0.3)

    # -- tear-down ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every daemon (by process group), kill what is left in the namespaces, delete them."""
        for h in self.hosts:
            for p in h.daemons:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGTERM)
            for p in h.daemons:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=10)
            h.daemons.clear()
        # deleting a namespace deletes its veth ends, their peers and qdiscs with them
        for netns in [h.netns for h in self.hosts] + [self.switch]:
            if not Path(f"/run/netns/{netns}").exists():
                continue
            pids = _sh(["ip", "netns", "pids", netns], check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            _sh(["ip", "netns", "del", netns], check=False)
        if self._made_run_sshd:
            shutil.rmtree("/run/sshd", ignore_errors=True)
            self._made_run_sshd = False
