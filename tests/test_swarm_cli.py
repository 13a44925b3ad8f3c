"""The swarm commands' help and their one-line errors (bad flags, unreachable peers)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from meshnode.cli import app

from .conftest import TINY

runner = CliRunner()


def test_help():
    for args in (["--help"], ["join", "--help"], ["status", "--help"], ["demo", "--help"], ["export", "--help"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
    assert "join" in runner.invoke(app, ["--help"]).output


@pytest.mark.parametrize("args, needle", [
    (["join", "--config", str(TINY), "--role", "boss"], "--role"),
    (["join", "--config", str(TINY), "--stage", "7"], "--stage"),
    (["join", "--config", str(TINY), "--stage", "two"], "--stage"),
    (["join", "--config", str(TINY), "--device", "tpu"], "--device"),
    (["join", "--config", str(TINY), "--set", "dp.average_moments=true"], "dp.average_moments"),
    (["join", "--config", str(TINY), "--set", "mask.codec=rotq", "--set", "mask.reference=forward", "--set",
      "mask.reference_refresh=10"], "mask.reference_refresh_rank"),
    # the swarm takes dp.v_correction, but not without the microbatches its estimate needs
    (["join", "--config", str(TINY), "--set", "dp.v_correction=true", "--set", "dp.enabled=true"], "dp.v_correction"),
    (["status", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "--run"),
    (["export", "--out", "x"], "--checkpoint"),
])
def test_bad_flags_one_line(args, needle):
    r = runner.invoke(app, args)
    assert r.exit_code == 1, r.output
    assert needle in r.output and "Traceback" not in r.output


@pytest.mark.swarm
def test_unreachable_initial_peer_is_one_clear_line():
    bogus = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWLJionYRYsTs2vBytNZVVAEBSNksaJxF58dvW8aZcnSWn"
    r = subprocess.run([sys.executable, "-m", "meshnode.cli", "status", "--initial-peers", bogus, "--run", "x",
                        "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: could not join the swarm"), r.stderr
    assert "Traceback" not in r.stderr
