"""The launch/ job scripts run for real: 2 ranks on 2 emulated hosts, NVFP4 ZeRO-3, a few steps each.

Every run asserts what a cluster user needs to be true: the two ranks ran on different hosts (host name and
network namespace), their losses are finite and identical, and both logged their NVFP4 storage report. Needs root
and Debian's openssh-server, pdsh, openmpi-bin, slurm-wlm, munge, slurm-wlm-torque (``tests/cluster/setup.sh``,
run by ``make test``); elsewhere the tests skip and say why. CI sets ``DS_NVFP4_REQUIRE_CLUSTER=1``, which turns
those skips into failures.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
from pathlib import Path

import pytest

from ds_nvfp4.evaluation.data import prepare_text
from tests.cluster.hosts import Cluster, Host, requirements
from tests.cluster.slurm import TOOLS as SLURM_TOOLS
from tests.cluster.slurm import SlurmCluster
from tests.ranks import ROOT

pytestmark = pytest.mark.slow
STEPS = 3
JOB_TIMEOUT = 420  # one job: env check on each host, JIT-cached DeepSpeed start, 3 steps (~45 s warm)


def need(*tools: str) -> None:
    why = requirements(*tools)
    if why is None:
        return
    if os.environ.get("DS_NVFP4_REQUIRE_CLUSTER") == "1":
        pytest.fail(f"multi-host tests required (DS_NVFP4_REQUIRE_CLUSTER=1) but: {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("data")
    prepare_text((ROOT / "tests" / "fixtures" / "shakespeare_sample.txt").read_bytes(), d, "tests/fixtures sample")
    return d


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    need("sshd", "ssh", "ssh-keygen")
    with Cluster(tmp_path_factory.mktemp("cluster")) as c:
        hostfile = c.root / "hostfile"
        hostfile.write_text("".join(f"{h.name} slots=1\n" for h in c.hosts))
        yield c


def train_args(data: Path, out: Path) -> str:
    return (f"--model 1m --seq 64 --steps {STEPS} --eval-interval {STEPS} --eval-batches 2 --warmup 1 "
            f"--data {data} --out {out}")


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    return {**env, "GLOO_SOCKET_IFNAME": "dsnv0", "DS_ACCELERATOR": "cpu", **extra}


def run_script(host: Host, script: str, data: Path, out: Path, **env: str) -> str:
    cmd = f"cd {ROOT} && timeout {JOB_TIMEOUT} bash launch/{script} {train_args(data, out)}"
    r = host.run(cmd, timeout=JOB_TIMEOUT + 30, env=job_env(**env))
    log = r.stdout + r.stderr
    assert r.returncode == 0, f"{script} failed ({r.returncode}):\n{log[-6000:]}"
    return log


def check_two_hosts(out: Path, log: str, per_host: int = 1) -> list[dict]:
    """Ranks spread over both hosts (``per_host`` each, local ranks 0..per_host-1 on each), equal finite
    all-reduced losses, each rank's own loss on its own shard, NVFP4 storage reported by each."""
    ranks = json.loads((out / "summary.json").read_text())["ranks"]
    world = 2 * per_host
    assert [r["rank"] for r in ranks] == list(range(world))
    for host in ("n1", "n2"):
        mine = [r for r in ranks if r["host"] == host]
        assert sorted(r["local_rank"] for r in mine) == list(range(per_host)), ranks
        assert len({r["netns"] for r in mine}) == 1 and None not in {r["netns"] for r in mine}
    assert len({r["netns"] for r in ranks}) == 2, ranks
    losses = [r["losses"] for r in ranks]
    assert len(losses[0]) == STEPS and all(v == losses[0] for v in losses), losses
    assert all(math.isfinite(v) for v in losses[0]) and losses[0][-1] < losses[0][0]
    # the all-reduced loss is equal by construction; each rank's own loss on its own shard is not: every rank
    # computed, on different data, and their mean is the recorded loss
    local = [r["local_losses"] for r in ranks]
    assert all(len(v) == STEPS for v in local) and len({tuple(v) for v in local}) == world, local
    assert all(math.isclose(sum(step) / world, m, rel_tol=1e-5) for step, m in zip(zip(*local), losses[0]))
    for r in ranks:
        assert r["storage"] and "packed NVFP4" in r["storage"], r
        assert f"ds_nvfp4 storage rank {r['rank']}:" in log, f"rank {r['rank']} did not log its storage report"
    return ranks


def env_checked_on_both_hosts(log: str) -> None:
    """`ds-nvfp4 env --config` ran on each host before training: the first host's whole report, the other's verdict."""
    assert re.search(r"^n1: \s+kernels?\b", log, re.M), log[-3000:]
    assert re.search(r"^n1: \s+config .*: OK: runs here", log, re.M) and re.search(r"^n2: config .*: OK: runs here",
                                                                                log, re.M), log[-3000:]


# -- the four launch paths --------------------------------------------------------------------------------------

