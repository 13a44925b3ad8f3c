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


__all__ = ["PeerProcess", "start_peer", "tail"]
