"""Emulated internet links between peers on one Linux machine: namespaces, a bridge, tbf, delay, loss.

Each peer gets its own network namespace ``mn-<runid>-p<i>`` with one interface ``eth0`` (address
``10.77.<i // 250>.<i % 250 + 1>/16``). A hub namespace ``mn-<runid>-hub`` holds a bridge ``br0``
and the other end of every peer's veth pair (``p<i>``). Nothing is created in the host namespace,
so deleting our namespaces removes every link, qdisc and iptables rule we made.

Per peer, both directions are shaped separately (the peer's "access link"):

- upload: ``tbf`` on the peer's ``eth0`` egress; download: ``tbf`` on the hub's ``p<i>`` egress;
- one-way delay (``--delay-ms``) on *arriving* packets: an iptables ``mangle PREROUTING`` rule sends
  them to NFQUEUE 0, and ``scripts/delayq.c`` (libnetfilter_queue, compiled on first use) holds each
  one for the delay. The kernels we target have no ``netem`` qdisc. Delaying on the receiver keeps
  the sender's TCP stack unaware (delaying on the sender's OUTPUT throttles TCP to a few Mbit/s via
  TCP small queues). A path A -> B carries B's delay, B -> A carries A's: RTT = 2 * delay;
- loss (``--loss`` percent) on arriving packets: ``raw PREROUTING -m statistic --mode random -j DROP``;
- TSO/GSO/GRO are switched off on every veth by default, so tbf, loss and delay act on real
  MTU-sized packets, not kernel super-packets (``--offloads`` keeps them on).

The namespaces inherit the host's TCP congestion control (``bbr`` on our machines) unless ``--cc``
sets one; every measurement records the one in effect.

Crash safety: the state file (JSON) is rewritten *before* each namespace or process is created,
so ``down`` can always remove exactly what a run made, even after a crash; without a state file,
``down --run-id ID`` removes the namespaces named ``mn-ID-*``.

CLI (root only)::

    python scripts/netem.py up --peers 4 --rate-mbit 200 --delay-ms 20 --loss 0.1 --state /tmp/mn.json
    python scripts/netem.py exec --state /tmp/mn.json --peer 1 -- ip addr
    python scripts/netem.py measure --state /tmp/mn.json --src 0 --dst 1 --seconds 5
    python scripts/netem.py down --state /tmp/mn.json

Python API (for benchmarks: ``sys.path.insert(0, "scripts"); import netem``)::

    with netem.emulated_network(NetemConfig(peers=2, rate_mbit=20), state_path) as net:
        result = net.measure(0, 1, seconds=3.0)      # Measurement(mbit_per_s=..., rtt_ms=..., ...)
        proc = net.popen(1, [sys.executable, "server.py", "--host", net.address(1)])
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("netem")

NAME_PREFIX = "mn-"
HUB_BRIDGE = "br0"
PEER_IFACE = "eth0"
DELAY_QUEUE_NUM = 0
STATE_VERSION = 1
DEBIAN_PACKAGES = {  # command or file -> Debian package
    "ip": "iproute2",
    "tc": "iproute2",
    "iptables": "iptables",
    "ethtool": "ethtool",
    "gcc": "gcc",
    "/usr/include/libnetfilter_queue/libnetfilter_queue.h": "libnetfilter-queue-dev",
    "ping": "iputils-ping",
}
DELAYQ_SOURCE = Path(__file__).resolve().with_name("delayq.c")
DEFAULT_CACHE = Path("/tmp/meshnode-netem")


class NetemError(RuntimeError):
    """A command that builds or tears down the emulated network failed."""


# ---------------------------------------------------------------------------------------------
# Config, state


@dataclass(kw_only=True)
class NetemConfig:
    """What to build. Rates are per peer and per direction (upload and download each get ``rate_mbit``)."""

    peers: int
    rate_mbit: float
    delay_ms: float = 0.0  # one-way, added to every packet arriving at a peer
    loss_pct: float = 0.0  # percent of packets dropped on arrival at a peer
    offloads: bool = False  # keep TSO/GSO/GRO on (faster, but loss/delay act on super-packets)
    congestion_control: str | None = None  # None: inherit the host's
    queue_ms: float | None = None  # tbf queue length in ms of line rate; None: max(50, 2 * delay_ms)
    mtu: int = 1500

    def validate(self) -> None:
        if not 2 <= self.peers <= 2000:
            raise ValueError(f"peers must be in [2, 2000], got {self.peers}")
        if self.rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0, got {self.rate_mbit}")
        if self.delay_ms < 0 or not 0 <= self.loss_pct < 100:
            raise ValueError("delay_ms must be >= 0 and loss_pct in [0, 100)")


@dataclass
class NetemState:
    """Everything a run created; written to the state file before each creation."""

    run_id: str
    config: dict
    namespaces: list[str] = field(default_factory=list)
    processes: list[dict] = field(default_factory=list)  # {"pid", "start_time", "ns", "what"}
    congestion_control: str | None = None
    complete: bool = False
    version: int = STATE_VERSION

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> NetemState:
        data = json.loads(Path(path).read_text())
        if data.get("version") != STATE_VERSION:
            raise NetemError(f"{path}: unknown state version {data.get('version')!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class Measurement:
    """One ``measure`` run between two peers."""

    src: int
    dst: int
    mbit_per_s: float  # receiver-side goodput (TCP payload), first byte to last byte
    bytes: int
    seconds: float
    rtt_ms: float  # median TCP request/response round trip (1-byte messages, TCP_NODELAY)
    rtt_ms_min: float
    ping_rtt_ms: float | None  # `ping -U` average, when ping exists
    congestion_control: str
    rate_mbit: float
    delay_ms: float
    loss_pct: float
    offloads: bool
    bins_100ms: list[int] = dataclasses.field(default_factory=list)  # bytes received per 100 ms

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Small helpers


def _run(argv: Sequence[str], *, check: bool = True, capture: bool = True, timeout: float = 30.0) -> str:
    logger.debug("run: %s", " ".join(argv))
    proc = subprocess.run(list(argv), capture_output=capture, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise NetemError(f"command failed ({proc.returncode}): {' '.join(argv)}\n{(proc.stderr or '').strip()}")
    return proc.stdout or ""


def _ns_argv(ns: str, argv: Sequence[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _proc_start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22 overall


def _wait_for_line(proc: subprocess.Popen, expected: str, deadline_s: float) -> None:
    """Read ``proc.stdout`` until a line equal to ``expected`` arrives, or raise at the deadline."""
    end = time.monotonic() + deadline_s
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = b""
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
        if expected.encode() in buf.split(b"\n"):
            return
    proc.poll()
    raise NetemError(f"process {proc.args!r} did not print {expected!r} (exit code {proc.returncode}, got {buf!r})")


def missing_tools() -> list[str]:
    """Debian packages needed by ``up`` that are not installed."""
    missing = set()
    for tool, package in DEBIAN_PACKAGES.items():
        present = Path(tool).exists() if tool.startswith("/") else shutil.which(tool) is not None
        if not present:
            missing.add(package)
    return sorted(missing)


def ensure_tools(install: bool = True) -> None:
    """Install missing Debian packages (root only), or raise naming them."""
    missing = missing_tools()
    if not missing:
        return
    if not install or os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise NetemError(f"missing Debian packages: {' '.join(missing)}")
    logger.info("installing %s", " ".join(missing))
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if not Path("/var/lib/apt/lists").exists() or not any(Path("/var/lib/apt/lists").glob("*Packages*")):
        subprocess.run(["apt-get", "update"], check=True, env=env, capture_output=True, timeout=600)
    subprocess.run(
        ["apt-get", "install", "-y", "--no-install-recommends", *missing],
        check=True, env=env, capture_output=True, timeout=900,
    )


def build_delayq(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Compile ``scripts/delayq.c`` once per source version; return the binary's path."""
    digest = hashlib.sha256(DELAYQ_SOURCE.read_bytes()).hexdigest()[:12]
    binary = cache_dir / f"delayq-{digest}"
    if binary.exists():
        return binary
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = binary.with_name(binary.name + f".{os.getpid()}")
    _run(["gcc", "-O2", "-o", str(tmp), str(DELAYQ_SOURCE), "-lnetfilter_queue", "-lnfnetlink"], timeout=120)
    os.replace(tmp, binary)
    return binary


