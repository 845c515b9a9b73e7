"""The scheduler-side half: answer ``get_num_new_matched_tokens`` from what kvbus can deliver, and
plan each step's loads, saves and pushes for the worker-side half.

It runs in vLLM's engine-core process, which holds no KV: it asks the worker's agent over NATS
(`LookupRequest` on ``kvbus.vllm.<agent>.lookup``), waiting at most ``lookup_timeout_s``; no
answer means no hit, and the engine prefills. A local hit (a pushed context already in the
worker's store) loads synchronously before the forward; a hit held by another agent or by the
cache tier loads asynchronously (the request waits in ``WAITING_FOR_REMOTE_KVS`` while the
transfer runs). A request whose load failed is never offered kvbus tokens again, so a bad
holder cannot make vLLM retry for ever.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvbus.integrations.vllm.config import ConnectorConfig
from kvbus.integrations.vllm.keys import matchable_tokens, salt_scope
from kvbus.integrations.vllm.loop import LoopThread
from kvbus.integrations.vllm.metadata import (
    SOURCE_AGENT,
    SOURCE_LOCAL,
    SOURCE_TIER,
    KVBusConnectorMetadata,
    LoadSpec,
    PushSpec,
    SaveSpec,
)
from kvbus.integrations.vllm.protocol import LookupReply, LookupRequest, subject

logger = logging.getLogger(__name__)

#: ``kv_transfer_params`` key naming agents to push a request's prompt context to.
PUSH_PARAM = "kvbus_push_to"
#: ``kv_transfer_params`` key that keeps a request away from kvbus (no lookup).
SKIP_PARAM = "kvbus_skip"
#: ``kv_transfer_params`` key that keeps a request out of kvbus altogether: no lookup, no save
#: into the store, no push (an engine serving it is an engine without the connector).
OFF_PARAM = "kvbus_off"
#: ``kv_transfer_params`` key naming the medium for this request's pull or push (e.g. ``"int8"``).
MEDIUM_PARAM = "kvbus_medium"
#: ``kv_transfer_params`` key naming the request's tenant for kvbus: its KV is shared only with
#: requests of the same tenant (in place of its ``cache_salt``, which then keys vLLM's own cache alone).
TENANT_PARAM = "kvbus_tenant"


@dataclass
class _Hit:
    start: int
    reply: LookupReply


@dataclass
class _Req:
    prompt: list[int]
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0
    push_to: list[str] = field(default_factory=list)
    pushed: bool = False
    loaded: int = 0
    source: str = ""
    holder: str = ""
    medium: str | None = None
    lookup_s: float = 0.0
    declined: int = 0
    off: bool = False
    salt: str = ""
    """The request's salt scope (`salt_scope` of its ``cache_salt``)."""


