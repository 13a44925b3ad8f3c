"""Small helpers for the errors meshnode reports to its users."""

from __future__ import annotations


def brief(exc: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message`` (at most ``limit`` characters of it): what a one-line error or log entry
    quotes of an exception raised by a library (torch.load's run to twenty lines)."""
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    if len(first) > limit:
        first = first[: limit - 3] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
