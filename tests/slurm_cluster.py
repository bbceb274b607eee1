"""A one-node Slurm cluster on localhost for the tests: munged, slurmctld and slurmd (Debian's ``slurm-wlm``)
started as root with their own slurm.conf, state, spool, logs and munge key and socket under one temporary
directory and on free ports, so nothing of the machine's own Slurm (if any) is touched. ``SLURM_CONF`` points
sbatch, squeue, scancel, scontrol, sacct and submitit at it. Every daemon is stopped by its pid at the end.

sacct is what submitit reads a job's state from (a cancelled or timed-out job writes no result, and only its
state ends the wait), and sacct needs Slurm's accounting: slurmdbd on a MariaDB server of its own (datadir and
socket in the same directory, a free port on 127.0.0.1).

Two partitions on the node, as a cluster with preemption has them: ``debug`` (the default) and ``urgent``, whose
higher PriorityTier preempts a ``debug`` job that holds the CPUs it needs (``preempt/partition_prio``): Slurm
kills that job (SIGTERM, SIGKILL after KillWait) and requeues it (``PreemptMode=REQUEUE``). A requeued job waits
``cred_expire`` seconds before it may start again (20 here; 120 by default). A job ends at its time limit with no
grace (``OverTimeLimit=0``, ``KillWait=5``).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "slurmdbd", "sacct", "mariadbd", "mariadb-install-db")
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
"""Where the daemons are looked for: the caller's PATH, then where Debian puts them (a non-login root may lack it)."""
START_S = 180.0
"""Generous: on a loaded 2-core machine MariaDB's first start alone can take tens of seconds."""


class ClusterUnavailable(RuntimeError):
    """The cluster could not start here; the message says why and what to install."""