class SchedulerSide:
    """The connector's scheduler role (one per engine core)."""

    def __init__(self, config: ConnectorConfig, *, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.loop = LoopThread(name=f"kvbus-sched-{config.agent}")
        self._transport_future = self.loop.submit(self._connect())
        self._hits: dict[str, _Hit] = {}
        self._loads: dict[str, LoadSpec] = {}
        self._reqs: dict[str, _Req] = {}
        self._failed: set[str] = set()
        self._inflight_blocks: dict[str, list[int]] = {}
        self._warned = False

    async def _connect(self) -> Any:
        from kvbus.net.transport import NatsTransport

        return await NatsTransport.connect(self.config.nats_url, **self.config.connect_options())

    def _transport(self) -> Any:
        try:
            return self._transport_future.result(timeout=self.config.connect_timeout_s)
        except Exception as exc:  # noqa: BLE001 - no NATS: no kvbus hits, the engine still serves
            if not self._warned:
                self._warned = True
                logger.error(
                    "kvbus connector %s: cannot reach NATS at %s (%s); prefilling everything",
                    self.config.agent,
                    self.config.nats_url,
                    exc,
                )
            return None

    def close(self) -> None:
        """Close the NATS connection and stop the loop."""
        if self._transport_future.done() and self._transport_future.exception() is None:
            transport = self._transport_future.result()
            try:
                self.loop.run(transport.close(), timeout=5.0)
            except Exception:
                logger.debug("closing NATS failed", exc_info=True)
        self.loop.stop()

    # -- lookups ----------------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """vLLM's hook for a request that just arrived: note its prompt, push targets and medium.

        The targets are the config's ``push_to`` plus the agents named in
        ``kv_transfer_params[PUSH_PARAM]`` (without duplicates or this agent); the medium is
        ``kv_transfer_params[MEDIUM_PARAM]`` when it names a known codec, else the config's. A
        request with a ``cache_salt`` (or a ``kv_transfer_params[TENANT_PARAM]``, which takes
        precedence) finds, saves and pushes KV only in that salt's (tenant's) scope.
        """
        params = getattr(request, "kv_transfer_params", None) or {}
        targets = list(self.config.push_to)
        extra = params.get(PUSH_PARAM) if isinstance(params, dict) else None
        if isinstance(extra, str):
            extra = [extra]
        if isinstance(extra, list):
            targets += [t for t in extra if isinstance(t, str) and t not in targets and t != self.config.agent]
        medium = params.get(MEDIUM_PARAM) if isinstance(params, dict) else None
        off = bool(params.get(OFF_PARAM)) if isinstance(params, dict) else False
        self._reqs[request.request_id] = _Req(
            prompt=list(request.prompt_token_ids or []),
            push_to=[] if off else targets,
            medium=_medium(medium) or self.config.medium,
            off=off,
            salt=_salt(request),
        )

    def _lookup(self, tokens: list[int], limit: int, salt: str) -> LookupReply:
        transport = self._transport()
        if transport is None:
            return LookupReply()
        msg = LookupRequest(tokens=tokens[:limit], limit=limit, salt=salt).encode()
        timeout = self.config.lookup_timeout_s

        async def ask() -> bytes:
            data: bytes = await transport.request(subject(self.config.agent, "lookup"), msg, timeout)
            return data

        try:
            return LookupReply.decode(self.loop.run(ask(), timeout=timeout + 0.5))
        except Exception as exc:  # noqa: BLE001 - a lookup that fails is a prefill
            logger.warning(
                "kvbus connector %s: prefix lookup failed (%s: %s); prefilling",
                self.config.agent,
                type(exc).__name__,
                exc,
            )
            return LookupReply()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """vLLM's hook: how many tokens past ``num_computed_tokens`` kvbus can load, and whether asynchronously.

        Asks the worker's agent (one lookup per request and start, kept until the allocation) for
        the longest prefix, up to the last block vLLM lets match, held by its own store, by
        another agent or by the cache tier, and offers the best of the three. The flag is True
        unless the engine's own store holds that prefix (a synchronous load before the forward).
        ``(0, False)`` for a request with ``kvbus_skip`` or ``kvbus_off``, one whose kvbus load failed before, or no
        hit beyond what is computed.
        """
        rid = request.request_id
        params = getattr(request, "kv_transfer_params", None) or {}
        if rid in self._failed or (isinstance(params, dict) and (params.get(SKIP_PARAM) or params.get(OFF_PARAM))):
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        limit = matchable_tokens(len(prompt), self.block_size)
        if limit <= num_computed_tokens:
            return 0, False
        hit = self._hits.get(rid)
        if hit is None or hit.start != num_computed_tokens:
            t0 = time.perf_counter()
            state = self._reqs.get(rid)
            salt = state.salt if state is not None else _salt(request)
            hit = _Hit(num_computed_tokens, self._lookup(prompt, limit, salt))
            self._hits[rid] = hit
            if state is not None:
                state.lookup_s += time.perf_counter() - t0
                state.declined = hit.reply.declined
        reply = hit.reply
        best = max(reply.local, reply.remote, reply.tier)
        if best <= num_computed_tokens:
            return 0, False
        return best - num_computed_tokens, reply.local < best

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM's hook after it allocated the request's blocks: plan the load for the next step's metadata.

        The ``num_external_tokens`` tokens after the lookup's start come from the engine's own store
        if it holds them, else from the holding agent, else from the cache tier, into the blocks
        vLLM allocated for them. Nothing is planned when vLLM took no external tokens.
        """
        rid = request.request_id
        hit = self._hits.pop(rid, None)
        if num_external_tokens <= 0 or hit is None:
            return
        reply = hit.reply
        start, stop = hit.start, hit.start + num_external_tokens
        if reply.local >= stop:
            source, holder = SOURCE_LOCAL, ""
        elif reply.remote >= stop:
            source, holder = SOURCE_AGENT, reply.holder
        else:
            source, holder = SOURCE_TIER, ""
        block_ids = list(blocks.get_block_ids()[0])
        targets = block_ids[start // self.block_size : stop // self.block_size]
        prompt = list(request.prompt_token_ids or [])
        state = self._reqs.setdefault(rid, _Req(prompt=prompt, medium=self.config.medium, salt=_salt(request)))
        self._loads[rid] = LoadSpec(
            request_id=rid,
            tokens=prompt[:stop],
            start=start,
            stop=stop,
            block_ids=targets,
            source=source,
            holder=holder,
            medium=state.medium,
            salt=state.salt,
        )
        self._inflight_blocks[rid] = targets
        state.loaded, state.source, state.holder = num_external_tokens, source, holder
        logger.info(
            "kvbus connector %s: request %s loads tokens %d-%d from %s",
            self.config.agent,
            rid,
            start,
            stop,
            holder or source,
        )

    # -- the step's plan ---------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> KVBusConnectorMetadata:
        """vLLM's per-step hook: the `KVBusConnectorMetadata` the workers act on in this step.

        It carries the loads planned since the last step, a save for each request's whole prompt
        blocks computed by the end of this step, and a push for each request with targets once its
        prompt is computed. Follows new, running and resumed requests' block ids and forgets the
        finished requests.
        """
        step_tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        meta = KVBusConnectorMetadata(loads=list(self._loads.values()), step_tokens=step_tokens)
        self._loads.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            # A request this side did not see arrive (vLLM calls `on_new_request` for each) has an
            # unknown salt: kvbus keeps out of it rather than save a tenant's KV unsalted.
            state = self._reqs.setdefault(new.req_id, _Req(prompt=list(new.prompt_token_ids or []), off=True))
            state.block_ids = list(new.block_ids[0])
            state.saved = max(state.saved, new.num_computed_tokens - new.num_computed_tokens % self.block_size)
            self._plan(meta, new.req_id, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            known = self._reqs.get(rid)
            if known is None:
                continue
            state = known
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            self._plan(meta, rid, state, cached.num_computed_tokens[i] + scheduled.get(rid, 0))
        for rid in scheduler_output.finished_req_ids:
            self._forget(rid)
        return meta

    def _plan(self, meta: KVBusConnectorMetadata, rid: str, state: _Req, computed: int) -> None:
        """Save the prompt's whole blocks computed by the end of this step; push once the prompt is in.

        Nothing for a request with ``kvbus_off``.
        """
        if state.off:
            return
        prompt_done = min(computed, len(state.prompt))
        stop = prompt_done - prompt_done % self.block_size
        n_blocks = stop // self.block_size
        if stop > state.saved and len(state.block_ids) >= n_blocks:
            meta.saves.append(
                SaveSpec(
                    request_id=rid, tokens=state.prompt[:stop], block_ids=state.block_ids[:n_blocks], salt=state.salt
                )
            )
            state.saved = stop
        if state.push_to and not state.pushed and prompt_done >= len(state.prompt) and stop > 0:
            meta.pushes.append(
                PushSpec(
                    request_id=rid,
                    tokens=state.prompt[:stop],
                    to=list(state.push_to),
                    medium=state.medium,
                    salt=state.salt,
                )
            )
            state.pushed = True

    def _forget(self, rid: str) -> None:
        self._reqs.pop(rid, None)
        self._hits.pop(rid, None)
        self._inflight_blocks.pop(rid, None)
        self._failed.discard(rid)

    # -- outcomes ---------------------------------------------------------------------------------

    def update_connector_output(self, connector_output: Any) -> None:
        """vLLM's hook with the workers' outcome of a step: note which kvbus loads failed or finished.

        A request with a load block in ``invalid_block_ids`` is marked failed (vLLM recomputes those
        tokens; kvbus never offers it tokens again); one in ``finished_recving`` is done loading.
        """
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        done = set(getattr(connector_output, "finished_recving", None) or ())
        for rid, blocks in list(self._inflight_blocks.items()):
            if invalid and invalid.intersection(blocks):
                self._failed.add(rid)
                logger.warning(
                    "kvbus connector %s: request %s: kvbus load failed; vLLM recomputes those tokens",
                    self.config.agent,
                    rid,
                )
                self._inflight_blocks.pop(rid, None)
            elif rid in done:
                self._inflight_blocks.pop(rid, None)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hook when a request ends: forget it; returns ``(False, kv_transfer_params)``.

        False: kvbus holds none of the request's blocks past it (saves were copied in the step).
        The params (None for a request this side never saw) say under ``"kvbus"`` what kvbus did:
        the agent, the tokens loaded (0 if the load failed), their source, whether the load failed,
        the agents the prompt was pushed to, the seconds its lookups took (``lookup_s``) and the
        tokens a load was declined for because prefilling them was predicted faster
        (``declined_tokens``).
        """
        rid = request.request_id
        state = self._reqs.get(rid)
        params = None
        if state is not None:
            params = {
                "kvbus": {
                    "agent": self.config.agent,
                    "loaded_tokens": 0 if rid in self._failed else state.loaded,
                    "source": state.holder or state.source,
                    "load_failed": rid in self._failed,
                    "pushed_to": state.push_to if state.pushed else [],
                    "lookup_s": round(state.lookup_s, 6),
                    "declined_tokens": state.declined,
                }
            }
        self._forget(rid)
        return False, params


def _salt(request: Any) -> str:
    """The scope of a request's ``kvbus_tenant`` parameter, else of its ``cache_salt`` ("" without either)."""
    params = getattr(request, "kv_transfer_params", None) or {}
    tenant = params.get(TENANT_PARAM) if isinstance(params, dict) else None
    salt = getattr(request, "cache_salt", None)
    return salt_scope(salt if isinstance(salt, str) else None, tenant=tenant if isinstance(tenant, str) else None)


def _medium(value: object) -> str | None:
    """A medium from ``kv_transfer_params`` (ignored, with a warning, when it is not a known one)."""
    if value is None:
        return None
    from kvbus.codecs import get_codec

    try:
        return get_codec(str(value)).name
    except ValueError as exc:
        logger.warning("kvbus connector: ignoring kv_transfer_params[%r]: %s", MEDIUM_PARAM, exc)
        return None
