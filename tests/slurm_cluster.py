"""A real one-node Slurm cluster (slurmctld + slurmd + a private munged), started and
stopped by PID inside a temporary directory; nothing is written outside it."""

import os
import shutil
import socket
import subprocess
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def why_not() -> str | None:
    """None if a cluster can be started here, else the reason it cannot."""
    missing = [
        b for b in ("slurmctld", "slurmd", "srun", "munged", "mungekey") if shutil.which(b) is None
    ]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} missing); .ci/run installs "
            "Debian's slurmctld slurmd slurm-client munge"
        )
    if os.geteuid() != 0:
        return "the Slurm daemons of this fixture run as root; the tests do not"
    return None


# `sbatch --wait` sleeps 2, 8, 32, 32 ... s between its looks at the job while that is under
# half of MinJobAge (how long a finished job's record is kept; 300 s by default), so a job of
# 20 s was seen done after 42 s. At 4 s it looks every 2 s, each look within the record's life.
MIN_JOB_AGE_S = 4


class SlurmCluster:
    def __init__(self, root):
        self.root = root
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ)

    def start(self) -> "SlurmCluster":
        t, host, ncpu = self.root, socket.gethostname(), os.cpu_count()
        for d in ("state", "spool", "log", "munge"):
            (t / d).mkdir()
        subprocess.run(["mungekey", "-c", "-k", str(t / "munge/munge.key")], check=True)
        sock = t / "munge/munge.sock"
        self._spawn(
            [
                "munged",
                "-F",
                "--force",
                f"--key-file={t}/munge/munge.key",
                f"--socket={sock}",
                f"--pid-file={t}/munge/munged.pid",
                f"--log-file={t}/munge/munged.log",
                f"--seed-file={t}/munge/munged.seed",
            ],
            "munged",
        )
        self._wait(lambda: sock.exists(), 10, "munged did not create its socket")
        conf = t / "slurm.conf"
        conf.write_text(f"""ClusterName=jaxdist
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
MinJobAge={MIN_JOB_AGE_S}
MailProg=/bin/true
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={t}/state
SlurmdSpoolDir={t}/spool
SlurmctldPidFile={t}/slurmctld.pid
SlurmdPidFile={t}/slurmd.pid
SlurmctldLogFile={t}/log/slurmctld.log
SlurmdLogFile={t}/log/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 CPUs={ncpu} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        self.env["SLURM_CONF"] = str(conf)
        self._spawn(["slurmctld", "-D"], "slurmctld")
        self._spawn(["slurmd", "-D"], "slurmd")
        self._wait(
            lambda: self.run(["sinfo", "-h", "-o", "%t"]).stdout.strip() == "idle",
            30,
            "the node did not become idle",
        )
        return self

    def _spawn(self, cmd, name):
        log = open(self.root / "log" / f"{name}.out", "w")  # noqa: SIM115 - lives with the proc
        self.procs.append(
            subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self.env
            )
        )

    def _wait(self, cond, seconds, what):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if cond():
                return
            time.sleep(0.2)
        logs = "\n".join(p.read_text()[-2000:] for p in (self.root / "log").glob("*"))
        raise RuntimeError(f"{what}; logs:\n{logs}")

    def run(self, cmd, timeout=600, **kw):
        return subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**self.env, **kw.pop("env", {})},
            **kw,
        )

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