def _free_ports(n: int) -> list[int]:
    """``n`` ports free now, below the kernel's ephemeral range: a port bound to 0 comes from that range, and until
    the daemon binds it an outgoing connection (slurmctld's to slurmdbd, say) may take it as its local port."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    ports: list[int] = []
    for port in random.sample(range(10000, max(low, 10000 + 4 * n)), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise ClusterUnavailable(f"no {n} free ports below {low} on 127.0.0.1")


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024 - 1024  # slurmd refuses a node that claims more than it has
    return 1024


SLURM_CONF = """\
ClusterName=moetest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire=20
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={dbd_port}
AccountingStoragePass={root}/munge/munge.socket
JobAcctGatherType=jobacct_gather/none
JobRequeue=1
KillWait=5
OverTimeLimit=0
MinJobAge=600
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=1
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=2 PreemptMode=OFF
"""

SLURMDBD_CONF = """\
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
DbdAddr=127.0.0.1
DbdHost={host}
DbdPort={dbd_port}
SlurmUser=root
PidFile={root}/slurmdbd.pid
LogFile={root}/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={db_port}
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
"""


@dataclass
class SlurmCluster:
    root: Path
    cpus: int
    partition: str = "debug"
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment of a process that submits to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": SEARCH_PATH}

    def run(self, *command: str, check: bool = True, timeout: float = 30) -> str:
        proc = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: exit {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout

    def logs(self) -> str:
        """The daemons' logs' ends, for a failure's message."""
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(parts)

    def job_state(self, job_id: str) -> str:
        """The job's state as squeue (a live job) or sacct (an ended one) reports it; "" when neither knows it."""
        state = self.run("squeue", "-h", "-j", job_id, "-o", "%T", check=False).strip()
        if state:
            return state
        # -X: the job's allocation, not its steps (a step killed by scancel may end FAILED); "CANCELLED by 0" -> CANCELLED
        lines = self.run("sacct", "-X", "-n", "-P", "-o", "State", "-j", job_id, check=False).splitlines()
        return lines[0].split()[0] if lines and lines[0].strip() else ""

    def wait_idle(self, timeout: float = START_S) -> None:
        """Until the node is idle: no job of an earlier test holds it."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).strip()
            if state and set(state.split()) == {"idle"}:  # the node's line in each partition
                return
            time.sleep(0.5)
        raise ClusterUnavailable(f"the node is {state or 'not known'} after {timeout:g} s, not idle\n{self.logs()}")

    def _start(self, name: str, command: list[str]) -> None:
        with open(self.root / "log" / f"{name}.out", "w") as log:
            proc = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pids[name] = proc.pid

    def stop(self, remove: bool = True) -> None:
        """Every daemon this cluster started, by its pid (jobs still running die with slurmd's steps); then its
        directory, unless ``remove`` is False (its logs explain a failure)."""
        for name in ("slurmd", "slurmctld", "slurmdbd", "mariadbd", "munged"):
            pid = self.pids.pop(name, None)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(100):
                try:
                    if os.waitpid(pid, os.WNOHANG)[0]:
                        break
                except ChildProcessError:
                    break
                time.sleep(0.1)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)


def start_cluster() -> SlurmCluster:
    """Start the cluster or raise ClusterUnavailable with the reason; the caller must ``stop()`` it."""
    missing = [d for d in DAEMONS if shutil.which(d, path=SEARCH_PATH) is None]
    if missing:
        raise ClusterUnavailable(
            f"{', '.join(missing)} not installed (`make test` installs slurm-wlm, slurmdbd, munge "
            "and mariadb-server with apt, as root)"
        )
    if os.geteuid() != 0:
        raise ClusterUnavailable("the test cluster's slurmd must run as root (it starts jobs as their user)")
    root = Path(tempfile.mkdtemp(prefix="slurm-"))  # short: the munge socket's path must fit a sockaddr_un
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(mode=0o700)
    host = socket.gethostname().split(".")[0]
    ctld_port, slurmd_port, dbd_port, db_port = _free_ports(4)
    cluster = SlurmCluster(root=root, cpus=os.cpu_count() or 1)
    cluster.conf.write_text(
        SLURM_CONF.format(
            root=root,
            host=host,
            ctld_port=ctld_port,
            slurmd_port=slurmd_port,
            dbd_port=dbd_port,
            cpus=cluster.cpus,
            memory=_memory_mb(),
        )
    )
    dbd_conf = root / "slurmdbd.conf"  # next to slurm.conf, where slurmdbd looks; it refuses a readable one
    dbd_conf.write_text(SLURMDBD_CONF.format(root=root, host=host, dbd_port=dbd_port, db_port=db_port))
    dbd_conf.chmod(0o600)
    try:
        munge = root / "munge"
        subprocess.run(
            ["mungekey", "--create", f"--keyfile={munge / 'munge.key'}"],
            check=True,
            capture_output=True,
            env=cluster.env,
        )
        cluster._start(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={munge / 'munge.socket'}",
                f"--key-file={munge / 'munge.key'}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--seed-file={munge / 'munged.seed'}",
                f"--log-file={root / 'log' / 'munged.log'}",
            ],
        )
        _wait_for(lambda: (munge / "munge.socket").exists(), "munged's socket", cluster)
        _start_database(cluster, db_port)
        cluster._start("slurmdbd", ["slurmdbd", "-D"])
        _wait_for(lambda: _listening(dbd_port), "slurmdbd on its port", cluster)
        cluster._start("slurmctld", ["slurmctld", "-D", "-i", "-f", str(cluster.conf)])
        cluster._start("slurmd", ["slurmd", "-D", "-N", host, "-f", str(cluster.conf)])
        cluster.wait_idle()
    except BaseException as exc:
        cluster.stop(remove=False)
        if isinstance(exc, ClusterUnavailable):
            raise
        raise ClusterUnavailable(f"the cluster did not start: {exc}\n{cluster.logs()}") from exc
    return cluster


def _start_database(cluster: SlurmCluster, port: int) -> None:
    """A MariaDB server for slurmdbd: its own datadir, socket and port; root reaches it by the socket."""
    data, sock = cluster.root / "db", cluster.root / "db.sock"
    subprocess.run(
        ["mariadb-install-db", "--no-defaults", f"--datadir={data}", "--user=root", "--skip-test-db"],
        check=True,
        capture_output=True,
        timeout=120,
        env=cluster.env,
    )
    cluster._start(
        "mariadbd",
        [
            "mariadbd",
            "--no-defaults",
            f"--datadir={data}",
            f"--socket={sock}",
            f"--port={port}",
            "--bind-address=127.0.0.1",
            "--user=root",
            f"--pid-file={cluster.root / 'db.pid'}",
            f"--log-error={cluster.root / 'log' / 'db.log'}",
            "--skip-name-resolve",
        ],
    )
    _wait_for(lambda: sock.exists() and _listening(port), "MariaDB's socket", cluster)
    subprocess.run(
        [
            "mariadb",
            "--no-defaults",
            f"--socket={sock}",
            "-u",
            "root",
            "-e",
            "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm'; "
            "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';",
        ],
        check=True,
        capture_output=True,
        env=cluster.env,
    )


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_for(ready, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + START_S
    while not ready():
        for name, pid in cluster.pids.items():
            if os.waitpid(pid, os.WNOHANG)[0]:
                raise ClusterUnavailable(f"{name} exited while waiting for {what}\n{cluster.logs()}")
        if time.monotonic() > deadline:
            raise ClusterUnavailable(f"no {what} after {START_S:g} s\n{cluster.logs()}")
        time.sleep(0.1)
