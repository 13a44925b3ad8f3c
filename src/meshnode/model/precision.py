"""Whether a stage computes under bf16 autocast (``train.bf16``: true, false or ``"auto"``).

bf16 autocast halves a step's time on hardware that multiplies bf16 natively (CUDA GPUs from Ampere on, CPUs
with AVX512-BF16 or AMX) and is ruinous where it is emulated: on an AVX2-only CPU (AMD EPYC, torch 2.13) a
576 x 1536 matmul took 1.5 s in bf16 against 0.03 s in float32, and one forward + backward of SmolLM2-135M at
batch 4 x 256 took 401 s against 17 s. ``"auto"`` measures instead of guessing: on a CPU it times a small
matmul both ways once per process and takes bf16 only where it is not slower than float32 (within
:data:`SLOWER`); on CUDA it asks :func:`torch.cuda.is_bf16_supported`. ``true`` is obeyed, with a warning
where the measurement says it is slow. The decision is logged once.
"""

from __future__ import annotations

import logging
import time
from functools import cache

import torch

logger = logging.getLogger(__name__)

SLOWER = 1.25  # "auto" takes bf16 on a CPU where its matmul takes at most this many times float32's
PROBE_SHAPE = (256, 576, 576)  # (m, k, n) of the probe matmul: a SmolLM2 projection at one microbatch row block


def _best_of(fn, reps: int = 3) -> float:
    fn()  # warm up (first-call allocation, kernel choice)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@cache
def cpu_matmul_seconds() -> tuple[float, float]:
    """(float32, bf16 autocast) seconds of one :data:`PROBE_SHAPE` matmul on this CPU, the best of three each."""
    m, k, n = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)

    def bf16():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return a @ b

    return _best_of(lambda: a @ b), _best_of(bf16)


@cache
def use_bf16(setting: bool | str, device: str = "cpu") -> bool:
    """Whether to compute under bf16 autocast on ``device`` ("cpu", "cuda", "cuda:N") for ``train.bf16``."""
    if setting is False:
        return False
    if device.startswith("cuda"):
        ok = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        if setting == "auto":
            logger.info("train.bf16 = auto: bf16 autocast %s on %s", "on" if ok else "off", device)
            return ok
        return True
    fp32, bf16 = cpu_matmul_seconds()
    fast = bf16 <= SLOWER * fp32
    timing = f"a {'x'.join(map(str, PROBE_SHAPE))} matmul: bf16 {bf16 * 1e3:.2f} ms, float32 {fp32 * 1e3:.2f} ms"
    if setting == "auto":
        logger.info("train.bf16 = auto: bf16 autocast %s on this CPU (%s)", "on" if fast else "off", timing)
        return fast
    if not fast:
        logger.warning("train.bf16 = true on a CPU that multiplies bf16 %.0fx slower than float32 (%s): set "
                       "train.bf16 = \"auto\" or false", bf16 / fp32, timing)
    return True


__all__ = ["PROBE_SHAPE", "SLOWER", "cpu_matmul_seconds", "use_bf16"]
