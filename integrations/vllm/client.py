"""The engine's agent on kvbus: its block store, the prefix index, pulls, pushes and events.

One `KVBusClient` per engine runs in the worker process, on a `LoopThread`. It registers the
engine as a kvbus agent (name, group, role and model signature from the connector config and
the engine's model), keeps the KV the engine saved or received in a `CacheTier` whose blocks are
the engine's blocks (``block_tokens`` = vLLM ``block_size``, keys from `keys`), publishes what
it holds in the prefix index, and answers the connector's subjects (`protocol`). Every KV that
moves between engines is an ordinary kvbus transfer: `Agent.send` asks the group scheduler,
whose cost model picks the medium, and the receiver's inbox gets it whole and verified.

Every method that names a context takes its salt scope (`keys.salt_scope` of a request's
``cache_salt``; "" for none): the store, the index, the holders asked and the transfers keep
scopes apart, a transfer carrying its scope as its label (`Delivery.label`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from kvbus.bus import Agent, Bus, Delivery, NoResponders
from kvbus.cachetier import CacheTier, CacheTierConfig, CacheTierError
from kvbus.config import redact_url
from kvbus.errors import KVBusError, NatsConnectError, WireFormatError
from kvbus.integrations.vllm import serving
from kvbus.integrations.vllm.config import ConnectorConfig
from kvbus.integrations.vllm.errors import LoadFailed
from kvbus.integrations.vllm.index import PrefixIndex
from kvbus.integrations.vllm.keys import as_ids, prefix_keys
from kvbus.integrations.vllm.protocol import (
    Event,
    HaveReply,
    HaveRequest,
    LookupReply,
    PullOutcome,
    PullReply,
    PullRequest,
    PushReply,
    check_salt,
    events_subject,
    sender_of,
    subject,
)
from kvbus.integrations.vllm.worth import PullGate
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

logger = logging.getLogger(__name__)

#: Seconds a peer has to answer a `HaveRequest` during a lookup.
HAVE_TIMEOUT_S = 0.5


@dataclass(eq=False)
class _Pull:
    holder: str
    tokens: torch.Tensor
    future: asyncio.Future[KVCache]
    salt: str = ""


class KVBusClient:
    """The agent of one engine (create and use on its `LoopThread`; `start` first)."""

    def __init__(
        self, config: ConnectorConfig, signature: ModelSignature, *, block_size: int, dtype: torch.dtype
    ) -> None:
        self.config = config
        self.signature = signature
        self.block_size = block_size
        self.dtype = dtype
        self.name = config.agent
        self.bus: Bus | None = None
        self.agent: Agent | None = None
        self.tier: CacheTier | None = None
        self.index: PrefixIndex | None = None
        self._subs: list[Any] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._saves: set[asyncio.Task[Any]] = set()
        self._pulls: dict[str, _Pull] = {}
        self.gate = PullGate(prior_s=config.pull_overhead_s)
        """This engine's measured prefill speed and pull cost (the worker side records them)."""

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, register the agent, open the store and the index, subscribe."""
        cfg = self.config
        try:
            bus = await asyncio.wait_for(
                Bus.connect(cfg.nats_url, secure=cfg.is_secure, **cfg.connect_options()), cfg.connect_timeout_s
            )
        except TimeoutError:
            raise NatsConnectError(
                redact_url(cfg.nats_url),
                f"no connection within kv_connector_extra_config['connect_timeout_s'] ({cfg.connect_timeout_s:g} s)",
                "is a NATS server running at kv_connector_extra_config['nats_url'], and reachable?",
                retryable=True,
            ) from None
        self.bus = bus
        tier_config = CacheTierConfig.from_env(block_tokens=self.block_size, budget_bytes=cfg.store_bytes)
        self.tier = await CacheTier.connect(
            cfg.redis_url, signature=self.signature, config=tier_config, dtype=self.dtype
        )
        self.agent = await bus.agent(
            cfg.agent, group=cfg.group, role=cfg.role, priority=cfg.priority, signature=self.signature, cache=self.tier
        )
        try:
            self.index = await PrefixIndex.connect(bus.transport, cfg.index_bucket, ttl_s=cfg.index_ttl_s)
        except Exception:
            logger.warning(
                "kvbus connector %s: no prefix index in JetStream KV bucket %s; pulls are off",
                self.name,
                cfg.index_bucket,
                exc_info=True,
            )
        t = bus.transport
        for name, handler in (
            (subject(self.name, "lookup"), functools.partial(serving.on_lookup, self)),
            (subject(self.name, "have"), functools.partial(serving.on_have, self)),
            (subject(self.name, "pull", "*"), functools.partial(serving.on_pull, self)),
            (subject(self.name, "push"), functools.partial(serving.on_push, self)),
            (subject(self.name, "pulled", "*"), self._on_pulled),
        ):
            self._subs.append(await t.subscribe(name, handler))
        await t.flush()
        self._spawn(self._inbox_loop(), "inbox")
        logger.info(
            "kvbus connector: agent %s in group %s on %s (model %s, %s, block %d)",
            self.name,
            cfg.group,
            cfg.nats_url,
            self.signature.model,
            self.signature.dtype,
            self.block_size,
        )

    async def close(self) -> None:
        """Leave the bus and free the store."""
        for task in list(self._tasks) + list(self._saves):
            task.cancel()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:
                logger.debug("unsubscribe failed", exc_info=True)
        if self.bus is not None:
            await self.bus.close()
        if self.tier is not None:
            await self.tier.close()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=f"kvbus-vllm-{self.name}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error(
                "kvbus connector %s: background task %s failed", self.name, task.get_name(), exc_info=task.exception()
            )

    async def emit(self, kind: str, **fields: Any) -> None:
        """Publish an `Event` (best effort)."""
        if self.bus is None:
            return
        try:
            await self.bus.transport.publish(
                events_subject(self.name), Event(agent=self.name, kind=kind, **fields).encode()
            )
        except Exception:
            logger.debug("event publish failed", exc_info=True)

    # -- the store ----------------------------------------------------------------------------

    def _whole(self, n: int) -> int:
        return n - n % self.block_size

    def held(self, ids: torch.Tensor, *, salt: str = "") -> int:
        """Leading tokens of ``ids`` whose blocks the store holds in scope ``salt`` (whole blocks)."""
        assert self.tier is not None
        return self._whole(self.tier.lookup(ids, salt=salt)) if ids.shape[-1] else 0

    async def push(self, to: list[str], tokens: list[int], medium: str | None, *, salt: str = "") -> PushReply:
        """Hand the KV of ``tokens`` (held here) to the agents ``to``: see `serving.push`."""
        return await serving.push(self, to, tokens, medium, salt)

    async def settled(self) -> None:
        """Wait for the saves already submitted (so that lookups and pushes see them)."""
        if self._saves:
            await asyncio.gather(*list(self._saves), return_exceptions=True)

    def save(self, kv: KVCache, request_id: str = "", *, salt: str = "") -> None:
        """Store ``kv`` (whole blocks, from token 0) and index it, in scope ``salt``, in the background."""
        task = asyncio.get_running_loop().create_task(
            self._save(kv, request_id, salt=salt), name=f"kvbus-vllm-save-{request_id}"
        )
        self._saves.add(task)
        task.add_done_callback(self._saves.discard)

    async def _save(self, kv: KVCache, request_id: str, *, salt: str = "", kind: str = "save", **event: Any) -> int:
        assert self.tier is not None
        n = self._whole(kv.seq_len)
        if n <= 0:
            return 0
        t0 = time.perf_counter()
        try:
            keys = await self.tier.put(kv.slice(0, n) if n < kv.n_tokens else kv, salt=salt)
        except CacheTierError as exc:
            logger.warning("kvbus connector %s: could not store %d tokens: %s", self.name, n, exc)
            await self.emit(kind, ok=False, request_id=request_id, tokens=n, reason=str(exc), **event)
            return 0
        if self.index is not None:
            await self.index.publish(keys[: n // self.block_size], self.name, self.block_size)
        event.setdefault("seconds", time.perf_counter() - t0)
        await self.emit(
            kind, request_id=request_id, tokens=n, blocks=n // self.block_size, fidelity=float(kv.fidelity), **event
        )
        return n

    async def get(self, ids: torch.Tensor, n: int, *, salt: str = "") -> KVCache:
        """The stored KV of ``ids[:, :n]`` in scope ``salt``.

        Raises:
            LoadFailed: the store no longer holds all of it.
        """
        assert self.tier is not None
        try:
            # (a new segment's pages are faulted in as it is made: off the event loop)
            out = await asyncio.to_thread(self._buffer, n, int(ids.shape[0]))
            return await self.tier.get(ids[:, :n], out=out, salt=salt)
        except (CacheTierError, KVBusError) as exc:
            raise LoadFailed(n, f"the store lost blocks ({exc})") from None

    def _buffer(self, n: int, batch: int) -> KVCache | None:
        """A cache of ``n`` tokens in memory the bus shares (`Agent.kv_buffer`) for `get` to
        assemble into: a pull or push on ``shm`` then sends it without a copy. None when the
        agent's KV is in another dtype than the engine's, or there is no memory for it."""
        if self.agent is None or n <= 0 or self.signature.torch_dtype != self.dtype:
            return None
        try:
            return self.agent.kv_buffer(n, batch=batch)
        except (OSError, ValueError):
            return None

    # -- lookups (this engine's scheduler asks) -------------------------------------------------

    async def lookup(self, tokens: list[int], limit: int, *, salt: str = "") -> LookupReply:
        """What kvbus can deliver of ``tokens[:limit]`` in scope ``salt``: held here, by another
        agent, or in the cache tier."""
        await self.settled()
        ids = as_ids(tokens[:limit])
        local = self.held(ids, salt=salt)
        keys = prefix_keys(ids, self.signature, self.dtype, self.block_size, salt=salt)
        remote, holder = 0, ""
        if self.config.pull and self.index is not None and len(keys) * self.block_size > local:
            name, blocks = await self.index.longest(keys, start=local // self.block_size, exclude=self.name)
            if blocks * self.block_size > local:
                confirmed = await self._ask_have(name, ids[:, : blocks * self.block_size], salt)
                if confirmed > local:
                    remote, holder = confirmed, name
        tier = await self._tier_tokens(keys, max(local, remote) // self.block_size)
        best = max(remote, tier)
        if best > local and self.config.pull_gate:
            decision = self.gate.decide(best - local)
            if not decision.pull:
                logger.info(
                    "kvbus connector %s: not loading tokens %d-%d from %s: %s",
                    self.name,
                    local,
                    best,
                    holder or "the cache tier",
                    decision.reason,
                )
                await self.emit(
                    "decline",
                    tokens=best - local,
                    peer=holder or "tier",
                    seconds=decision.load_s,
                    reason=decision.reason,
                )
                return LookupReply(local=local, declined=best)
        return LookupReply(local=local, remote=remote, holder=holder, tier=tier)

    async def _ask_have(self, agent: str, ids: torch.Tensor, salt: str) -> int:
        assert self.bus is not None
        try:
            data = await self.bus.transport.request(
                subject(agent, "have"), HaveRequest(tokens=ids[0].tolist(), salt=salt).encode(), HAVE_TIMEOUT_S
            )
            return min(HaveReply.decode(data).tokens, int(ids.shape[1]))
        except (NoResponders, TimeoutError, WireFormatError) as exc:
            logger.info("kvbus connector %s: holder %s did not confirm (%s)", self.name, agent, exc)
            return 0

    async def _tier_tokens(self, keys: list[str], start: int) -> int:
        """Tokens beyond block ``start`` whose blocks only the shared cache tier has."""
        tier = self.tier
        if tier is None or tier.remote is None or start >= len(keys):
            return 0
        from kvbus.codecs import get_codec

        codec = get_codec(tier.config.codec).name
        try:
            metas = await tier.remote.metas([tier.remote.record_key(codec, k) for k in keys[start:]])
        except Exception:
            logger.debug("cache tier lookup failed", exc_info=True)
            return 0
        n = 0
        for meta in metas:
            if meta is None:
                break
            n += 1
        return (start + n) * self.block_size if n else 0

    async def load_tier(self, ids: torch.Tensor, n: int, *, salt: str = "") -> KVCache:
        """Fetch ``ids[:, :n]``'s blocks (scope ``salt``) from the shared cache tier into the store; return them."""
        assert self.tier is not None
        try:
            await self.tier.load(ids[:, :n], salt=salt)
        except (CacheTierError, KVBusError) as exc:
            raise LoadFailed(n, f"the cache tier could not deliver: {exc}") from None
        return await self.get(ids, n, salt=salt)

    # -- pulls (this engine asks a holder) --------------------------------------------------------

    async def pull(
        self, holder: str, ids: torch.Tensor, n: int, *, timeout: float, medium: str | None = None, salt: str = ""
    ) -> KVCache:
        """Ask ``holder`` to send the KV of ``ids[:, :n]`` in scope ``salt`` and wait for the transfer.

        Raises:
            LoadFailed: refused, the holder is gone, the transfer failed or timed out, or what
                arrived is not the prefix asked for (in its scope).
        """
        assert self.bus is not None
        loop = asyncio.get_running_loop()
        pull_id = uuid.uuid4().hex
        want = ids[:, :n].clone()
        pending = _Pull(holder, want, loop.create_future(), salt)
        self._pulls[pull_id] = pending
        deadline = loop.time() + timeout
        try:
            msg = PullRequest(
                pull_id=pull_id,
                requester=self.name,
                tokens=want[0].tolist(),
                medium=medium or self.config.medium,
                salt=salt,
            )
            try:
                data = await self.bus.transport.request(
                    subject(holder, "pull", self.name), msg.encode(), min(timeout, 5.0)
                )
            except NoResponders:
                raise LoadFailed(n, f"holder {holder} is gone (no responder)") from None
            except TimeoutError:
                raise LoadFailed(n, f"holder {holder} did not answer the pull") from None
            reply = PullReply.decode(data)
            if not reply.ok:
                raise LoadFailed(n, f"holder {holder} refused: {reply.reason}")
            try:
                return await asyncio.wait_for(asyncio.shield(pending.future), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise LoadFailed(n, f"no delivery from {holder} within {timeout:.1f} s") from None
        finally:
            self._pulls.pop(pull_id, None)
            if not pending.future.done():
                pending.future.cancel()

    async def _on_pulled(self, msg: Any) -> None:
        try:
            outcome = PullOutcome.decode(msg.data)
        except WireFormatError:
            logger.warning("kvbus connector %s: malformed pull outcome dropped", self.name)
            return
        pending = self._pulls.get(outcome.pull_id)
        # Only the holder asked may fail its pull (its name ends the subject: the server's word in secure mode).
        if (
            pending is not None
            and not pending.future.done()
            and not outcome.ok
            and sender_of(msg.subject) == pending.holder
        ):
            pending.future.set_exception(
                LoadFailed(int(pending.tokens.shape[1]), f"holder {pending.holder}: {outcome.reason}")
            )

    # -- the inbox ----------------------------------------------------------------------------

    async def _inbox_loop(self) -> None:
        assert self.agent is not None
        while True:
            try:
                delivery = await self.agent.receive()
            except asyncio.CancelledError:
                raise
            except KVBusError:
                if self.agent.closed:
                    return
                continue
            # Counted as a save in progress: a lookup or push that comes right after the sender's
            # transfer returned waits for this context to be stored.
            task = asyncio.get_running_loop().create_task(self._on_delivery(delivery), name="kvbus-vllm-delivery")
            self._saves.add(task)
            task.add_done_callback(self._saves.discard)
            try:
                await task
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("kvbus connector %s: handling a delivery from %s failed", self.name, delivery.sender)
            # Not held while the next one is awaited: its tensors map the sender's segment (stored
            # by now as a copy), which the sender keeps until every mapping of it is gone.
            del delivery, task

    async def _on_delivery(self, d: Delivery) -> None:
        kv = d.kv
        waiting = [p for p in self._pulls.values() if p.holder == d.sender and not p.future.done()]
        pending = next((p for p in waiting if p.salt == d.label), waiting[0] if waiting else None)
        why = self._unusable(kv)
        common = dict(
            medium=d.medium,
            nbytes=d.nbytes,
            seconds=d.transfer_s + d.decode_s,
            peer=d.sender,
            fidelity=float(kv.fidelity),
        )
        if why:
            logger.info(
                "kvbus connector %s: %s from %s (medium %s); the engine will prefill",
                self.name,
                why,
                d.sender,
                d.medium,
            )
            await self.emit("receive", ok=False, tokens=kv.n_tokens, reason=why, **common)
            if pending is not None:
                pending.future.set_exception(LoadFailed(int(pending.tokens.shape[1]), f"{d.sender} sent {why}"))
            return
        kv = kv.to(self.dtype)
        if pending is not None:
            n = int(pending.tokens.shape[1])
            if d.label != pending.salt:
                pending.future.set_exception(LoadFailed(n, f"{d.sender} sent a context of another salt scope"))
            elif kv.seq_len >= n and torch.equal(kv.tokens[:, :n], pending.tokens):
                pending.future.set_result(kv)
            else:
                pending.future.set_exception(
                    LoadFailed(n, f"{d.sender} sent another context than the prefix asked for")
                )
        common.pop("fidelity")
        # Kept in the scope its sender labelled it with: a context pushed for a salted request is
        # found only by requests of that salt (whoever labels a context with a scope knows the salt).
        try:
            check_salt("delivery label", d.label)
        except WireFormatError as exc:
            await self.emit("receive", ok=False, tokens=kv.n_tokens, reason=str(exc), **common)
            return
        stored = await self._save(kv, "", salt=d.label, kind="receive", **common)
        logger.info(
            "kvbus connector %s: received %d tokens of KV from %s (medium %s, %d bytes, fidelity %.3f)",
            self.name,
            stored,
            d.sender,
            d.medium,
            d.nbytes,
            kv.fidelity,
        )

    def _unusable(self, kv: KVCache) -> str:
        """Why a delivered context cannot go into this engine's cache ('' when it can)."""
        if not kv.has_kv:
            return "tokens only"
        if kv.positions is not None:
            return "a sparsified cache (explicit positions)"
        if kv.batch != 1:
            return f"a batch of {kv.batch} contexts"
        if not kv.signature.compatible_with(self.signature):
            return f"KV of another model ({kv.signature.model})"
        if self._whole(kv.seq_len) == 0:
            return f"less than one block ({kv.seq_len} tokens)"
        return ""
