"""Start and stop swarm peers as separate processes (``meshnode demo`` and the tests).

Each peer is ``python -m meshnode.cli join ...`` in its own process group (``start_new_session``),
with its log in a file and a ready-file it writes once it serves. Stopping is by the handle we hold:
SIGTERM to the peer (it announces offline, checkpoints and stops its DHT), then, after a deadline,
SIGKILL to its process group (the peer, its DHT process and its p2pd). Never by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class PeerProcess:
    name: str
    proc: subprocess.Popen
    log: Path
    ready_file: Path
    args: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self) -> dict | None:
        if self.ready_file.is_file():
            try:
                return json.loads(self.ready_file.read_text())
            except ValueError:
                return None
        return None

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.ready()
            if info is not None:
                return info
            if not self.alive():
                raise RuntimeError(f"peer {self.name} exited with code {self.proc.returncode}: see {self.log}\n"
                                   + tail(self.log))
            time.sleep(0.2)
        raise TimeoutError(f"peer {self.name} not ready after {timeout:.0f}s: see {self.log}\n" + tail(self.log))

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the whole process group of this peer (its DHT process and p2pd included)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL the process group; returns the exit code."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.kill(signal.SIGKILL)  # leftovers of the group (a DHT process, p2pd), or a peer that hung
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        return self.proc.returncode


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def start_peer(
    name: str, workdir: Path, config: Path, overrides: list[str], *, initial_peers: list[str], extra: list[str] = (),
    cache_dir: Path | None = None, verbose: bool = True, env: dict | None = None,
) -> PeerProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"{name}.log"
    ready = workdir / f"{name}.ready.json"
    ready.unlink(missing_ok=True)
    args = [sys.executable, "-m", "meshnode.cli"] + (["-v"] if verbose else []) + ["join", "--config", str(config)]
    for o in overrides:
        args += ["--set", o]
    for m in initial_peers:
        args += ["--initial-peers", m]
    args += ["--ready-file", str(ready), *extra]
    if cache_dir is not None:
        args += ["--cache-dir", str(cache_dir)]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log, "ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=full_env)
    return PeerProcess(name=name, proc=proc, log=log, ready_file=ready, args=args)


def read_jsonl(path: Path) -> list[dict]:
    """The JSON lines of ``path`` (a peer's ``--metrics-out``), ``[]`` while it does not exist."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class LocalSwarm:
    """Peers of one run on this machine (the tests' and the benchmarks' swarms): each started by :func:`start_peer`,
    the first one's address the bootstrap of the rest; ``meshnode status --json`` for the swarm; stopped by their
    handles."""

    def __init__(self, workdir: Path, config: Path, overrides: list[str], cache_dir: Path | None = None,
                 ready_timeout: float = 120.0):
        from ..config import load_config

        self.workdir, self.config, self.overrides, self.cache_dir = Path(workdir), config, list(overrides), cache_dir
        self.ready_timeout = ready_timeout
        self.cfg = load_config(config, self.overrides)
        self.procs: list[PeerProcess] = []
        self.bootstrap: list[str] = []

    def start(self, name: str, *extra: str, wait: bool = True) -> PeerProcess:
        p = start_peer(name, self.workdir, self.config, self.overrides, initial_peers=self.bootstrap,
                       extra=list(extra), cache_dir=self.cache_dir)
        self.procs.append(p)
        if wait:
            info = p.wait_ready(self.ready_timeout)
            if not self.bootstrap:
                self.bootstrap = info["maddrs"][:1]
        return p

    def status(self) -> dict:
        r = subprocess.run(
            [sys.executable, "-m", "meshnode.cli", "status", "--initial-peers", self.bootstrap[0], "--run",
             self.cfg.run_id, "--json"], capture_output=True, text=True, timeout=60,
        )
        if r.returncode != 0:
            raise RuntimeError(f"meshnode status failed: {r.stderr[-2000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def metrics(self, path: Path) -> list[dict]:
        return read_jsonl(path)

    def stop(self, timeout: float = 20.0) -> None:
        for p in self.procs:
            p.stop(timeout=timeout)


__all__ = ["LocalSwarm", "PeerProcess", "read_jsonl", "start_peer", "tail"]
