"""Network-namespace topologies for tests and benchmarks: real links, kernel shaping, real NAT.

Everything lives in namespaces this module creates (nothing is added to the host's own network
namespace) and is removed by :meth:`Topology.close`, which a ``with`` block calls even when the
body fails; an ``atexit`` hook catches what an abrupt exit leaves behind, and every new topology
deletes namespaces left by processes that no longer exist. Names carry the creating process id
and a random tag, so concurrent runs never collide.

Shape of a topology::

    public hosts ── eth0 ═╗                         ╔═ wan0 ── NAT router ── lan0 ═ eth0 ── host
                          ╠══ br0 (the "internet") ═╣    (MASQUERADE, drops unsolicited inbound)
    public hosts ── eth0 ═╝   in namespace <id>-wan ╚═ wan0 ── NAT router ── lan0 ═ eth0 ── host

* public hosts: 10.200.0.<k>/16 on the bridge; NAT routers: 10.200.1.<k>/16 on the bridge and
  192.168.<k>.1/24 on their LAN; hosts behind router k: 192.168.<k>.<2..>/24;
* ``nat="cone"``: plain MASQUERADE (keeps the source port when it can, filters inbound per
  connection); ``nat="symmetric"``: ``MASQUERADE --random-fully``, a new public port for every
  outbound connection (hole punching cannot predict it). Both drop unsolicited inbound traffic;
* :meth:`Topology.shape`: kernel egress shaping, ``tc tbf`` on the host's uplink;
* :meth:`Topology.add_delay`: a fixed one-way delay (and optional loss) on every packet a host
  receives, by :mod:`swarm.delayline` (NFQUEUE), for kernels without ``netem``;
* :meth:`Topology.limit_cpu`: a CPU budget for everything a host runs (a cgroup v1 ``cpu``
  controller group with ``cpu.cfs_quota_us``), so that a peer's CPU stands in for its own
  machine's; :func:`cpu_limit_unavailable` says why it cannot be used here.

A process runs inside a host with ``host.argv([...])`` (``ip netns exec <ns> ...``).
:func:`unavailable_reason` says why namespaces cannot be used here (tests skip with it).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

logger = logging.getLogger(__name__)

PREFIX = "rsn"  # every namespace created here starts with this, then <pid hex>x<tag>
CPU_CGROUP = "/sys/fs/cgroup/cpu"  # the cgroup v1 cpu controller hierarchy
ACCT_CGROUP = "/sys/fs/cgroup/cpuacct"  # ... and cpuacct (CPU time used), when mounted apart
CFS_PERIOD_US = 100_000
NatKind = Literal["cone", "symmetric"]
CORE = "10.200.255.254"  # the bridge's own address: default gateway that drops what it gets
_LIVE: set[Topology] = set()


class NetnsError(RuntimeError):
    """A topology command failed (message: the command and its error output)."""


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 20.0) -> str:
    proc = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


@functools.cache
def iptables_command() -> str | None:
    """``iptables`` if it works here (nf_tables), else ``iptables-legacy``, else None."""
    for cmd in ("iptables", "iptables-legacy"):
        if shutil.which(cmd) is None:
            continue
        probe = f"{PREFIX}{os.getpid():x}xprobe{secrets.token_hex(2)}"
        try:
            _run(["ip", "netns", "add", probe])
            _run(["ip", "netns", "exec", probe, cmd, "-t", "nat", "-L", "-n"])
            return cmd
        except (NetnsError, OSError, subprocess.SubprocessError):
            continue
        finally:
            _run(["ip", "netns", "del", probe], check=False)
    return None


@functools.cache
def unavailable_reason() -> str | None:
    """Why namespaces, veth pairs, NAT and tbf cannot be used here; None when they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (apt-get install iproute2)"
    try:
        with Topology() as topo:
            a = topo.add_public("probe")
            topo.shape(a, 1 << 20)
    except (NetnsError, OSError, subprocess.SubprocessError) as exc:
        return f"cannot build a namespace topology here: {exc}"
    if iptables_command() is None:
        return "no working iptables (apt-get install iptables; iptables-legacy if nf_tables fails)"
    return None


def cpu_limit_unavailable() -> str | None:
    """Why per-host CPU budgets (:meth:`Topology.limit_cpu`) cannot be used; None if they can."""
    quota = os.path.join(CPU_CGROUP, "cpu.cfs_quota_us")
    if not os.path.exists(quota):
        return (
            f"no cgroup v1 cpu controller at {CPU_CGROUP} (cpu.cfs_quota_us missing); "
            "run without CPU budgets"
        )
    if not os.access(CPU_CGROUP, os.W_OK):
        return f"cannot create cgroups under {CPU_CGROUP} (needs root)"
    return None


