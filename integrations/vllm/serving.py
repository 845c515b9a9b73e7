"""What an engine's agent answers on the connector's subjects: lookups, have, pull and push."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from kvbus.bus import TransferError
from kvbus.errors import KVBusError, WireFormatError
from kvbus.integrations.vllm.errors import LoadFailed
from kvbus.integrations.vllm.keys import as_ids
from kvbus.integrations.vllm.protocol import (
    HaveReply,
    HaveRequest,
    LookupRequest,
    PullOutcome,
    PullReply,
    PullRequest,
    PushReply,
    PushRequest,
    subject,
)

if TYPE_CHECKING:
    from kvbus.integrations.vllm.client import KVBusClient

logger = logging.getLogger(__name__)


class ServingMixin:
    """The subject handlers of `KVBusClient` (kept apart: they are the agent's public face)."""

    async def _reply(self: KVBusClient, msg: Any, payload: bytes) -> None:
        assert self.bus is not None
        try:
            await self.bus.transport.reply(msg, payload)
        except Exception:
            logger.debug("reply failed", exc_info=True)

    async def _on_lookup(self: KVBusClient, msg: Any) -> None:
        from kvbus.integrations.vllm.protocol import LookupReply

        try:
            req = LookupRequest.decode(msg.data)
            reply = await self.lookup(req.tokens, req.limit)
        except WireFormatError as exc:
            logger.warning("kvbus connector %s: malformed lookup: %s", self.name, exc)
            reply = LookupReply()
        except Exception:
            logger.exception("kvbus connector %s: lookup failed", self.name)
            reply = LookupReply()
        await self._reply(msg, reply.encode())

    async def _on_have(self: KVBusClient, msg: Any) -> None:
        try:
            req = HaveRequest.decode(msg.data)
        except WireFormatError as exc:
            logger.warning("kvbus connector %s: malformed have request: %s", self.name, exc)
            await self._reply(msg, HaveReply(tokens=0).encode())
            return
        await self.settled()
        await self._reply(msg, HaveReply(tokens=self.held(as_ids(req.tokens)) if req.tokens else 0).encode())

    async def _on_pull(self: KVBusClient, msg: Any) -> None:
        try:
            req = PullRequest.decode(msg.data)
        except WireFormatError as exc:
            await self._reply(msg, PullReply(ok=False, reason=str(exc)).encode())
            return
        await self.settled()
        ids = as_ids(req.tokens) if req.tokens else torch.zeros(1, 0, dtype=torch.int64)
        n = int(ids.shape[1])
        held = self.held(ids)
        if n == 0 or n % self.block_size or held < n:
            why = f"holds {held} of the {n} tokens asked for" if held < n else "not a whole number of blocks"
            await self._reply(msg, PullReply(ok=False, tokens=held, reason=why).encode())
            return
        await self._reply(msg, PullReply(ok=True, tokens=n).encode())
        self._spawn(self._serve_pull(req, ids), f"serve-{req.pull_id[:8]}")

    async def _serve_pull(self: KVBusClient, req: PullRequest, ids: torch.Tensor) -> None:
        assert self.agent is not None and self.bus is not None
        n = int(ids.shape[1])
        t0 = time.perf_counter()
        try:
            kv = await self.get(ids, n)
            report = await self.agent.send(req.requester, kv, medium=req.medium or self.config.medium)
        except asyncio.CancelledError:
            raise
        except (LoadFailed, TransferError, KVBusError, ValueError) as exc:
            logger.warning(
                "kvbus connector %s: pull %s for %s failed: %s", self.name, req.pull_id[:8], req.requester, exc
            )
            await self.emit(
                "serve", ok=False, tokens=n, peer=req.requester, reason=str(exc), seconds=time.perf_counter() - t0
            )
            try:
                await self.bus.transport.publish(
                    subject(req.requester, "pulled"),
                    PullOutcome(pull_id=req.pull_id, ok=False, reason=str(exc)).encode(),
                )
            except Exception:
                logger.debug("could not report the failed pull", exc_info=True)
            return
        await self.emit(
            "serve",
            tokens=n,
            blocks=n // self.block_size,
            peer=req.requester,
            medium=report.medium,
            nbytes=report.nbytes,
            seconds=report.total_s,
            fidelity=float(kv.fidelity),
        )

    async def push(self: KVBusClient, to: list[str], tokens: list[int], medium: str | None) -> PushReply:
        """Send the longest prefix of ``tokens`` this agent holds to every agent in ``to``."""
        assert self.agent is not None
        await self.settled()
        ids = as_ids(tokens) if tokens else torch.zeros(1, 0, dtype=torch.int64)
        n = self.held(ids)
        if n == 0:
            return PushReply(ok=False, reason=f"agent {self.name} holds no block of this context")
        try:
            kv = await self.get(ids, n)
            if len(to) == 1:
                report = await self.agent.send(to[0], kv, medium=medium or self.config.medium)
            else:
                report = await self.agent.broadcast(to, kv, medium=medium or self.config.medium)
        except (LoadFailed, TransferError, KVBusError, ValueError) as exc:
            await self.emit("push", ok=False, tokens=n, peer=",".join(to), reason=str(exc))
            return PushReply(ok=False, tokens=n, reason=str(exc))
        await self.emit(
            "push",
            tokens=n,
            blocks=n // self.block_size,
            peer=",".join(to),
            medium=report.medium,
            nbytes=report.nbytes,
            seconds=report.total_s,
            fidelity=float(kv.fidelity),
        )
        return PushReply(
            ok=True,
            tokens=n,
            medium=report.medium,
            nbytes=report.nbytes,
            seconds=report.total_s,
            transfer_id=report.transfer_id,
        )

    async def _on_push(self: KVBusClient, msg: Any) -> None:
        try:
            req = PushRequest.decode(msg.data)
        except WireFormatError as exc:
            await self._reply(msg, PushReply(ok=False, reason=str(exc)).encode())
            return
        try:
            reply = await self.push(req.to, req.tokens, req.medium)
        except Exception as exc:
            logger.exception("kvbus connector %s: push failed", self.name)
            reply = PushReply(ok=False, reason=f"internal error: {exc}")
        await self._reply(msg, reply.encode())
