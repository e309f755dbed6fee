"""The namespace topology itself (``swarm.netns``): NAT behaviour, shaping, delay, teardown.

Timing checks are lower bounds only (a loaded machine makes things slower, never faster).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from swarm.netns import Host, Topology, unavailable_reason

# A server that answers every connection with the address it sees the client at.
ECHO_ADDR = """
import socket, sys, threading
def serve(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen()
    while True:
        c, addr = s.accept(); c.sendall(f"{addr[0]} {addr[1]}".encode()); c.close()
for port in sys.argv[1:]:
    threading.Thread(target=serve, args=(int(port),), daemon=True).start()
print("up", flush=True)
threading.Event().wait()
"""

# Connects from one fixed local port to each given port of a server; prints what it saw.
FROM_ONE_PORT = """
import socket, sys
seen = []
for port in sys.argv[2:]:
    c = socket.socket(); c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    c.bind(("0.0.0.0", 40000)); c.settimeout(3); c.connect((sys.argv[1], int(port)))
    seen.append(c.recv(100).decode()); c.close()
print("|".join(seen))
"""

# Measures the TCP connect time to ip:port, then the time to send N bytes and get a reply.
TIMED_SEND = """
import socket, sys, time
ip, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t0 = time.monotonic(); c = socket.create_connection((ip, port), 5); t1 = time.monotonic()
c.settimeout(60); c.sendall(b"x" * n); c.shutdown(socket.SHUT_WR); c.recv(1)
print(t1 - t0, time.monotonic() - t1)
"""

SINK = """
import socket
s = socket.socket(); s.bind(("0.0.0.0", 9100)); s.listen(); print("up", flush=True)
while True:
    c, _ = s.accept()
    while c.recv(1 << 20):
        pass
    c.sendall(b"k"); c.close()
"""


def _serve(host: Host, code: str, *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        host.argv([sys.executable, "-c", code, *args]), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    return proc


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(5)


def test_nat_hides_hosts_and_symmetric_nat_changes_ports(topology: Topology) -> None:
    server = topology.add_public("server")
    cone = topology.add_private("a", topology.add_nat("cone", "cone"))
    sym = topology.add_private("b", topology.add_nat("sym", "symmetric"))
    echo = _serve(server, ECHO_ADDR, "9001", "9002", "9003")
    try:
        ports = ("9001", "9002", "9003")
        seen_cone = cone.run(sys.executable, "-c", FROM_ONE_PORT, server.ip, *ports).split("|")
        seen_sym = sym.run(sys.executable, "-c", FROM_ONE_PORT, server.ip, *ports).split("|")
    finally:
        _stop(echo)
    # Both leave through their router's public address ...
    assert {s.split()[0] for s in seen_cone} == {cone.public_ip}
    assert {s.split()[0] for s in seen_sym} == {sym.public_ip}
    # ... the port-preserving NAT keeps the local port, the symmetric one maps each
    # connection to a new port (three random ports are all equal with p ~ 1e-9).
    assert {s.split()[1] for s in seen_cone} == {"40000"}
    assert len({s.split()[1] for s in seen_sym}) > 1
    # Nobody on the public side can open a connection to a NATed host, by any address.
    inside = _serve(cone, ECHO_ADDR, "9001")
    try:
        probe = "import socket,sys; socket.create_connection((sys.argv[1], 9001), 2)"
        for target in (cone.ip, cone.public_ip):
            out = subprocess.run(server.argv([sys.executable, "-c", probe, target]),
                                 capture_output=True, timeout=20)  # fmt: skip
            assert out.returncode != 0, f"{target}:9001 was reachable from the public side"
    finally:
        _stop(inside)


def test_tbf_caps_the_uplink_and_the_delay_line_adds_latency(topology: Topology) -> None:
    a, b = topology.add_public("a"), topology.add_public("b")
    rate, delay, size = 1 << 20, 0.05, 2 << 20
    topology.shape(a, rate)
    topology.add_delay(delay)
    sink = _serve(b, SINK)
    try:
        out = a.run(sys.executable, "-c", TIMED_SEND, b.ip, "9100", str(size), timeout=60)
    finally:
        _stop(sink)
    connect_s, send_s = map(float, out.split())
    assert connect_s >= 2 * delay * 0.95, f"connect took {connect_s:.3f} s: no delay added"
    # 2 MiB at 1 MiB/s: 2 s, less what the bucket and its queue let through at once (~60 KiB)
    assert send_s >= 0.9 * size / rate, f"2 MiB left in {send_s:.2f} s: the uplink is not capped"


def test_teardown_removes_everything_even_when_the_test_fails() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    listed = lambda: subprocess.run(["ip", "netns", "list"], capture_output=True,  # noqa: E731
                                    text=True).stdout  # fmt: skip
    sleeper: subprocess.Popen[bytes] | None = None
    with pytest.raises(RuntimeError, match="boom"), Topology() as topo:
        host = topo.add_private("x", topo.add_nat("r", "symmetric"))
        topo.add_delay(0.01)
        sleeper = subprocess.Popen(host.argv(["sleep", "60"]))
        names = list(topo.namespaces)
        assert all(n in listed() for n in names)
        raise RuntimeError("boom")
    assert not any(n in listed() for n in names), "namespaces left behind"
    assert sleeper is not None
    t0 = time.monotonic()
    while sleeper.poll() is None and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert sleeper.poll() is not None, "a process inside the topology outlived it"


# Spins for the given wall-clock seconds; prints the CPU seconds it got meanwhile.
SPIN = """
import sys, time
c0, end = time.process_time(), time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    pass
print(time.process_time() - c0)
"""


def test_cpu_budget_holds_a_host_to_its_share(topology: Topology) -> None:
    from swarm.netns import cpu_limit_unavailable

    reason = cpu_limit_unavailable()
    if reason is not None:
        pytest.skip(reason)
    host = topology.add_public("cpu")
    budget, wall = 0.05, 2.0  # 5 ms per 100 ms period: a spinning process wants far more
    topology.limit_cpu(host, budget)
    groups = list(topology.cgroups)
    assert groups and all(os.path.isdir(g) for g in groups)
    out = host.run(sys.executable, "-c", SPIN, str(wall), timeout=60)
    used = float(out.strip())
    # the quota allows budget x wall (+ one period of slack at the edges); a loaded machine can
    # only give less, never more
    assert used <= budget * wall + 0.02, f"spun {used:.3f} CPU-s in {wall} s, budget {budget}"
    usage = topology.cpu_usage(host)
    assert usage["periods_throttled"] > 0 and usage["throttled_s"] > 0, usage
    if usage["cpu_s"] == usage["cpu_s"]:  # cpuacct mounted: it saw the same process
        assert usage["cpu_s"] >= used * 0.9, usage
    topology.close()
    assert not any(os.path.exists(g) for g in groups), "cgroups left behind"
