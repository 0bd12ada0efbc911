"""The failure lab (troubleshooting/), its failures of the host: the rendezvous (a port in use, an address where nothing
listens, a firewall, a wrong network interface, a hostname that does not resolve) and the DataLoader's workers
(a small /dev/shm, too few open files). Each happens as the README says, ends by itself, and its fix works; the
firewall, the hostname and /dev/shm are namespaces (failure_lab.py), skipped without root.
"""
import resource
import socket
import sys

import pytest

from failure_lab import LAB, Job, can_unshare, failed_quickly, finish_all, free_port, needs_unshare, succeeded, torchrun


# ---------------------------------------------------------------- 5. rendezvous

def test_master_port_in_use_fails_at_once_and_a_free_port_works():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        clash = torchrun("rendezvous.py", launch=("--master-addr=127.0.0.1", f"--master-port={port}")).finish()
    fixed = torchrun("rendezvous.py", launch=("--master-addr=127.0.0.1", f"--master-port={free_port()}")).finish()
    failed_quickly(clash)
    assert f"port: {port}" in clash.out and "EADDRINUSE" in clash.out, clash.out[-3000:]
    succeeded(fixed)
    assert fixed.out.count("all_reduce of ones = 2") == 2


FIREWALL = """
ip link set lo up
ip link add fw0 type veth peer name fw1 && ip addr add 10.99.0.1/24 dev fw0
ip link set fw0 up && ip link set fw1 up
# 10.99.0.2 "exists" (a fixed MAC) but nothing answers: packets vanish, like a firewall that drops them
ip neigh add 10.99.0.2 lladdr 02:00:00:00:00:02 dev fw0 nud permanent
timeout 3 bash -c '</dev/tcp/127.0.0.2/{port}' 2>/dev/null; echo "probe refused rc=$?"
timeout 3 bash -c '</dev/tcp/10.99.0.2/{port}' 2>/dev/null; echo "probe dropped rc=$?"
exec "$@"
"""


@pytest.fixture(scope="module")
def unreachable():
    """This machine as node 1 of 2, its MASTER_ADDR unreachable: nothing listens / a firewall drops
    (a network namespace). Both runs wait for their 10 s timeouts at the same time."""
    port = free_port()
    launch = ("--nnodes=2", "--node-rank=1", f"--master-port={port}", "--rdzv-conf=timeout=10")
    closed = torchrun("rendezvous.py", launch=("--master-addr=127.0.0.2", *launch))
    dropped = None
    if can_unshare("-n"):
        dropped = torchrun("rendezvous.py", launch=("--master-addr=10.99.0.2", *launch),
                           wrap=("unshare", "-n", "sh", "-c", FIREWALL.format(port=port), "firewall"))
    return port, closed.finish(), dropped and dropped.finish()


def test_wrong_master_addr_ends_with_a_connect_timeout(unreachable):
    port, job, _ = unreachable
    failed_quickly(job)
    assert f"The client socket has timed out after 10000ms while trying to connect to (127.0.0.2, {port})" in job.out


@needs_unshare("-n")
def test_firewalled_port_times_out_and_a_probe_tells_it_from_a_closed_port(unreachable):
    port, _, job = unreachable
    failed_quickly(job)
    assert "probe refused rc=1" in job.out  # a closed port answers at once: connection refused
    assert "probe dropped rc=124" in job.out  # a firewalled one never answers: the probe times out
    assert f"timed out after 10000ms while trying to connect to (10.99.0.2, {port})" in job.out, job.out[-3000:]


def test_wrong_network_interface_is_reported_at_init():
    job = torchrun("rendezvous.py", env={"GLOO_SOCKET_IFNAME": "nosuch0"}).finish()
    failed_quickly(job)
    assert "Unable to find address for: nosuch0" in job.out, job.out[-3000:]


@needs_unshare("-u")
def test_unresolvable_hostname_hangs_standalone_and_loopback_fixes_it():
    """A laptop whose hostname does not resolve (as on many Macs): a UTS namespace with a made-up name."""
    rename = ("unshare", "-u", "sh", "-c", 'hostname lab-unresolvable-host && exec "$@"', "rename")
    hang = torchrun("rendezvous.py", wrap=rename)
    fixed = torchrun("rendezvous.py", wrap=rename, launch=("--standalone", "--local-addr=127.0.0.1"),
                     env={"GLOO_SOCKET_IFNAME": "lo"})
    hang.wait_for(r"\(lab-unresolvable-host, \d+\) cannot be retrieved \(gai error")
    assert hang.proc.poll() is None, hang.out[-3000:]  # still hanging in the rendezvous...
    assert "all_reduce" not in hang.out  # ...and no worker ever ran
    hang.kill()
    succeeded(fixed.finish())
    assert fixed.out.count("all_reduce of ones = 2") == 2
    assert "Unable to resolve hostname" not in fixed.out


# ---------------------------------------------------------------- 6. DataLoader workers killed

def in_shm(size: str) -> tuple:
    """Run a command with a private /dev/shm of SIZE, as in a container started with --shm-size=SIZE."""
    return ("unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"', "shm")


def loader(*args, shm="", preexec_fn=None) -> Job:
    wrap = in_shm(shm) if shm else ()
    return Job([*wrap, sys.executable, str(LAB / "dataloader_workers.py"), *args], preexec_fn=preexec_fn)


@needs_unshare("-m")
def test_small_dev_shm_kills_the_workers_and_the_fixes():
    default, fs, sparse = loader(shm="64m"), loader("--sharing", "file_system", shm="64m"), \
        loader("--sparse-shm", shm="64m")
    no_workers, bigger = loader("--workers", "0", shm="64m"), loader(shm="256m")
    default, fs, sparse, no_workers, bigger = finish_all(default, fs, sparse, no_workers, bigger)
    for job in (default, fs):  # the file_system strategy also lives in /dev/shm: no help here
        failed_quickly(job)
        assert "Caught RuntimeError in DataLoader worker process" in job.out
        assert "unable to allocate shared memory(shm)" in job.out and "No space left on device" in job.out
    failed_quickly(sparse)
    assert "Unexpected bus error encountered in worker" in sparse.out, sparse.out[-3000:]
    # The main process then notices the dead worker, or first loses the connection it was reading from (timing).
    assert any(end in sparse.out for end in ("is killed by signal: Bus error", "ConnectionResetError", "EOFError")), \
        sparse.out[-3000:]
    for job in (no_workers, bigger):
        succeeded(job)
        assert "ok: 4 batches" in job.out


def test_too_many_open_files_and_the_file_system_strategy():
    def few_files():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))  # a low `ulimit -n`, in the child only

    fds, fs = finish_all(loader("--many-tensors", preexec_fn=few_files),
                         loader("--many-tensors", "--sharing", "file_system", preexec_fn=few_files))
    failed_quickly(fds)
    assert "received 0 items of ancdata" in fds.out, fds.out[-3000:]
    succeeded(fs)
    assert "ok: 64 batches" in fs.out
