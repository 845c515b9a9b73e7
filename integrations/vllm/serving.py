"""What an engine's agent answers on the connector's subjects: lookups, have, pull and push.

Functions of the `KVBusClient` they serve (kept apart: they are the agent's public face).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from kvbus.bus import TransferError, TransferReport
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
    sender_of,
    subject,
)

if TYPE_CHECKING:
    from kvbus.integrations.vllm.client import KVBusClient

logger = logging.getLogger(__name__)


async def send_reply(client: KVBusClient, msg: Any, payload: bytes) -> None:
    """Reply ``payload`` to request ``msg``; a reply that cannot be sent is only logged (debug)."""
    assert client.bus is not None
    try:
        await client.bus.transport.reply(msg, payload)
    except Exception:
        logger.debug("reply failed", exc_info=True)


async def on_lookup(client: KVBusClient, msg: Any) -> None:
    """Answer the scheduler's ``lookup``: a `LookupReply` of what kvbus can deliver for the prefix.

    A malformed request or a failing lookup is logged and answered with an empty reply (no hit:
    the engine prefills).
    """
    from kvbus.integrations.vllm.protocol import LookupReply

    try:
        req = LookupRequest.decode(msg.data)
        reply = await client.lookup(req.tokens, req.limit, salt=req.salt)
    except WireFormatError as exc:
        logger.warning("kvbus connector %s: malformed lookup: %s", client.name, exc)
        reply = LookupReply()
    except Exception:
        logger.exception("kvbus connector %s: lookup failed", client.name)
        reply = LookupReply()
    await send_reply(client, msg, reply.encode())


async def on_have(client: KVBusClient, msg: Any) -> None:
    """Answer a peer's ``have``: a `HaveReply` of the leading tokens held here, once pending saves are in.

    A malformed request is logged and answered with 0 tokens.
    """
    try:
        req = HaveRequest.decode(msg.data)
    except WireFormatError as exc:
        logger.warning("kvbus connector %s: malformed have request: %s", client.name, exc)
        await send_reply(client, msg, HaveReply(tokens=0).encode())
        return
    await client.settled()
    held = client.held(as_ids(req.tokens), salt=req.salt) if req.tokens else 0
    await send_reply(client, msg, HaveReply(tokens=held).encode())


async def on_pull(client: KVBusClient, msg: Any) -> None:
    """Answer a peer's ``pull``: accept it and start `serve_pull`, or refuse it with the reason.

    Accepted only when the requester the message names is the one whose name ends the subject
    (which only it may publish in secure mode), this agent holds all of the requested tokens in
    the pull's salt scope (after pending saves) and they are a non-empty whole number of blocks;
    a refusal says why (how many it holds).
    """
    try:
        req = PullRequest.decode(msg.data)
    except WireFormatError as exc:
        await send_reply(client, msg, PullReply(ok=False, reason=str(exc)).encode())
        return
    if sender_of(msg.subject) != req.requester:
        why = f"the pull names {req.requester} as its requester but came on {msg.subject}"
        logger.warning("kvbus connector %s: refused a pull: %s", client.name, why)
        await send_reply(client, msg, PullReply(ok=False, reason=why).encode())
        return
    await client.settled()
    ids = as_ids(req.tokens) if req.tokens else torch.zeros(1, 0, dtype=torch.int64)
    n = int(ids.shape[1])
    held = client.held(ids, salt=req.salt)
    if n == 0 or n % client.block_size or held < n:
        why = f"holds {held} of the {n} tokens asked for" if held < n else "not a whole number of blocks"
        await send_reply(client, msg, PullReply(ok=False, tokens=held, reason=why).encode())
        return
    await send_reply(client, msg, PullReply(ok=True, tokens=n).encode())
    client._spawn(serve_pull(client, req, ids), f"serve-{req.pull_id[:8]}")


async def serve_pull(client: KVBusClient, req: PullRequest, ids: torch.Tensor) -> None:
    """Send an accepted pull's KV to the requester as a kvbus transfer and emit a ``serve`` event.

    On failure the event says why, and a `PullOutcome` on the requester's ``pulled`` subject
    tells it not to wait for the transfer.
    """
    assert client.agent is not None and client.bus is not None
    n = int(ids.shape[1])
    t0 = time.perf_counter()
    try:
        kv = await client.get(ids, n, salt=req.salt)
        report = await client.agent.send(req.requester, kv, medium=req.medium or client.config.medium, label=req.salt)
    except asyncio.CancelledError:
        raise
    except (LoadFailed, TransferError, KVBusError, ValueError) as exc:
        logger.warning(
            "kvbus connector %s: pull %s for %s failed: %s", client.name, req.pull_id[:8], req.requester, exc
        )
        await client.emit(
            "serve", ok=False, tokens=n, peer=req.requester, reason=str(exc), seconds=time.perf_counter() - t0
        )
        try:
            await client.bus.transport.publish(
                subject(req.requester, "pulled", client.name),
                PullOutcome(pull_id=req.pull_id, ok=False, reason=str(exc)).encode(),
            )
        except Exception:
            logger.debug("could not report the failed pull", exc_info=True)
        return
    await client.emit(
        "serve",
        tokens=n,
        blocks=n // client.block_size,
        peer=req.requester,
        medium=report.medium,
        nbytes=report.nbytes,
        seconds=report.total_s,
        fidelity=float(kv.fidelity),
        reason=why_medium(report),
    )


async def push(client: KVBusClient, to: list[str], tokens: list[int], medium: str | None, salt: str = "") -> PushReply:
    """Send the longest prefix of ``tokens`` this agent holds in scope ``salt`` to every agent in
    ``to``, labelled with the scope (the receivers keep it there)."""
    assert client.agent is not None
    await client.settled()
    ids = as_ids(tokens) if tokens else torch.zeros(1, 0, dtype=torch.int64)
    n = client.held(ids, salt=salt)
    if n == 0:
        return PushReply(ok=False, reason=f"agent {client.name} holds no block of this context")
    try:
        kv = await client.get(ids, n, salt=salt)
    except LoadFailed as exc:
        await client.emit("push", ok=False, tokens=n, peer=",".join(to), reason=str(exc))
        return PushReply(ok=False, tokens=n, reason=str(exc))
    # One transfer per receiver, side by side, not a broadcast: a broadcast is one stream that
    # NATS fans out, so it never takes shm, and engines of one host then get the context through
    # the broker (bench agents: the planner's push to two executors went in int8 over NATS at
    # 270-650 Mbit/s). Each send picks its own path and medium; on shm, a context assembled in
    # a kv_buffer is the one segment every receiver maps, with no copy.
    chosen = medium or client.config.medium
    outcomes = await asyncio.gather(
        *(client.agent.send(rx, kv, medium=chosen, label=salt) for rx in to), return_exceptions=True
    )
    reports: list[TransferReport] = []
    failed: list[str] = []
    for rx, outcome in zip(to, outcomes):
        if isinstance(outcome, (TransferError, KVBusError, ValueError)):
            failed.append(f"{rx}: {outcome}")
            await client.emit("push", ok=False, tokens=n, peer=rx, reason=str(outcome))
        elif isinstance(outcome, BaseException):
            raise outcome
        else:
            reports.append(outcome)
            await client.emit(
                "push",
                tokens=n,
                blocks=n // client.block_size,
                peer=rx,
                medium=outcome.medium,
                nbytes=outcome.nbytes,
                seconds=outcome.total_s,
                fidelity=float(kv.fidelity),
                reason=why_medium(outcome),
            )
    if failed:
        done = f" (delivered to {', '.join(r.dst[0] for r in reports)})" if reports else ""
        return PushReply(ok=False, tokens=n, reason="; ".join(failed) + done)
    return PushReply(
        ok=True,
        tokens=n,
        medium=",".join(dict.fromkeys(r.medium for r in reports)),
        nbytes=sum(r.nbytes for r in reports),
        seconds=max(r.total_s for r in reports),
        transfer_id=reports[0].transfer_id,
    )


def why_medium(report: TransferReport) -> str:
    """Why a transfer went in its medium, for an ``ok`` event's ``reason``: the path its bytes
    took, the scheduler's reason, the link it priced (path, where the estimate came from, Mbit/s)
    and its three cheapest predictions."""
    d = report.decision or {}
    links = d.get("links") or {}
    priced = "; ".join(
        f"{rx} {link.get('path', '?')} {link.get('source', '?')} {link.get('mbit', '?')} Mbit/s"
        for rx, link in links.items()
        if isinstance(link, dict)
    )
    cands = [c for c in d.get("candidates", []) if isinstance(c, dict) and c.get("total_s") is not None]
    cands.sort(key=lambda c: c["total_s"])
    cheapest = ", ".join(f"{c['medium']} {c['total_s'] * 1e3:.0f} ms" for c in cands[:3])
    return f"path {report.path}; {d.get('reason', '')}; link {priced or '-'}; predicted {cheapest or '-'}"[:400]


async def on_push(client: KVBusClient, msg: Any) -> None:
    """Answer a ``push`` request: run `push` and reply its `PushReply` (``ok`` False, with why, if it went wrong)."""
    try:
        req = PushRequest.decode(msg.data)
    except WireFormatError as exc:
        await send_reply(client, msg, PushReply(ok=False, reason=str(exc)).encode())
        return
    try:
        reply = await client.push(req.to, req.tokens, req.medium, salt=req.salt)
    except Exception as exc:
        logger.exception("kvbus connector %s: push failed", client.name)
        reply = PushReply(ok=False, reason=f"internal error: {exc}")
    await send_reply(client, msg, reply.encode())