def _owner_alive(name: str) -> bool:
    head = name[len(PREFIX) :].split("x", 1)[0]
    try:
        pid = int(head, 16)
    except ValueError:
        return True  # not one of ours after all: leave it alone
    return os.path.exists(f"/proc/{pid}")


def sweep_stale() -> list[str]:
    """Delete namespaces created here by processes that are gone (a crashed run); returns them."""
    out = _run(["ip", "netns", "list"], check=False)
    stale = [
        line.split()[0]
        for line in out.splitlines()
        if line.startswith(PREFIX) and not _owner_alive(line.split()[0])
    ]
    for name in stale:
        _kill_inside(name)
        _run(["ip", "netns", "del", name], check=False)
    for root in (CPU_CGROUP, ACCT_CGROUP):
        if os.path.isdir(root):
            for name in os.listdir(root):
                if name.startswith(PREFIX) and not _owner_alive(name):
                    _remove_cgroup(os.path.join(root, name))
    return stale


def _remove_cgroup(path: str) -> None:
    """Kill what is left in a cgroup of ours and remove it (rmdir works on an empty group)."""
    with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.procs")) as fh:
        for pid in fh.read().split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    for _ in range(50):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:  # processes still exiting
            time.sleep(0.02)
    logger.warning("could not remove cgroup %s", path)


def _kill_inside(netns: str) -> None:
    """SIGKILL the processes still running in ``netns`` (started there by this topology)."""
    pids = _run(["ip", "netns", "pids", netns], check=False).split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


@dataclass(eq=False)
class Router:
    """A NAT router: ``public_ip`` on the bridge, the LAN 192.168.<k>.0/24 behind it."""

    name: str
    netns: str
    public_ip: str
    lan: str  # "192.168.<k>"
    nat: NatKind
    hosts: int = 0  # hosts attached so far


@dataclass(eq=False)
class Host:
    """An end host (its own namespace); ``ip`` is its own address, private behind a NAT."""

    name: str
    netns: str
    ip: str
    router: Router | None = None
    dev: str = "eth0"
    cgroup: str | None = None  # cpu cgroup directory every process of this host joins
    acct: str | None = None  # its cpuacct cgroup (CPU time used), where cpuacct is mounted

    @property
    def public_ip(self) -> str:
        """The address the public segment sees: the router's for a host behind NAT."""
        return self.router.public_ip if self.router is not None else self.ip

    @property
    def natted(self) -> bool:
        return self.router is not None

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside this host's namespace, and in its CPU budget if it
        has one: a shell joins the cgroups, then execs ``ip netns exec`` (which mounts its own
        /sys, hiding the cgroup tree), which execs the command, so the PID is the command's."""
        inside = ["ip", "netns", "exec", self.netns, *argv]
        if self.cgroup is None:
            return inside
        groups = [g for g in (self.cgroup, self.acct) if g is not None]
        join = " && ".join(f"echo $$ > {os.path.join(g, 'cgroup.procs')}" for g in groups)
        return ["sh", "-c", join + ' && exec "$@"', "sh", *inside]

    def run(self, *argv: str, check: bool = True, timeout: float = 20.0) -> str:
        """Run a command inside this host and return its stdout."""
        return _run(self.argv(argv), check=check, timeout=timeout)


