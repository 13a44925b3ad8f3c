"""The stage servicer: ``rpc_*`` methods served as hivemind binary stream handlers.

Activations are large, so the servicer uses hivemind's binary streams (one length-prefixed msgpack
frame per message, :mod:`.messages`) rather than protobuf-framed ones. Each ``rpc_<verb>`` method of a
:class:`StageServicer` is registered under ``{namespace}.rpc_<verb>`` (the namespace is the run id),
takes the unpacked request map and a :class:`RPCContext`, and returns a reply map, or an async
iterator of reply maps for streaming methods (``rpc_get_weights``, ``rpc_get_state``, ``rpc_dp_log``).

The servicer is transport only: it reads one frame under the size limit, unpacks it with bounded
containers, hands it to the backend (the daemon's stage host, which validates the fields against
its stage and runs the worker) and writes the reply. Every error becomes an error frame
(``{"ok": false, "error": ...}``); nothing a peer sends can crash the handler.

Client side: :func:`call_rpc` and :func:`stream_rpc` (the same framing, with deadlines).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from hivemind.p2p import P2P, PeerID

from .messages import WireError, pack, read_frame, reply_error, unpack, write_frame

logger = logging.getLogger(__name__)


@dataclass
class RPCContext:
    remote_id: PeerID | None
    handler: str


class StageBackend(Protocol):
    """What the servicer needs from the daemon (all raise on a request they refuse)."""

    async def forward(self, request: dict[str, Any]) -> dict[str, Any]: ...

    async def backward(self, request: dict[str, Any]) -> dict[str, Any]: ...

    async def reference_move(self, request: dict[str, Any], sender: str) -> dict[str, Any]: ...

    def info(self) -> dict[str, Any]: ...

    def weights_stream(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...

    def state_stream(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...

    def dp_log_stream(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...


class RPCServicer:
    """Serves every ``rpc_<verb>`` method of a subclass as ``{namespace}.rpc_<verb>`` (one frame in, one or a
    stream of frames out, every refusal an error frame)."""

    def __init__(self, max_message_bytes: int):
        self.max_message_bytes = max_message_bytes
        self.errors = 0  # requests refused (bad input, replay, ...)
        self.served = 0

    # ---- registration ----------------------------------------------------------------------

    @classmethod
    def rpc_names(cls) -> list[str]:
        """The handlers: coroutine or async-generator methods named ``rpc_<verb>`` (not this method: registered as a
        handler, two servicers on one peer clashed on it)."""
        return [n for n in dir(cls) if n.startswith("rpc_") and n != "rpc_names"
                and (inspect.iscoroutinefunction(getattr(cls, n)) or inspect.isasyncgenfunction(getattr(cls, n)))]

    async def add_p2p_handlers(self, p2p: P2P, namespace: str) -> None:
        for name in self.rpc_names():
            await p2p.add_binary_stream_handler(f"{namespace}.{name}", self._make_handler(name))

    async def remove_p2p_handlers(self, p2p: P2P, namespace: str) -> None:
        for name in self.rpc_names():
            with contextlib.suppress(Exception):  # the daemon may already be gone at shutdown
                await p2p.remove_binary_stream_handler(f"{namespace}.{name}")

    def _make_handler(self, name: str):
        method = getattr(self, name)
        streaming = inspect.isasyncgenfunction(method)

        async def handle(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            context = RPCContext(remote_id=getattr(stream_info, "peer_id", None), handler=name)
            try:
                try:
                    request = unpack(await read_frame(reader, self.max_message_bytes), self.max_message_bytes)
                    if streaming:
                        async for item in method(request, context):
                            await write_frame(writer, pack(item))
                    else:
                        await write_frame(writer, pack(await method(request, context)))
                    self.served += 1
                except (WireError, ValueError, KeyError, TypeError, RuntimeError) as exc:
                    self.errors += 1
                    logger.info("%s from %s refused: %s", name, context.remote_id, exc)
                    await write_frame(writer, pack(reply_error(f"{type(exc).__name__}: {exc}")))
            except (ConnectionError, asyncio.IncompleteReadError, BrokenPipeError) as exc:
                logger.debug("%s: connection lost: %s", name, exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never let a handler die silently
                self.errors += 1
                logger.warning("%s: unexpected error: %r", name, exc, exc_info=True)
                with contextlib.suppress(Exception):
                    await write_frame(writer, pack(reply_error(f"internal error: {type(exc).__name__}")))
            finally:
                writer.close()

        return handle


class StageServicer(RPCServicer):
    """``rpc_forward``, ``rpc_backward``, ``rpc_reference_move``, ``rpc_info``, ``rpc_get_weights``,
    ``rpc_get_state``, ``rpc_dp_log``."""

    def __init__(self, backend: StageBackend, max_message_bytes: int):
        super().__init__(max_message_bytes)
        self.backend = backend

    async def rpc_forward(self, request: dict[str, Any], context: RPCContext) -> dict[str, Any]:
        return await self.backend.forward(request)

    async def rpc_backward(self, request: dict[str, Any], context: RPCContext) -> dict[str, Any]:
        return await self.backend.backward(request)

    async def rpc_reference_move(self, request: dict[str, Any], context: RPCContext) -> dict[str, Any]:
        return await self.backend.reference_move(request, str(context.remote_id))

    async def rpc_info(self, request: dict[str, Any], context: RPCContext) -> dict[str, Any]:
        return {"ok": True, **self.backend.info()}

    async def rpc_get_weights(self, request: dict[str, Any], context: RPCContext) -> AsyncIterator[dict[str, Any]]:
        async for item in self.backend.weights_stream(request):
            yield item

    async def rpc_get_state(self, request: dict[str, Any], context: RPCContext) -> AsyncIterator[dict[str, Any]]:
        async for item in self.backend.state_stream(request):
            yield item

    async def rpc_dp_log(self, request: dict[str, Any], context: RPCContext) -> AsyncIterator[dict[str, Any]]:
        async for item in self.backend.dp_log_stream(request):
            yield item


# ---------------------------------------------------------------------------------------------
# client


class RPCError(RuntimeError):
    """The remote peer answered with an error frame (its message is the error)."""


async def _open(p2p: P2P, peer: PeerID, handler: str, timeout: float):
    _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(peer, handler), timeout)
    return reader, writer


async def call_rpc(
    p2p: P2P, peer: PeerID, handler: str, request: dict[str, Any] | bytes, *, max_bytes: int, timeout: float,
    connect_timeout: float = 10.0,
) -> dict[str, Any]:
    """Send one request frame, read one reply frame; raise :class:`RPCError` on an error reply."""
    reader, writer = await _open(p2p, peer, handler, connect_timeout)
    try:
        await write_frame(writer, request if isinstance(request, bytes) else pack(request))
        reply = unpack(await asyncio.wait_for(read_frame(reader, max_bytes), timeout), max_bytes)
    finally:
        writer.close()
    if not reply.get("ok", False):
        raise RPCError(str(reply.get("error", "error reply without a message")))
    return reply


async def stream_rpc(
    p2p: P2P, peer: PeerID, handler: str, request: dict[str, Any], *, max_bytes: int, timeout: float,
    connect_timeout: float = 10.0,
) -> AsyncIterator[dict[str, Any]]:
    """Send one request, yield reply frames until one has ``last: true``; each frame within ``timeout``."""
    reader, writer = await _open(p2p, peer, handler, connect_timeout)
    try:
        await write_frame(writer, pack(request))
        while True:
            item = unpack(await asyncio.wait_for(read_frame(reader, max_bytes), timeout), max_bytes)
            if not item.get("ok", True):
                raise RPCError(str(item.get("error", "error reply without a message")))
            yield item
            if item.get("last"):
                return
    finally:
        writer.close()


async def collect_stream(
    p2p: P2P, peer: PeerID, handler: str, request: dict[str, Any], *, max_bytes: int, timeout: float,
    max_total: int | None = None, size: Callable[[dict[str, Any]], int] = lambda item: 0,
) -> list[dict[str, Any]]:
    """Every frame of a streamed reply. ``size(frame)`` counts a frame's payload; a reply whose payloads add up to
    more than ``max_total`` bytes is refused (ValueError) as soon as it does, before the rest is read."""
    frames, total = [], 0
    async for item in stream_rpc(p2p, peer, handler, request, max_bytes=max_bytes, timeout=timeout):
        total += size(item)
        if max_total is not None and total > max_total:
            raise ValueError(f"{handler}: reply larger than {max_total} bytes")
        frames.append(item)
    if not frames:
        raise RuntimeError(f"{handler}: empty reply")
    return frames


__all__ = [
    "RPCContext", "RPCError", "RPCServicer", "StageBackend", "StageServicer", "call_rpc", "collect_stream",
    "stream_rpc",
]
