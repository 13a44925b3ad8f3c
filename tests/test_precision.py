"""train.bf16 = "auto": bf16 autocast only where this device multiplies bf16 about as fast as float32."""

from __future__ import annotations

import logging

import pytest
import torch

from meshnode.model import precision


@pytest.fixture
def timed(monkeypatch):
    """Set what the CPU probe 'measures': (float32 seconds, bf16 seconds)."""
    calls = []

    def fake(times):
        def probe():
            calls.append(times)
            return times
        monkeypatch.setattr(precision, "cpu_matmul_seconds", probe)
    precision.use_bf16.cache_clear()
    yield fake, calls
    precision.use_bf16.cache_clear()


def test_auto_takes_bf16_only_where_it_is_not_slower(timed, caplog):
    fake, calls = timed
    fake((0.001, 0.040))  # emulated bf16, as on an AVX2-only CPU (measured 46x)
    with caplog.at_level(logging.INFO, logger="meshnode.model.precision"):
        assert precision.use_bf16("auto", "cpu") is False
    assert "bf16 autocast off on this CPU" in caplog.text
    assert precision.use_bf16("auto", "cpu") is False and len(calls) == 1  # measured once per process
    precision.use_bf16.cache_clear()
    fake((0.002, 0.001))  # native bf16: twice as fast
    assert precision.use_bf16("auto", "cpu") is True
    precision.use_bf16.cache_clear()
    fake((0.002, 0.002 * precision.SLOWER * 1.1))
    assert precision.use_bf16("auto", "cpu") is False


def test_true_is_obeyed_with_a_warning_where_slow_and_false_never_measures(timed, caplog):
    fake, calls = timed
    fake((0.001, 0.040))
    with caplog.at_level(logging.WARNING, logger="meshnode.model.precision"):
        assert precision.use_bf16(True, "cpu") is True
    assert "40x slower than float32" in caplog.text
    precision.use_bf16.cache_clear()
    calls.clear()
    assert precision.use_bf16(False, "cpu") is False and not calls


def test_a_worker_computes_as_resolved(timed, tiny_cfg):
    from meshnode.model import cut_model, load_model
    from meshnode.stage import StageWorker

    fake, _ = timed
    cfg = tiny_cfg("model.stages=2", "train.bf16=auto")
    model, _ = load_model(cfg.model)
    w = StageWorker(cut_model(model, 2)[0], cfg)
    fake((0.001, 0.040))
    with w.autocast():
        assert not torch.is_autocast_enabled("cpu")
    precision.use_bf16.cache_clear()
    fake((0.002, 0.001))
    with w.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_the_probe_measures_both_ways():
    fp32, bf16 = precision.cpu_matmul_seconds()
    assert 0 < fp32 < 10 and 0 < bf16 < 100
