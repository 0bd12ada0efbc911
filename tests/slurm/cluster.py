"""A real two-node Slurm cluster on this one machine, for tests. Needs root and Debian.

munged and slurmctld run in the root network namespace; each node's slurmd runs in its own
network + UTS + mount namespace (own address and hostname, same filesystem), so batch scripts see the
repository and the venv at the same paths; only `node_local` differs: each node has its own folder
there, a stand-in for node-local disk. Usage:

    with SlurmCluster() as cluster:
        job = cluster.submit("#!/bin/bash\nsrun hostname\n", sbatch_opts=["--nodes=2"])
        assert cluster.wait(job) == "COMPLETED", cluster.daemon_logs()
        print(cluster.output(job))
"""
import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from itertools import count
from pathlib import Path

from . import netns

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/bin/sbatch", "/usr/sbin/munged")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
CONTROLLER = "slurmctl"  # slurmctld runs in its own UTS namespace with this hostname


class SlurmError(RuntimeError):
    pass


class PackageInstallError(SlurmError):
    pass


def install_packages():
    """apt-get install the Slurm and munge packages unless they are already there."""
    if all(Path(b).exists() for b in BINARIES):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            raise PackageInstallError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def parse_record(line):
    """`Key=value Key2=a b` (scontrol -o) -> dict; a word without `Key=` continues the value."""
    info, key = {}, None
    for word in line.split():
        name, eq, value = word.partition("=")
        if eq and re.fullmatch(r"[A-Za-z][\w/:]*", name):
            key, info[name] = name, value
        elif key:
            info[key] += " " + word
    return info


