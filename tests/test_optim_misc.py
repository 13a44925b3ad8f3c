"""Learning-rate schedule, and the optim package's freedom from networking imports."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from meshnode.optim import lr_at


def test_lr_schedule_points() -> None:
    base, warm, total, ratio = 1e-3, 10, 110, 0.1
    assert lr_at(0, base, warm, total, ratio) == pytest.approx(1e-4)
    assert lr_at(4, base, warm, total, ratio) == pytest.approx(5e-4)
    assert lr_at(9, base, warm, total, ratio) == pytest.approx(base)
    assert lr_at(10, base, warm, total, ratio) == pytest.approx(base)
    assert lr_at(60, base, warm, total, ratio) == pytest.approx(0.1 * base + 0.9 * base * 0.5)  # halfway
    q = 0.1 * base + 0.9 * base * 0.5 * (1 + math.cos(math.pi * 0.25))
    assert lr_at(35, base, warm, total, ratio) == pytest.approx(q)
    assert lr_at(110, base, warm, total, ratio) == pytest.approx(1e-4)
    assert lr_at(500, base, warm, total, ratio) == pytest.approx(1e-4)
    lrs = [lr_at(s, base, warm, total, ratio) for s in range(warm, total + 1)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))  # monotone after warmup
    assert lr_at(0, base, 0, 100, 0.0) == pytest.approx(base)  # no warmup
    assert lr_at(5, base, 10, 10, 0.5) == pytest.approx(6e-4)  # all warmup
    assert lr_at(10, base, 10, 10, 0.5) == pytest.approx(5e-4)


def test_optim_imports_no_networking() -> None:
    code = (
        "import sys, meshnode.optim\n"
        "third = {'hivemind', 'grpc', 'multiaddr', 'transformers'}\n"
        "ours = ('meshnode.protocol', 'meshnode.node', 'meshnode.mesh', 'meshnode.stage', 'meshnode.cli')\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in third or m.startswith(ours))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ""