@dataclass(eq=False)
class Topology:
    """Builds namespaces on demand; :meth:`close` (or leaving the ``with`` block) removes them."""

    mtu: int = 1500
    id: str = field(default_factory=lambda: f"{PREFIX}{os.getpid():x}x{secrets.token_hex(3)}")
    hosts: list[Host] = field(default_factory=list)
    routers: list[Router] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    _ports: int = 0
    _delay: subprocess.Popen[bytes] | None = None
    _wan: str = ""
    cgroups: list[str] = field(default_factory=list)

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- building ------------------------------------------------------------------------------
    def _netns(self, role: str) -> str:
        if not self.namespaces:
            sweep_stale()
            _LIVE.add(self)
        name = f"{self.id}-{role}"
        _run(["ip", "netns", "add", name])
        self.namespaces.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        return name

    def _bridge(self) -> str:
        if not self._wan:
            self._wan = self._netns("wan")
            _run(["ip", "-n", self._wan, "link", "add", "br0", "mtu", str(self.mtu),
                  "type", "bridge"])  # fmt: skip
            _run(["ip", "-n", self._wan, "link", "set", "br0", "up"])
            # The "internet core": the default route of every public host and router. It does
            # not forward (ip_forward=0), so a packet to an address nobody routes (a private
            # address some peer advertised) vanishes and the dial times out, as it would online.
            _run(["ip", "-n", self._wan, "addr", "add", f"{CORE}/16", "dev", "br0"])
        return self._wan

    def _veth(self, ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
        mtu = str(self.mtu)
        _run(["ip", "link", "add", dev_a, "netns", ns_a, "mtu", mtu, "type", "veth",
              "peer", "name", dev_b, "netns", ns_b, "mtu", mtu])  # fmt: skip
        _run(["ip", "-n", ns_a, "link", "set", dev_a, "up"])
        _run(["ip", "-n", ns_b, "link", "set", dev_b, "up"])

    def _plug(self, ns: str, dev: str, cidr: str) -> None:
        """Connect ``dev`` in ``ns`` to the bridge with address ``cidr``."""
        wan = self._bridge()
        self._ports += 1
        port = f"p{self._ports}"
        self._veth(ns, dev, wan, port)
        _run(["ip", "-n", wan, "link", "set", port, "master", "br0"])
        _run(["ip", "-n", ns, "addr", "add", cidr, "dev", dev])
        _run(["ip", "-n", ns, "route", "add", "default", "via", CORE])

    def add_public(self, name: str) -> Host:
        """A host on the public segment (10.200.0.<k>)."""
        k = sum(1 for h in self.hosts if h.router is None) + 10
        ns = self._netns(name)
        ip = f"10.200.0.{k}"
        self._plug(ns, "eth0", f"{ip}/16")
        host = Host(name, ns, ip)
        self.hosts.append(host)
        return host

    def add_nat(self, name: str, nat: NatKind = "cone") -> Router:
        """A NAT router on the public segment with an empty LAN behind it."""
        k = len(self.routers) + 1
        ns = self._netns(name)
        public_ip = f"10.200.1.{k}"
        self._plug(ns, "wan0", f"{public_ip}/16")
        router = Router(name, ns, public_ip, f"192.168.{k}", nat)
        ipt = iptables_command()
        if ipt is None:
            raise NetnsError("no working iptables: apt-get install iptables")
        _run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        masq = ["-j", "MASQUERADE"] + (["--random-fully"] if nat == "symmetric" else [])
        rules = [
            ["-t", "nat", "-A", "POSTROUTING", "-o", "wan0", *masq],
            ["-A", "FORWARD", "-i", "wan0", "-m", "conntrack", "--ctstate",
             "ESTABLISHED,RELATED", "-j", "ACCEPT"],
            ["-A", "FORWARD", "-i", "wan0", "-j", "DROP"],  # no unsolicited inbound
        ]  # fmt: skip
        for rule in rules:
            _run(["ip", "netns", "exec", ns, ipt, *rule])
        self.routers.append(router)
        return router

    def add_private(self, name: str, router: Router) -> Host:
        """A host on ``router``'s LAN (192.168.<k>.<2..>), default route through the router."""
        router.hosts += 1
        if router.hosts == 1:
            _run(["ip", "-n", router.netns, "link", "add", "lan0", "mtu", str(self.mtu),
                  "type", "bridge"])  # fmt: skip
            _run(["ip", "-n", router.netns, "addr", "add", f"{router.lan}.1/24", "dev", "lan0"])
            _run(["ip", "-n", router.netns, "link", "set", "lan0", "up"])
        ns = self._netns(name)
        ip = f"{router.lan}.{router.hosts + 1}"
        port = f"l{router.hosts}"
        self._veth(ns, "eth0", router.netns, port)
        _run(["ip", "-n", router.netns, "link", "set", port, "master", "lan0"])
        _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "route", "add", "default", "via", f"{router.lan}.1"])
        host = Host(name, ns, ip, router)
        self.hosts.append(host)
        return host

    # -- link conditions -----------------------------------------------------------------------
    def shape(self, host: Host, rate: float, *, queue_s: float = 0.05) -> None:
        """Cap ``host``'s uplink at ``rate`` bytes/s with a kernel token bucket (``tc tbf``).

        The bucket holds max(2 packets, 5 ms of traffic) (it must pass one whole packet), and the
        queue in front of it ``queue_s`` seconds of traffic (then tail drop)."""
        burst = max(2 * (self.mtu + 100), int(rate * 0.005))
        limit = burst + int(rate * queue_s)
        _run(["ip", "netns", "exec", host.netns, "tc", "qdisc", "replace", "dev", host.dev,
              "root", "tbf", "rate", f"{int(rate * 8)}bit", "burst", str(burst),
              "limit", str(limit)])  # fmt: skip

    def add_delay(
        self, delay_s: float, *, loss: float = 0.0, hosts: Sequence[Host] | None = None
    ) -> None:
        """Delay every packet that ``hosts`` (default: all) receive by ``delay_s`` seconds and
        drop each with probability ``loss``: one :mod:`swarm.delayline` process serves them all.
        Call after adding the hosts and before starting the processes that should see it."""
        if self._delay is not None:
            raise NetnsError("add_delay was already called for this topology")
        targets = list(self.hosts if hosts is None else hosts)
        ipt = iptables_command()
        if ipt is None:
            raise NetnsError("no working iptables: apt-get install iptables")
        for h in targets:
            h.run(ipt, "-A", "INPUT", "-i", h.dev, "-j", "NFQUEUE", "--queue-num", "0",
                  "--queue-bypass")  # fmt: skip
        argv = [sys.executable, "-m", "swarm.delayline", "--delay-ms", str(delay_s * 1000),
                "--loss", str(loss)]  # fmt: skip
        for h in targets:
            argv += ["--netns", h.netns]
        self._delay = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        assert self._delay.stdout is not None
        line = self._delay.stdout.readline().decode().strip()
        if line != "READY":
            err = self._delay.stderr.read().decode() if self._delay.stderr else ""
            raise NetnsError(f"delay line did not start: {line!r} {err.strip()[-500:]}")

    def limit_cpu(self, host: Host, cpus: float) -> None:
        """Give ``host`` a CPU budget of ``cpus`` cores (e.g. 0.25): every process started with
        ``host.argv`` from now on, and its children, share ``cpus`` x the CFS period per period.
        Raises :class:`NetnsError` when cgroups cannot be used (:func:`cpu_limit_unavailable`)."""
        reason = cpu_limit_unavailable()
        if reason is not None:
            raise NetnsError(reason)
        if not cpus > 0:
            raise NetnsError(f"a CPU budget must be > 0 cores, got {cpus}")
        path = os.path.join(CPU_CGROUP, f"{self.id}-{host.name}")
        os.makedirs(path, exist_ok=True)
        self.cgroups.append(path)
        with open(os.path.join(path, "cpu.cfs_period_us"), "w") as fh:
            fh.write(str(CFS_PERIOD_US))
        with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as fh:
            fh.write(str(max(1000, int(cpus * CFS_PERIOD_US))))
        host.cgroup = path
        if os.path.realpath(ACCT_CGROUP) != os.path.realpath(CPU_CGROUP) and os.access(
            ACCT_CGROUP, os.W_OK
        ):
            acct = os.path.join(ACCT_CGROUP, f"{self.id}-{host.name}")
            os.makedirs(acct, exist_ok=True)
            self.cgroups.append(acct)
            host.acct = acct
        _LIVE.add(self)

    def cpu_usage(self, host: Host) -> dict[str, float]:
        """What ``host``'s budget has seen so far: ``cpu_s`` (CPU seconds its processes used,
        from cpuacct; NaN where cpuacct is not mounted), ``throttled_s`` and ``periods_throttled``
        (time and CFS periods its processes were held back by the quota). Empty without a budget."""
        if host.cgroup is None:
            return {}
        out = {"cpu_s": float("nan")}
        with open(os.path.join(host.cgroup, "cpu.stat")) as fh:
            stat = dict(line.split()[:2] for line in fh if line.strip())
        out["throttled_s"] = int(stat.get("throttled_time", 0)) / 1e9
        out["periods_throttled"] = float(stat.get("nr_throttled", 0))
        if host.acct is not None:
            with open(os.path.join(host.acct, "cpuacct.usage")) as fh:
                out["cpu_s"] = int(fh.read()) / 1e9
        return out

    # -- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the delay line, end what still runs inside, delete every namespace (idempotent)."""
        if self._delay is not None:
            proc, self._delay = self._delay, None
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for ns in reversed(self.namespaces):
            _kill_inside(ns)
        for ns in reversed(self.namespaces):
            _run(["ip", "netns", "del", ns], check=False)
        for path in reversed(self.cgroups):
            _remove_cgroup(path)
        self.cgroups.clear()
        self.namespaces.clear()
        self._wan = ""
        _LIVE.discard(self)

    def alive(self) -> list[str]:
        """Namespaces of this topology that still exist (tests check teardown with it)."""
        listed = {line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line}
        return [ns for ns in self.namespaces if ns in listed]


@atexit.register
def _close_all() -> None:
    for topo in list(_LIVE):
        with contextlib.suppress(Exception):
            topo.close()