class SlurmCluster:
    """Context manager: start() on enter, close() on exit (and at interpreter exit, if forgotten)."""

    def __init__(self, nodes=("n1", "n2"), gpus_per_node=2, max_time_min=60, startup_timeout=30):
        self.nodes, self.gpus_per_node = tuple(nodes), gpus_per_node
        self.max_time_min, self.startup_timeout = max_time_min, startup_timeout
        self.dir = self.net = None  # the private state folder and the netns.Network; set by start()
        self._scripts = count()

    # ---- life cycle -------------------------------------------------------------------------
    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def start(self):
        install_packages()
        _recover_stale()
        self.dir = Path(tempfile.mkdtemp(prefix="slurm-test-"))
        atexit.register(self.close)  # tear down even if the caller never reaches close()
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self):
        self.dir.chmod(0o755)  # munged refuses a socket folder that others cannot reach
        for sub in ("munge", "state", "log", "run", "jobs", "dev", "local", *(f"spool/{n}" for n in self.nodes),
                    *(f"nodes/{n}/local" for n in self.nodes)):
            (self.dir / sub).mkdir(parents=True, mode=0o755)
        key = self.dir / "munge/munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)  # munged refuses a key that others can read
        self.net = netns.Network(self.nodes, CONTROLLER, f"{netns.MARK} owner={os.getpid()} state={self.dir}")
        self._write_config()
        self.net.up()
        m, run = self.dir / "munge", self.dir / "run"
        self._spawn("munged", ["/usr/sbin/munged", f"--key-file={key}", f"--socket={m}/munge.socket",
                               f"--pid-file={run}/munged.pid", f"--log-file={self.dir}/log/munged.log",
                               f"--seed-file={m}/munged.seed"])
        conf = str(self.dir / "slurm.conf")
        self._spawn("slurmctld", netns.uts_argv(CONTROLLER, ["/usr/sbin/slurmctld", "-f", conf]))
        for node in self.nodes:  # each node sees its own folder at node_local: a node-local disk
            self._spawn(f"slurmd-{node}", self.net.spawn_argv(node, ["/usr/sbin/slurmd", "-N", node, "-f", conf],
                                                              (self.local_disk(node), self.node_local)))
        self._wait_for(self._nodes_idle, f"nodes {', '.join(self.nodes)} to be idle")

    def close(self):
        """Stop every process of ours, remove namespaces, links, /etc/hosts lines and the state folder."""
        atexit.unregister(self.close)
        if self.dir is None:
            return
        try:
            _stop_processes(self.dir)
        finally:  # even if a process would not die, give back the network and the disk
            netns.remove_all()
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    # ---- configuration and daemons ----------------------------------------------------------
    def _write_config(self):
        d, cpus = self.dir, len(os.sched_getaffinity(0))
        mem_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // len(self.nodes)
        gpus = f"gpu[0-{self.gpus_per_node - 1}]"
        for i in range(self.gpus_per_node):  # Slurm needs GPU device files that exist
            (d / f"dev/gpu{i}").symlink_to("/dev/null")
        node_lines = [f"NodeName={n} NodeAddr={a} CPUs={cpus} RealMemory={mem_mb} Gres=gpu:{self.gpus_per_node}"
                      f" State=UNKNOWN" for n, a in self.net.node_ips.items()]
        (d / "slurm.conf").write_text("\n".join([
            "ClusterName=testcluster",
            f"SlurmctldHost={CONTROLLER}({self.net.controller_ip})",
            "SlurmUser=root", "SlurmdUser=root",  # jobs run as root, like the tests
            "AuthType=auth/munge", f"AuthInfo=socket={d}/munge/munge.socket",
            f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/run/slurmctld.pid", f"SlurmdPidFile={d}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log", f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",  # no cgroups needed
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core_Memory",
            f"DefMemPerCPU={mem_mb // cpus}",  # else a job without --mem takes a whole node
            "GresTypes=gpu",
            "SchedulerParameters=batch_sched_delay=0",  # start batch jobs at once, not after ~3 s
            "ReturnToService=2",  # a node that was DOWN becomes usable when its slurmd registers
            "MinJobAge=86400",  # no slurmdbd, so `scontrol show job` is how we see finished jobs
            "KillWait=2",  # cancelled or timed-out jobs get SIGKILL 2 s after SIGTERM
            "MailProg=/bin/true",
            *node_lines,
            f"PartitionName=debug Nodes=ALL Default=YES MaxTime={self.max_time_min} State=UP", ""]))
        # read from the folder of slurm.conf; no autodetection, File= entries are /dev/null links
        (d / "gres.conf").write_text(f"AutoDetect=off\nName=gpu File={d}/dev/{gpus}\n")

    def _spawn(self, name, argv):
        """Start a daemon; it forks into the background, so only startup errors reach <name>.out."""
        with open(self.dir / f"log/{name}.out", "wb") as out:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        if done.returncode:
            raise SlurmError(f"{name} failed to start (exit {done.returncode})\n{self.daemon_logs()}")

    def _wait_for(self, ready, what):
        deadline = time.monotonic() + self.startup_timeout
        while not ready():
            dead = [f.stem for f in (self.dir / "run").glob("*.pid")
                    if (pid := f.read_text().strip()) and not netns.pid_alive(int(pid))]
            if dead or time.monotonic() > deadline:
                reason = f"{dead[0]} exited" if dead else f"not ready after {self.startup_timeout} s"
                raise SlurmError(f"waiting for {what}: {reason}\n{self.daemon_logs()}")
            time.sleep(0.1)

    def _nodes_idle(self):
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env, capture_output=True, text=True)
        states = dict(line.split() for line in out.stdout.splitlines())
        return out.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes)

    # ---- public API ---------------------------------------------------------------------------
    @property
    def node_local(self):
        """A folder that every node sees at this same path, each its own (like a node-local /tmp); in the
        test's own namespace it stays empty: read a node's content with local_disk(node)."""
        return self.dir / "local"

    def local_disk(self, node):
        """Where the test sees what node `node` wrote into node_local."""
        return self.dir / "nodes" / node / "local"

    @property
    def env(self):
        """os.environ plus SLURM_CONF, with this Python's bin folder (the venv) first on PATH."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # not an outer job's
        path = [os.path.dirname(sys.executable), env.get("PATH", ""), "/usr/sbin:/usr/bin:/sbin:/bin"]
        return {**env, "SLURM_CONF": str(self.dir / "slurm.conf"), "PATH": ":".join(p for p in path if p)}

    def run(self, *cmd, env=None, cwd=None):
        """Run a Slurm client command (scontrol, squeue, ...) against this cluster; return stdout."""
        done = subprocess.run(cmd, env={**self.env, **(env or {})}, cwd=cwd, capture_output=True, text=True)
        if done.returncode:
            raise SlurmError(f"{' '.join(map(str, cmd))} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def submit(self, script, args=(), env=None, cwd=None, sbatch_opts=()):
        """sbatch a script (a path, or the script text if it starts with #!) -> job id.
        The job gets this process's environment plus `env` (--export=ALL); its output goes to
        <state>/jobs/<id>.out unless sbatch_opts set -o/--output."""
        if isinstance(script, str) and script.startswith("#!"):
            path = self.dir / f"jobs/script-{next(self._scripts)}.sh"
            path.write_text(script)
            script = path
        opts = ["--parsable", "--export=ALL"]
        if not any(o.startswith(("-o", "--output")) for o in sbatch_opts):
            opts.append(f"--output={self.dir}/jobs/%j.out")
        out = self.run("sbatch", *opts, *sbatch_opts, str(script), *map(str, args), env=env, cwd=cwd)
        return int(out.strip().split(";")[0])

    def job_info(self, job_id):
        """`scontrol show job` as a dict (JobState, ExitCode, NodeList, StdOut, ...)."""
        return parse_record(self.run("scontrol", "-o", "show", "job", str(job_id)))

    def wait(self, job_id, timeout=120):
        """Wait until the job ends; return its final state (COMPLETED, FAILED, ...).
        On timeout cancel it and raise TimeoutError."""
        deadline = time.monotonic() + timeout
        while (state := self.job_info(job_id)["JobState"]) not in FINAL_STATES:
            if time.monotonic() > deadline:
                self.run("scancel", str(job_id))
                raise TimeoutError(f"job {job_id} still {state} after {timeout} s\n{self.daemon_logs()}")
            time.sleep(0.1)
        return state

    def output(self, job_id):
        """The job's standard output file, as text."""
        return Path(self.job_info(job_id)["StdOut"]).read_text()

    def daemon_logs(self):
        """All daemon logs (munged, slurmctld, each slurmd), each under a header."""
        logs = sorted((self.dir / "log").glob("*")) if self.dir else []
        return "".join(f"===== {p.name} =====\n{p.read_text(errors='replace')}" for p in logs if p.stat().st_size)


def _stop_processes(state_dir):
    """SIGTERM every process of ours at once (daemons exit in ~0.2 s), then SIGKILL what is left
    after 1 s: slurmstepd and srun of still-running jobs ignore SIGTERM."""
    for sig, grace in ((signal.SIGTERM, 1), (signal.SIGKILL, 2)):
        for pid in netns.processes(state_dir):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not netns.processes(state_dir):
                return
            time.sleep(0.05)
    raise SlurmError(f"processes still running after SIGKILL: {netns.processes(state_dir)}")


def _recover_stale():
    """Clean up after an earlier run that died without tearing down; refuse if it is still alive."""
    owner = netns.hosts_owner()
    if owner and netns.pid_alive(owner[0]):
        raise SlurmError(f"another test cluster (process {owner[0]}, state {owner[1]}) is running")
    if owner:
        _stop_processes(owner[1])
        shutil.rmtree(owner[1], ignore_errors=True)
    netns.remove_all()
