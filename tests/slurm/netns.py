"""Network plumbing for the test cluster: a bridge in the root namespace, one network namespace
per node joined to it by a veth pair, and tagged /etc/hosts lines for every name."""
import ipaddress
import os
import re
import subprocess
from pathlib import Path

HOSTS = Path("/etc/hosts")
MARK = "# slurm-test-cluster"
PREFIX = "slt-"  # every namespace and link we make starts with this, so leftovers are findable
BRIDGE = PREFIX + "br"


def ip(*args, check=True):
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done


def free_subnet():
    """A private /24 that overlaps no address or route on this machine."""
    text = ip("-4", "route", "show", "table", "all").stdout + ip("-4", "-o", "addr").stdout
    used = [ipaddress.ip_network(t, strict=False) for t in re.findall(r"\b\d+\.\d+\.\d+\.\d+(?:/\d+)?", text)]
    for b in range(200, 256):
        net = ipaddress.ip_network(f"10.{b}.77.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError(f"no free 10.x.77.0/24 subnet; routes and addresses:\n{text}")


def netns_path(node):
    return Path("/run/netns") / (PREFIX + node)


class Network:
    """Addresses: the bridge (the controller's address) gets .1, node i gets .(11+i)."""

    def __init__(self, nodes, controller, tag):
        hosts = list(free_subnet().hosts())
        self.controller, self.controller_ip = controller, str(hosts[0])
        self.node_ips = {node: str(hosts[10 + i]) for i, node in enumerate(nodes)}
        self.tag = tag

    def up(self):
        ip("link", "add", BRIDGE, "type", "bridge")
        ip("addr", "add", f"{self.controller_ip}/24", "dev", BRIDGE)
        ip("link", "set", BRIDGE, "up")
        for node, addr in self.node_ips.items():
            ns = PREFIX + node
            ip("netns", "add", ns)
            ip("link", "add", ns, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("link", "set", ns, "master", BRIDGE, "up")
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")  # Slurm and gloo also talk over loopback
        # ::ffff: forms too, or torch's store reverse-resolves mapped addresses outside the cluster
        names = {self.controller: self.controller_ip, **self.node_ips}
        lines = [f"{pre}{addr} {name} {self.tag}\n" for name, addr in names.items() for pre in ("", "::ffff:")]
        text = HOSTS.read_text()
        HOSTS.write_text(text + ("\n" if text and not text.endswith("\n") else "") + "".join(lines))

    def spawn_argv(self, node, argv, local_disk=None):
        """argv that runs `argv` inside the node's network namespace, in a new UTS namespace
        named after the node (`ip netns exec` would remount /sys, which breaks slurmd).
        local_disk=(folder, path): also a private mount namespace in which `folder` is bind-mounted
        on `path`, so that every node sees its own disk at the same path, like a node-local /tmp."""
        return ["nsenter", f"--net={netns_path(node)}", *uts_argv(node, argv, local_disk)]


def uts_argv(hostname, argv, local_disk=None):
    if local_disk is None:
        return ["unshare", "--uts", "sh", "-c", f'hostname {hostname} && exec "$@"', "sh", *argv]
    # --mount: a private copy of the mount table (propagation private), so the bind stays in this namespace
    return ["unshare", "--uts", "--mount", "sh", "-c", f'hostname {hostname} && mount --bind "$1" "$2" && shift 2 '
            '&& exec "$@"', "sh", *map(str, local_disk), *argv]


def our_netns_inodes():
    return {p.stat().st_ino for p in Path("/run/netns").glob(PREFIX + "*")}


def remove_all():
    """Delete every namespace, link and /etc/hosts line we (or a crashed earlier run) made."""
    for path in Path("/run/netns").glob(PREFIX + "*"):
        ip("netns", "del", path.name, check=False)
    for name in re.findall(rf"^\d+: ({PREFIX}[^:@]+)", ip("-o", "link").stdout, re.M):
        ip("link", "del", name, check=False)  # deleting one end of a veth pair deletes both
    text = HOSTS.read_text()
    if MARK in text:
        HOSTS.write_text("".join(l for l in text.splitlines(keepends=True) if MARK not in l))


def hosts_owner():
    """(owner pid, state dir) recorded in our /etc/hosts lines, or None if there are none."""
    m = re.search(rf"{MARK} owner=(\d+) state=(\S+)", HOSTS.read_text())
    return (int(m[1]), Path(m[2])) if m else None


def pid_alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def processes(state_dir):
    """Live PIDs of ours: in our namespaces or naming our state dir on their command line, plus
    their descendants (slurmctld's helper renames itself to "slurmctld: slurmscriptd")."""
    inodes, needle, parent, ours = our_netns_inodes(), str(state_dir).encode(), {}, set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            state, ppid = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            if state == "Z":  # already dead, waiting to be reaped by its parent
                continue
            parent[int(proc.name)] = int(ppid)
            if (proc / "ns/net").stat().st_ino in inodes or needle in (proc / "cmdline").read_bytes():
                ours.add(int(proc.name))
        except OSError:  # the process ended while we looked
            continue
    while new := {pid for pid, ppid in parent.items() if ppid in ours} - ours:
        ours |= new
    ours.discard(os.getpid())
    return sorted(ours)
