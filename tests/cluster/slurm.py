"""A throw-away two-node SLURM cluster (Debian ``slurm-wlm`` + ``munge``) on the emulated hosts of ``hosts.py``.

``with SlurmCluster(cluster) as slurm:`` starts one ``munged`` (its socket and key in the test directory), a
``slurmctld`` on the first host and a ``slurmd`` per host, each in its host's namespaces, with a ``slurm.conf`` in
the test directory (``SLURM_CONF``). ``slurm.submit(host, argv)`` runs ``sbatch``/``qsub`` there and returns the
job id; ``slurm.wait(job_id)`` polls ``squeue`` every second (``sbatch --wait`` polls slowly) and returns the job's
final state from ``scontrol show job``. Everything stops when the block ends (the daemons belong to the hosts).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

from tests.cluster.hosts import Cluster, Host, Managed

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol")
CONF = """ClusterName=dsnvfp4test
SlurmctldHost={ctl}({ctl_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
TmpFS={dir}/tmp-%n
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
{nodes}
PartitionName=test Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster(Managed):
    def __init__(self, cluster: Cluster, ctld_port: int = 16817, slurmd_port: int = 16818) -> None:
        self.cluster = cluster
        self.dir = cluster.root / "slurm"
        self.conf = self.dir / "slurm.conf"
        self.ctld_port, self.slurmd_port = ctld_port, slurmd_port
        self.munged: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        """Environment for SLURM clients (and the jobs they submit)."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def _start(self) -> None:
        hosts = self.cluster.hosts
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "state").mkdir(exist_ok=True)
        for h in hosts:
            (self.dir / f"spool-{h.name}").mkdir(exist_ok=True)
            (self.dir / f"tmp-{h.name}").mkdir(exist_ok=True)
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        socket = self.dir / "munge.socket"
        # munged serves every host through its socket file (the hosts share the file system, like one site's NFS)
        log = open(self.dir / "munged.log", "w")  # noqa: SIM115 (owned by the process)
        self.munged = subprocess.Popen(
            [shutil.which("munged") or "/usr/sbin/munged", "--foreground", "--force", f"--key-file={key}",
             f"--socket={socket}", f"--pid-file={self.dir / 'munged.pid'}", f"--seed-file={self.dir / 'munge.seed'}",
             f"--log-file={self.dir / 'munged.log'}"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _wait_for(lambda: socket.exists(), 15, f"munged did not create {socket} (log: {self.dir}/munged.log)")
        nodes = "\n".join(f"NodeName={h.name} NodeAddr={h.addr} CPUs={os.cpu_count()} State=UNKNOWN" for h in hosts)
        self.conf.write_text(CONF.format(ctl=hosts[0].name, ctl_addr=hosts[0].addr, ctld_port=self.ctld_port,
                                         slurmd_port=self.slurmd_port, munge_socket=socket, dir=self.dir, nodes=nodes,
                                         names=",".join(h.name for h in hosts)))
        env = self.env
        hosts[0].start("slurmctld", f"exec slurmctld -D -i -f {self.conf}", env=env)
        for h in hosts:
            h.start("slurmd", f"exec slurmd -D -f {self.conf} -N {h.name}", env=env)

        def idle() -> bool:
            r = hosts[0].run("sinfo -h -o '%n %t'", timeout=20, env=env)
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            return all(states.get(h.name) == "idle" for h in hosts)
        _wait_for(idle, 60, f"SLURM nodes not idle within 60 s (logs: {self.dir})")

    def submit(self, host: Host, cmd: str, env: dict | None = None) -> str:
        """Run a submit command (sbatch/qsub) on ``host``; returns the job id it printed."""
        r = host.run(cmd, timeout=60, env={**self.env, **(env or {})})
        m = re.search(r"(\d+)", r.stdout)
        if r.returncode != 0 or m is None:
            raise AssertionError(f"{cmd} failed ({r.returncode}): {r.stdout}\n{r.stderr}")
        return m.group(1)

    def wait(self, job_id: str, timeout: int = 600) -> str:
        """Poll until the job leaves the queue; its final JobState (COMPLETED, FAILED, TIMEOUT...)."""
        host = self.cluster.hosts[0]
        deadline = time.monotonic() + timeout
        while queued := host.run(f"squeue -h -o '%T %R' -j {job_id}", timeout=20, env=self.env).stdout.strip():
            if time.monotonic() > deadline:
                host.run(f"scancel {job_id}", timeout=20, env=self.env)
                raise AssertionError(f"job {job_id} still queued or running after {timeout} s ({queued}): cancelled")
            time.sleep(1)
        out = host.run(f"scontrol show job {job_id}", timeout=20, env=self.env).stdout
        m = re.search(r"JobState=(\S+)", out)
        return m.group(1) if m else f"unknown ({out.strip() or 'scontrol knows no such job'})"

    def close(self) -> None:
        # slurmd/slurmctld are the hosts' daemons (stopped by Cluster.close); munged is ours
        if self.munged is not None and self.munged.poll() is None:
            os.killpg(self.munged.pid, signal.SIGTERM)
            try:
                self.munged.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.munged.pid, signal.SIGKILL)
                self.munged.wait(timeout=10)


def _wait_for(ok, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.5)