def peer_address(i: int) -> str:
    """IPv4 address of peer ``i`` (inside our namespaces only)."""
    return f"10.77.{i // 250}.{i % 250 + 1}"


# ---------------------------------------------------------------------------------------------
# The network


class EmulatedNetwork:
    """A set of shaped peer namespaces described by a state file. Use :func:`emulated_network`."""

    def __init__(self, state: NetemState, state_path: Path):
        self.state = state
        self.state_path = Path(state_path)

    # -- names --------------------------------------------------------------------------------
    @property
    def run_id(self) -> str:
        return self.state.run_id

    @property
    def config(self) -> NetemConfig:
        return NetemConfig(**self.state.config)

    @property
    def peers(self) -> int:
        return int(self.state.config["peers"])

    @staticmethod
    def _prefix(run_id: str) -> str:
        return f"{NAME_PREFIX}{run_id}-"

    def hub_ns(self) -> str:
        return f"{self._prefix(self.run_id)}hub"

    def peer_ns(self, i: int) -> str:
        if not 0 <= i < self.peers:
            raise IndexError(f"peer {i} out of range [0, {self.peers})")
        return f"{self._prefix(self.run_id)}p{i}"

    def address(self, i: int) -> str:
        self.peer_ns(i)
        return peer_address(i)

    # -- running commands in a peer -------------------------------------------------------------
    def argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside peer ``i``'s namespace."""
        return _ns_argv(self.peer_ns(i), argv)

    def run(self, i: int, argv: Sequence[str], timeout: float = 60.0, check: bool = True) -> str:
        return _run(self.argv(i, argv), timeout=timeout, check=check)

    def link_bytes(self) -> dict[int, tuple[int, int]]:
        """``{peer: (uploaded, downloaded)}`` bytes so far on each peer's access link: everything on the wire
        (IP and TCP headers, libp2p framing, the DHT, retransmissions), read from the hub's ports in one call."""
        out: dict[int, tuple[int, int]] = {}
        for link in json.loads(_run(["ip", "-n", self.hub_ns(), "-s", "-j", "link", "show"])):
            name = link.get("ifname", "")
            if name.startswith("p") and name[1:].isdigit():
                st = link.get("stats64") or link.get("stats") or {}
                # the hub port receives what the peer sends, and transmits what the peer downloads
                out[int(name[1:])] = (int(st["rx"]["bytes"]), int(st["tx"]["bytes"]))
        return out

    def tcp_counters(self, i: int) -> dict[str, int]:
        """Peer ``i``'s kernel TCP counters (its namespace's ``/proc/net/snmp``): segments sent, received and
        retransmitted so far. Linux counts ``OutSegs`` only for segments that carry new data (or none), so
        retransmissions come on top: ``retrans / (out + retrans)`` is the share of the uplink they took. A sender
        whose own egress qdisc (the upload ``tbf``) drops can retransmit more segments than it sends new."""
        lines = [ln.split() for ln in self.run(i, ["cat", "/proc/net/snmp"]).splitlines() if ln.startswith("Tcp:")]
        if len(lines) < 2:
            raise RuntimeError(f"no Tcp counters in peer {i}'s /proc/net/snmp")
        row = dict(zip(lines[0][1:], lines[1][1:]))
        return {"out_segs": int(row["OutSegs"]), "in_segs": int(row["InSegs"]),
                "retrans_segs": int(row["RetransSegs"])}

    def popen(self, i: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside peer ``i``; the caller stops it (``down`` kills leftovers too)."""
        return subprocess.Popen(self.argv(i, argv), **kwargs)

    # -- build -----------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        config: NetemConfig,
        state_path: Path,
        *,
        run_id: str | None = None,
        install: bool = True,
        cache_dir: Path = DEFAULT_CACHE,
    ) -> EmulatedNetwork:
        """Build the network. On any failure, everything created so far is removed again."""
        if os.geteuid() != 0:
            raise NetemError("netem needs root (network namespaces, tc, iptables)")
        config.validate()
        allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
        if config.congestion_control and config.congestion_control not in allowed:
            raise NetemError(f"congestion control {config.congestion_control!r} is not allowed in namespaces "
                             f"(host allows {' '.join(allowed)}); `measure --cc` sets it per socket instead")
        ensure_tools(install=install)
        delayq = build_delayq(cache_dir) if config.delay_ms > 0 else None
        state_path = Path(state_path)
        if state_path.exists():
            raise NetemError(f"{state_path} exists: run `down --state {state_path}` first")
        run_id = run_id or secrets.token_hex(3)
        net = cls(NetemState(run_id=run_id, config=dataclasses.asdict(config)), state_path)
        if any(ns.startswith(cls._prefix(run_id)) for ns in list_namespaces()):
            raise NetemError(f"namespaces with prefix {cls._prefix(run_id)} already exist")
        net.state.save(state_path)
        try:
            net._build(config, delayq)
        except BaseException:
            logger.error("build failed; tearing down run %s", run_id)
            net.teardown()
            raise
        return net

    def _add_namespace(self, ns: str) -> None:
        self.state.namespaces.append(ns)
        self.state.save(self.state_path)  # record first: a crash right after still gets cleaned
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _build(self, config: NetemConfig, delayq: Path | None) -> None:
        hub = self.hub_ns()
        self._add_namespace(hub)
        _run(["ip", "-n", hub, "link", "add", HUB_BRIDGE, "type", "bridge"])
        _run(["ip", "-n", hub, "link", "set", HUB_BRIDGE, "up"])
        rate = f"{config.rate_mbit}mbit"
        rate_bytes = config.rate_mbit * 1e6 / 8
        queue_s = (config.queue_ms if config.queue_ms is not None else max(50.0, 2 * config.delay_ms)) / 1e3
        burst = int(max(rate_bytes * 0.002, 4 * config.mtu, 16384))  # 2 ms of line rate, at least 16 KiB
        limit = int(max(rate_bytes * queue_s, 2 * burst))
        tbf = ["tbf", "rate", rate, "burst", str(burst), "limit", str(limit)]
        for i in range(self.peers):
            ns, hub_port = self.peer_ns(i), f"p{i}"
            self._add_namespace(ns)
            _run(["ip", "-n", hub, "link", "add", hub_port, "mtu", str(config.mtu), "type", "veth",
                  "peer", "name", PEER_IFACE, "netns", ns])
            _run(["ip", "-n", hub, "link", "set", hub_port, "master", HUB_BRIDGE])
            _run(["ip", "-n", hub, "link", "set", hub_port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{peer_address(i)}/16", "dev", PEER_IFACE])
            _run(["ip", "-n", ns, "link", "set", PEER_IFACE, "up"])
            if not config.offloads:
                for where, dev in ((ns, PEER_IFACE), (hub, hub_port)):
                    _run(_ns_argv(where, ["ethtool", "-K", dev, "tso", "off", "gso", "off", "gro", "off"]))
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", PEER_IFACE, "root", *tbf])  # upload
            _run(["tc", "-n", hub, "qdisc", "replace", "dev", hub_port, "root", *tbf])  # download
            if config.congestion_control:
                cc = f"net.ipv4.tcp_congestion_control={config.congestion_control}"
                _run(_ns_argv(ns, ["sysctl", "-q", "-w", cc]))
            if config.loss_pct > 0:
                _run(_ns_argv(ns, ["iptables", "-w", "-t", "raw", "-A", "PREROUTING", "-i", PEER_IFACE, "-m",
                                   "statistic", "--mode", "random", "--probability", f"{config.loss_pct / 100:.6f}",
                                   "-j", "DROP"]))
            if delayq is not None:
                self._start_delayq(i, delayq, config.delay_ms)
                _run(_ns_argv(ns, ["iptables", "-w", "-t", "mangle", "-A", "PREROUTING", "-i", PEER_IFACE,
                                   "-j", "NFQUEUE", "--queue-num", str(DELAY_QUEUE_NUM)]))
        self.state.congestion_control = _run(
            _ns_argv(self.peer_ns(0), ["sysctl", "-n", "net.ipv4.tcp_congestion_control"])).strip()
        self.state.complete = True
        self.state.save(self.state_path)
        logger.info("netem %s up: %d peers, %s each way, delay %.1f ms, loss %.2f%%, cc %s", self.run_id,
                    self.peers, rate, config.delay_ms, config.loss_pct, self.state.congestion_control)

    def _start_delayq(self, i: int, binary: Path, delay_ms: float) -> None:
        ns = self.peer_ns(i)
        log = self.state_path.with_name(f"{self.state_path.name}.delayq-p{i}.log")
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                _ns_argv(ns, [str(binary), str(DELAY_QUEUE_NUM), str(int(round(delay_ms * 1000)))]),
                stdout=subprocess.PIPE, stderr=err, start_new_session=True,
            )
        # `ip netns exec` execs the program, so this pid is delayq's own.
        self.state.processes.append(
            {"pid": proc.pid, "start_time": _proc_start_time(proc.pid), "ns": ns, "what": "delayq", "log": str(log)})
        self.state.save(self.state_path)
        _wait_for_line(proc, "ready", deadline_s=10.0)
        proc.stdout.close()

    # -- teardown --------------------------------------------------------------------------------
    def teardown(self) -> None:
        """Remove everything this run created (idempotent), then the state file."""
        teardown_run(self.state, self.state_path)

    def __enter__(self) -> EmulatedNetwork:
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    # -- measure ---------------------------------------------------------------------------------
    def congestion_control(self, i: int) -> str:
        return self.run(i, ["sysctl", "-n", "net.ipv4.tcp_congestion_control"]).strip()

    def measure(self, src: int, dst: int, seconds: float = 5.0, rtt_probes: int = 20, port: int = 5201,
                ping: bool = True, congestion_control: str | None = None) -> Measurement:
        """Bulk TCP transfer ``src`` -> ``dst`` for ``seconds`` (python sockets) plus RTT probes.

        ``congestion_control`` sets TCP_CONGESTION on the sockets (any algorithm the kernel has, as root);
        by default the namespace's own is used. The one in effect is recorded.
        """
        cc = ["--cc", congestion_control] if congestion_control else []
        sink = self.popen(dst, [sys.executable, __file__, "_sink", "--bind", self.address(dst), "--port", str(port),
                                *cc], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            _wait_for_line(sink, "ready", deadline_s=15.0)
            out = self.run(src, [sys.executable, __file__, "_source", "--connect", self.address(dst), "--port",
                                 str(port), "--seconds", str(seconds), "--rtt-probes", str(rtt_probes), *cc],
                           timeout=seconds + 60)
            sink.wait(timeout=15)
        finally:
            if sink.poll() is None:
                sink.kill()
                sink.wait()
        result = json.loads(out.strip().splitlines()[-1])
        ping_rtt = None
        if ping and shutil.which("ping"):
            text = self.run(src, ["ping", "-U", "-q", "-c", "5", "-i", "0.2", "-W", "5", self.address(dst)],
                            check=False, timeout=30)
            for line in text.splitlines():
                if "min/avg/max" in line:
                    ping_rtt = float(line.split("=")[1].split("/")[1])
        cfg = self.config
        return Measurement(
            src=src, dst=dst, mbit_per_s=result["bytes"] * 8 / result["seconds"] / 1e6, bytes=result["bytes"],
            seconds=result["seconds"], rtt_ms=result["rtt_ms_median"], rtt_ms_min=result["rtt_ms_min"],
            ping_rtt_ms=ping_rtt, congestion_control=result["congestion_control"], rate_mbit=cfg.rate_mbit,
            delay_ms=cfg.delay_ms, loss_pct=cfg.loss_pct, offloads=cfg.offloads, bins_100ms=result["bins_100ms"],
        )


def _kill_pid(pid: int, start_time: int | None, deadline_s: float = 5.0) -> None:
    """SIGTERM ``pid`` if it is still the process we started, then SIGKILL at the deadline."""
    if start_time is not None and _proc_start_time(pid) != start_time:
        return  # gone, or the pid was reused by someone else
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if _proc_start_time(pid) is None or _is_zombie(pid):
            return
        time.sleep(0.02)  # poll loop with a deadline
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _teardown_namespaces(namespaces: Sequence[str]) -> list[str]:
    existing = set(list_namespaces())
    errors = []
    for ns in namespaces:
        if ns not in existing:
            continue
        # Processes still inside (delay programs, commands run with `exec`) keep a namespace alive.
        for pid in _run(["ip", "netns", "pids", ns], check=False).split():
            _kill_pid(int(pid), _proc_start_time(int(pid)))
        try:
            _run(["ip", "netns", "del", ns])
        except NetemError as exc:
            errors.append(str(exc))
    return errors


def teardown_run(state: NetemState, state_path: Path | None) -> None:
    """Kill the run's processes, delete its namespaces (links, qdiscs and rules go with them)."""
    for proc in state.processes:
        _kill_pid(int(proc["pid"]), proc.get("start_time"))
        if proc.get("log"):
            with contextlib.suppress(OSError):
                Path(proc["log"]).unlink()
    prefix = EmulatedNetwork._prefix(state.run_id)
    names = [ns for ns in state.namespaces if ns.startswith(prefix)]  # never touch anything else
    errors = _teardown_namespaces(list(reversed(names)))
    left = [ns for ns in list_namespaces() if ns in names]
    if errors or left:
        raise NetemError(f"teardown of {state.run_id} incomplete: left {left}; {errors}")
    if state_path is not None:
        with contextlib.suppress(FileNotFoundError):
            Path(state_path).unlink()
    logger.info("netem %s down", state.run_id)


def teardown_run_id(run_id: str) -> list[str]:
    """Without a state file: delete namespaces named ``mn-<run_id>-*``. Returns what was removed."""
    prefix = EmulatedNetwork._prefix(run_id)
    names = [ns for ns in list_namespaces() if ns.startswith(prefix)]
    errors = _teardown_namespaces(names)
    if errors:
        raise NetemError("; ".join(errors))
    return names


@contextlib.contextmanager
def emulated_network(config: NetemConfig, state_path: Path | str, **kwargs) -> Iterator[EmulatedNetwork]:
    """Build the network, yield it, always tear it down (also when the body raises)."""
    net = EmulatedNetwork.create(config, Path(state_path), **kwargs)
    try:
        yield net
    finally:
        net.teardown()


def load(state_path: Path | str) -> EmulatedNetwork:
    """An existing network from its state file (e.g. one made by ``netem.py up``)."""
    return EmulatedNetwork(NetemState.load(Path(state_path)), Path(state_path))


# ---------------------------------------------------------------------------------------------
# Measurement endpoints (run inside namespaces by `measure`)


def _set_cc(sock: socket.socket, cc: str | None) -> str:
    if cc:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()


def _sink_main(bind: str, port: int, cc: str | None) -> None:
    """Serve one echo connection (RTT), then one bulk connection; reply with bytes and timing."""
    with socket.create_server((bind, port), reuse_port=False) as server:
        _set_cc(server, cc)
        print("ready", flush=True)
        server.settimeout(120)
        echo, _ = server.accept()
        with echo:
            echo.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := echo.recv(64):
                echo.sendall(data)
        bulk, _ = server.accept()
        with bulk:
            total, first_n, first, last = 0, 0, 0.0, 0.0
            bins: list[int] = []  # bytes per 100 ms after the first chunk: shows start-up and stalls
            buf = bytearray(1 << 20)
            while n := bulk.recv_into(buf):
                last = time.monotonic()
                if not first_n:
                    first, first_n = last, n
                    continue
                k = int((last - first) * 10)
                bins.extend([0] * (k + 1 - len(bins)))
                bins[k] += n
                total += n
            # The first chunk's arrival starts the clock, so its bytes do not count.
            bulk.sendall(json.dumps({"bytes": total, "seconds": max(last - first, 1e-9), "bins_100ms": bins}).encode())


def _source_main(host: str, port: int, seconds: float, rtt_probes: int, cc: str | None) -> None:
    rtts = []
    with socket.create_connection((host, port), timeout=30) as echo:
        echo.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rtt_probes + 2):
            t0 = time.perf_counter()
            echo.sendall(b"x")
            if echo.recv(1) != b"x":
                raise NetemError("echo failed")
            rtts.append((time.perf_counter() - t0) * 1e3)
        rtts = rtts[2:]  # the first probes pay for slow start / lazy setup
    chunk = b"\0" * (1 << 16)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as bulk:
        used_cc = _set_cc(bulk, cc)  # before connect, so the handshake already uses it
        bulk.settimeout(60)
        bulk.connect((host, port))
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            bulk.sendall(chunk)
        bulk.shutdown(socket.SHUT_WR)
        reply = b""
        while data := bulk.recv(4096):
            reply += data
    result = json.loads(reply)
    result.update(rtt_ms_median=statistics.median(rtts), rtt_ms_min=min(rtts), congestion_control=used_cc)
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="netem.py", description=__doc__.split("\n\n")[0])
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build N shaped peer namespaces on a bridge")
    up.add_argument("--peers", type=int, required=True)
    up.add_argument("--rate-mbit", type=float, required=True, help="per peer, each direction")
    up.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay on packets arriving at a peer")
    up.add_argument("--loss", type=float, default=0.0, help="percent of packets dropped on arrival at a peer")
    up.add_argument("--cc", default=None,
                    help="TCP congestion control in the peers (default: the host's; only ones it allows)")
    up.add_argument("--queue-ms", type=float, default=None, help="tbf queue, ms at line rate")
    up.add_argument("--offloads", action="store_true", help="keep TSO/GSO/GRO on")
    up.add_argument("--run-id", default=None, help="name part mn-<run-id>- (default: random)")
    up.add_argument("--no-install", action="store_true", help="do not apt-get install missing tools")
    up.add_argument("--state", type=Path, required=True)
    ex = sub.add_parser("exec", help="run a command inside peer i's namespace")
    ex.add_argument("--state", type=Path, required=True)
    ex.add_argument("--peer", type=int, required=True)
    ex.add_argument("cmd", nargs=argparse.REMAINDER)
    me = sub.add_parser("measure", help="TCP goodput and RTT between two peers")
    me.add_argument("--state", type=Path, required=True)
    me.add_argument("--src", type=int, default=0)
    me.add_argument("--dst", type=int, default=1)
    me.add_argument("--seconds", type=float, default=5.0)
    me.add_argument("--port", type=int, default=5201)
    me.add_argument("--cc", default=None, help="TCP congestion control of the test sockets (default: namespace's)")
    dn = sub.add_parser("down", help="remove everything a run created")
    dn.add_argument("--state", type=Path, default=None)
    dn.add_argument("--run-id", default=None, help="without a state file: remove namespaces mn-<run-id>-*")
    sk = sub.add_parser("_sink")
    sk.add_argument("--bind", required=True)
    sk.add_argument("--port", type=int, required=True)
    sk.add_argument("--cc", default=None)
    so = sub.add_parser("_source")
    so.add_argument("--connect", required=True)
    so.add_argument("--port", type=int, required=True)
    so.add_argument("--seconds", type=float, required=True)
    so.add_argument("--rtt-probes", type=int, default=20)
    so.add_argument("--cc", default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(name)s: %(message)s")
    try:
        if args.command == "up":
            config = NetemConfig(peers=args.peers, rate_mbit=args.rate_mbit, delay_ms=args.delay_ms,
                                 loss_pct=args.loss, offloads=args.offloads, congestion_control=args.cc,
                                 queue_ms=args.queue_ms)
            net = EmulatedNetwork.create(config, args.state, run_id=args.run_id, install=not args.no_install)
            print(json.dumps({"run_id": net.run_id, "state": str(args.state),
                              "congestion_control": net.state.congestion_control,
                              "peers": {net.peer_ns(i): net.address(i) for i in range(net.peers)}}, indent=2))
        elif args.command == "exec":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                raise NetemError("exec needs a command after --")
            net = load(args.state)
            return subprocess.call(net.argv(args.peer, cmd))
        elif args.command == "measure":
            net = load(args.state)
            print(json.dumps(net.measure(args.src, args.dst, seconds=args.seconds, port=args.port,
                                         congestion_control=args.cc).as_dict(),
                             indent=2))
        elif args.command == "down":
            if args.state is not None and args.state.exists():
                teardown_run(NetemState.load(args.state), args.state)
            elif args.run_id:
                print(json.dumps({"removed": teardown_run_id(args.run_id)}))
            else:
                raise NetemError("down needs an existing --state file or --run-id")
        elif args.command == "_sink":
            _sink_main(args.bind, args.port, args.cc)
        elif args.command == "_source":
            _source_main(args.connect, args.port, args.seconds, args.rtt_probes, args.cc)
    except NetemError as exc:
        print(f"netem: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
