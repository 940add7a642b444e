"""Network facts and checks a node can make about itself before its ranks start. Standard library only.

- `route_interface(main)`: the interface this node reaches the main node on (`network_interface: auto`): the source
  address the kernel picks for a UDP "connection" to the main node (no packet is sent), then the interface that holds
  that address (or whose network contains it: 127.0.0.x is lo's). On the main node itself that is the interface its
  address is assigned to, not lo.
- `check_interface(name)`: a named interface exists on this host (else the problem, naming what does exist).
- `check_ib_hca(value)`: NCCL_IB_HCA (`mlx5_0,mlx5_1:1`, `=mlx5_0`, `^mlx5_2`) against /sys/class/infiniband.
- `wait_reachable(host, port, timeout)`: a node that is not the main one connects to the main node's rendezvous port
  until it answers or `timeout` seconds pass (a firewall that drops the port shows up here within seconds, instead of
  as torchrun's static rendezvous waiting 10 minutes).
- `bind_env(env, ...)`: the late facts of a node's rank environment (`${network_interface}`, `${RUN_DIR}`).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import threading
import time

from orchestrator.core.jobplan import LATE_IFNAME, RUN_DIR_VAR

IB_DIR = "/sys/class/infiniband"
_SIOCGIFADDR, _SIOCGIFNETMASK = 0x8915, 0x891B


def interface_names() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def _ipv4(name: str) -> tuple[str, int] | None:
    """(address, prefix length) of an interface's primary IPv4 address, by ioctl; None without one."""
    import fcntl
    req = struct.pack("256s", name[:15].encode())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFNETMASK, req)[20:24])
        except OSError:
            return None
    return addr, ipaddress.IPv4Network(f"0.0.0.0/{mask}").prefixlen


def _ipv6() -> dict[str, list[tuple[str, int]]]:
    out: dict[str, list[tuple[str, int]]] = {}
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6:
                    addr = str(ipaddress.IPv6Address(bytes.fromhex(parts[0])))
                    out.setdefault(parts[5], []).append((addr, int(parts[2], 16)))
    except (OSError, ValueError):
        pass
    return out


def addresses() -> dict[str, list[tuple[str, int]]]:
    """{interface: [(address, prefix length), ...]} (IPv4 primary address and IPv6 addresses)."""
    v6 = _ipv6()
    out: dict[str, list[tuple[str, int]]] = {}
    for name in interface_names():
        got = [a for a in (_ipv4(name),) if a is not None] + v6.get(name, [])
        out[name] = got
    return out


def owner_of(address: str, table: dict[str, list[tuple[str, int]]] | None = None) -> str | None:
    """The interface that holds `address`, else the one whose network contains it (longest prefix)."""
    table = addresses() if table is None else table
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return None
    if ip.is_loopback:
        return next((n for n, addrs in table.items() if any(ipaddress.ip_address(a).is_loopback for a, _ in addrs)),
                    "lo" if "lo" in table else None)
    best: tuple[int, str] | None = None
    for name, addrs in table.items():
        for addr, plen in addrs:
            net = ipaddress.ip_network(f"{addr}/{plen}", strict=False)
            if ipaddress.ip_address(addr) == ip:
                return name
            if ip.version == net.version and ip in net and (best is None or plen > best[0]):
                best = (plen, name)
    return best[1] if best else None


def route_interface(main: str) -> tuple[str | None, str]:
    """(interface this node reaches `main` on, or None; the source address or the reason it failed)."""
    try:
        infos = socket.getaddrinfo(main, 9, type=socket.SOCK_DGRAM)
    except OSError as e:
        return None, f"cannot resolve the main node {main!r} ({e.strerror or e})"
    infos.sort(key=lambda i: i[0] != socket.AF_INET)  # IPv4 first
    family, _, _, _, sockaddr = infos[0]
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            src = s.getsockname()[0]
    except OSError as e:
        return None, f"no route to the main node {main} ({e.strerror or e})"
    name = owner_of(src)
    if name is None:
        return None, f"no interface holds {src}, the source address towards the main node {main}"
    return name, src