def test_pdsh_hostfile(cluster: Cluster, data: Path) -> None:
    need("pdsh")
    out, tmp = cluster.root / "run-pdsh", cluster.root / "tmp-pdsh"
    tmp.mkdir()
    log = run_script(cluster.hosts[0], "pdsh.sh", data, out, HOSTFILE=str(cluster.root / "hostfile"),
                     TMPDIR=str(tmp))
    check_two_hosts(out, log)
    assert "n1: " in log and "n2: " in log  # pdsh prefixes every remote line with its host
    assert "GLOO_SOCKET_IFNAME=dsnv0" in log  # the generated .deepspeed_env is shown
    assert f"environment for the ranks ({tmp}/ds-nvfp4-env." in log
    assert not list(tmp.iterdir()), "the generated DS_ENV_FILE was left behind"
    env_checked_on_both_hosts(log)


def test_lora_on_an_nvfp4_checkpoint_across_two_hosts(cluster: Cluster, tmp_path: Path) -> None:
    """PEFT LoRA on a frozen NVFP4 checkpoint (docs/finetune.md) with the unmodified HF Trainer script, launched by
    launch/pdsh.sh on 2 emulated hosts: each host's rank packs its own slice of the checkpoint, equal losses that
    fall, adapters saved."""
    from tests.checkpoint.tiny import llama_folder
    from tests.integrations.hf_run import aborted_at_exit_only, lora_ds_config

    need("pdsh")
    llama_folder(tmp_path / "ckpt")
    (tmp_path / "ds.json").write_text(json.dumps(lora_ds_config(tmp_path / "ckpt")))
    out = tmp_path / "out"
    out.mkdir()
    cmd = (f"cd {ROOT} && timeout {JOB_TIMEOUT} bash launch/pdsh.sh --base {tmp_path / 'ckpt'} --out {out} "
           "--steps 4 --save_steps 4")
    r = cluster.hosts[0].run(cmd, timeout=JOB_TIMEOUT + 30, env=job_env(
        HOSTFILE=str(cluster.root / "hostfile"), CONFIG=str(tmp_path / "ds.json"),
        SCRIPT=str(ROOT / "tests" / "integrations" / "hf_lora_script.py")))
    # the unmodified Trainer script never destroys its process group; ds_nvfp4's exit-time teardown does, and a rank
    # still aborted at exit once after writing everything below (2026-12-07): let that through with a warning
    if not aborted_at_exit_only(r.returncode, r.stdout + r.stderr, "launch/pdsh.sh (HF Trainer LoRA)"):
        assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    ranks = [json.loads((out / f"rank{k}.json").read_text()) for k in range(2)]
    assert {x["host"] for x in ranks} == {"n1", "n2"} and len({x["netns"] for x in ranks}) == 2, ranks
    for x in ranks:
        assert x["report"]["frozen_params"] == 14 and "read as stored" in x["report"]["frozen_source"], x
    assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[0]["losses"]["4"] < ranks[0]["losses"]["1"]
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_pdsh_two_ranks_per_host(cluster: Cluster, data: Path) -> None:
    need("pdsh")
    hostfile = cluster.root / "hostfile2"
    hostfile.write_text("".join(f"{h.name} slots=2\n" for h in cluster.hosts))
    out = cluster.root / "run-pdsh-2x2"
    log = run_script(cluster.hosts[0], "pdsh.sh", data, out, HOSTFILE=str(hostfile))
    check_two_hosts(out, log, per_host=2)


def test_openmpi_launcher(cluster: Cluster, data: Path) -> None:
    need("mpirun")
    out = cluster.root / "run-ompi"
    log = run_script(cluster.hosts[0], "openmpi.sh", data, out, MODE="launcher",
                     HOSTFILE=str(cluster.root / "hostfile"))
    check_two_hosts(out, log)
    assert "--launcher openmpi" in log
    env_checked_on_both_hosts(log)


def test_plain_mpirun_with_mpi4py_discovery(cluster: Cluster, data: Path) -> None:
    need("mpirun")
    import mpi4py  # noqa: F401 (a dev dependency: missing it is an error, not a skip)
    out = cluster.root / "run-mpirun"
    log = run_script(cluster.hosts[0], "openmpi.sh", data, out, MODE="mpirun",
                     HOSTFILE=str(cluster.root / "hostfile"))
    check_two_hosts(out, log)
    assert "MPI discovery (mpi4py): MASTER_ADDR=10.77.0.1 MASTER_PORT=" in log
    assert "MASTER_PORT=29500" not in log


@pytest.fixture(scope="module")
def slurm(cluster: Cluster):
    need(*SLURM_TOOLS)
    with SlurmCluster(cluster) as s:
        yield s