def interface_address(name: str) -> str | None:
    """The address to bind on interface `name` (IPv4 first); None when it has none."""
    addrs = addresses().get(name) or []
    v4 = [a for a, _ in addrs if ":" not in a]
    return (v4 or [a for a, _ in addrs if not a.startswith("fe80")] or [None])[0]


def check_interface(name: str, host: str | None = None) -> str | None:
    """None when interface `name` exists here, else the problem naming the interfaces that do."""
    names = interface_names()
    if name in names:
        return None
    return (f"network_interface {name!r} does not exist on {host or socket.gethostname()} "
            f"(its interfaces: {', '.join(names) or 'none'})")


def check_ib_hca(value: str, host: str | None = None, root: str = IB_DIR) -> str | None:
    """None when NCCL_IB_HCA names InfiniBand devices (and ports) this host has, else the problem."""
    spec = value.strip()
    if not spec or spec.startswith("^"):
        return None  # empty, or an exclusion list: nothing is required to exist
    exact = spec.startswith("=")
    wanted = [w.strip() for w in spec.lstrip("=").split(",") if w.strip()]
    try:
        have = sorted(os.listdir(root))
    except OSError:
        have = []
    where = host or socket.gethostname()
    if not have:
        return f"NCCL_IB_HCA={value} but {where} has no InfiniBand devices ({root} is empty or missing)"
    missing = []
    for w in wanted:
        dev, _, port = w.partition(":")
        found = [h for h in have if (h == dev if exact else h.startswith(dev))]
        if not found or (port and not any(os.path.isdir(os.path.join(root, h, "ports", port)) for h in found)):
            missing.append(w)
    if missing:
        return (f"NCCL_IB_HCA={value}: {', '.join(missing)} not found on {where} "
                f"(its InfiniBand devices: {', '.join(have)})")
    return None


def wait_reachable(host: str, port: int, timeout: float, stop: threading.Event | None = None,
                   refused_timeout: float | None = None, attempt_s: float = 1.0) -> str | None:
    """Connect to host:port until it answers (None) or the time is up (the problem). Attempts that time out or find no
    route (a firewall dropping the port, a wrong address) fail after `timeout` seconds; refused connections (nothing
    listens yet: the main node's launcher is still starting, or a firewall rejects) after `refused_timeout`
    (default max(2 x timeout, 60 s))."""
    start = time.monotonic()
    refused_timeout = max(2 * timeout, 60.0) if refused_timeout is None else refused_timeout
    last, refused = "no attempt", False
    while not (stop is not None and stop.is_set()):
        waited = time.monotonic() - start
        limit = refused_timeout if refused else timeout
        if waited >= limit:
            return f"cannot reach {host}:{port} within {limit:g} s ({last})"
        try:
            with socket.create_connection((host, port), timeout=min(attempt_s, max(0.05, limit - waited))):
                return None
        except ConnectionRefusedError:
            last, refused = "connection refused: nothing listens there, or a firewall rejects it", True
        except socket.timeout:
            last, refused = "connection attempts time out: packets to the port are dropped (a firewall?)", False
        except OSError as e:
            last, refused = e.strerror or str(e), False
        time.sleep(0.2 if refused else 0.05)
    return None


def bind_env(env: dict[str, str], run_dir: str, main: str, host: str | None = None
             ) -> tuple[dict[str, str], str | None]:
    """(env with `${RUN_DIR}` and `${network_interface}` bound, problem or None). `${network_interface}` becomes the
    interface that routes to `main`."""
    out = dict(env)
    for k, v in env.items():
        if v.startswith(RUN_DIR_VAR):
            out[k] = run_dir + v[len(RUN_DIR_VAR):]
    if any(v == LATE_IFNAME for v in out.values()):
        name, why = route_interface(main)
        if name is None:
            return out, f"network_interface auto: {why} on {host or socket.gethostname()}"
        out = {k: (name if v == LATE_IFNAME else v) for k, v in out.items()}
    return out, None