def submit_and_check(slurm: SlurmCluster, cluster: Cluster, submit: str, out: Path, env: dict) -> str:
    log_file = out.parent / f"{out.name}.log"
    job = slurm.submit(cluster.hosts[0], f"cd {ROOT} && {submit.format(log=log_file)}", env=job_env(**env))
    state = slurm.wait(job, timeout=JOB_TIMEOUT)
    log = log_file.read_text() if log_file.exists() else "(no job log)"
    assert state == "COMPLETED", f"job {job}: {state}\n{log[-6000:]}"
    check_two_hosts(out, log)
    return log


def test_slurm_sbatch_srun(slurm: SlurmCluster, cluster: Cluster, data: Path) -> None:
    out = cluster.root / "run-sbatch"
    log = submit_and_check(slurm, cluster, f"sbatch --output={{log}} launch/slurm.sbatch {train_args(data, out)}",
                           out, {})
    assert "running: srun" in log


def test_slurm_deepspeed_launcher(slurm: SlurmCluster, cluster: Cluster, data: Path) -> None:
    """`deepspeed --launcher slurm` inside the allocation (needs --mpi=pmix, which the script passes)."""
    out = cluster.root / "run-sbatch-ds"
    log = submit_and_check(slurm, cluster, f"sbatch --output={{log}} launch/slurm.sbatch {train_args(data, out)}",
                           out, {"MODE": "deepspeed"})
    assert "--launcher slurm --launcher_args=--mpi=pmix" in log


def test_pbs_script_through_qsub(slurm: SlurmCluster, cluster: Cluster, data: Path) -> None:
    need("qsub")
    out = cluster.root / "run-qsub"
    log = submit_and_check(slurm, cluster, "qsub -V -l nodes=2:ppn=1 -j oe -o {log} launch/pbs.sh", out,
                           {"TRAIN_ARGS": train_args(data, out)})
    assert "hostfile from PBS_NODEFILE" in log


# -- failing fast with a message, never hanging -----------------------------------------------------------------

def fails(host: Host, cmd: str, timeout: int = 60, **env: str) -> str:
    r = host.run(f"cd {ROOT} && {cmd}", timeout=timeout, env=job_env(**env))
    assert r.returncode != 0, f"{cmd} should have failed:\n{r.stdout}\n{r.stderr}"
    return r.stderr


def test_missing_or_malformed_hostfile(cluster: Cluster, tmp_path: Path) -> None:
    h = cluster.hosts[0]
    assert "no hostfile given" in fails(h, "bash launch/pdsh.sh", HOSTFILE="")
    bad = tmp_path / "hosts"
    bad.write_text("n1 gpus=8\n")
    assert "every line must read 'HOST slots=N'" in fails(h, "bash launch/openmpi.sh", HOSTFILE=str(bad))


def test_unreachable_host_and_missing_interface(cluster: Cluster, tmp_path: Path) -> None:
    need("pdsh")
    h = cluster.hosts[0]
    hosts = tmp_path / "hosts"
    hosts.write_text("n1 slots=1\nn2 slots=1\nn9 slots=1\n")  # n9 resolves nowhere
    err = fails(h, "bash launch/pdsh.sh", HOSTFILE=str(hosts), SSH_TIMEOUT="3")
    assert "host 'n9' is unreachable by passwordless ssh" in err
    err = fails(h, "bash launch/pdsh.sh", HOSTFILE=str(cluster.root / "hostfile"), GLOO_SOCKET_IFNAME="ib7")
    assert "interface 'ib7' not found on host 'n1'" in err


def test_a_host_that_cannot_run_the_config_stops_the_job_naming_it(cluster: Cluster, tmp_path: Path) -> None:
    """The environment check runs on every host (at once) before anything starts; a ds_config that cannot run (a
    native FP4 backend on a CPU) stops the job with one error line per host and that host's whole report."""
    config = json.loads((ROOT / "ds_configs" / "nvfp4_zero3.json").read_text())
    config["precision"]["kernel"] = "torch"
    bad = tmp_path / "native.json"
    bad.write_text(json.dumps(config))
    for script in ("pdsh.sh", "openmpi.sh"):
        r = cluster.hosts[0].run(f"cd {ROOT} && bash launch/{script}", timeout=120, env=job_env(
            HOSTFILE=str(cluster.root / "hostfile"), CONFIG=str(bad)))
        assert r.returncode == 1, (script, r.stdout[-3000:], r.stderr[-3000:])
        for host in ("n1", "n2"):
            assert f"error: ds-nvfp4 env says {bad} cannot run on {host}" in r.stderr, (script, r.stderr)
            assert re.search(rf"^{host}: \s+config .*CANNOT RUN", r.stdout, re.M), (script, r.stdout[-3000:])
        assert "running:" not in r.stdout, script  # nothing was launched


def test_slurm_script_outside_an_allocation(cluster: Cluster) -> None:
    env = {k: "" for k in ("SLURM_JOB_ID",)}
    err = fails(cluster.hosts[0], f"bash launch/slurm.sbatch {shlex.quote('--steps')} 1", **env)
    assert "not inside a SLURM allocation" in err
