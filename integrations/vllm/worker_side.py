"""The worker-side half: write delivered KV into vLLM's paged cache and read finished blocks out.

It runs in vLLM's worker process, which owns the paged KV tensors, and hosts the engine's kvbus
agent (`KVBusClient` on a `LoopThread`). Per step, from the scheduler's `KVBusConnectorMetadata`:

- local loads (a context already in the store) are written before the forward (`start_load_kv`);
- pulls and cache-tier loads are started there too, and written when they arrive; the request
  is then reported in ``finished_recving`` (`get_transfer_results`);
- prompt blocks the forward computed are read after it (`wait_for_save`) and stored and indexed
  in the background; pushes follow the saves.

A load that fails for any reason (holder gone, refused, wrong context, timeout, the store lost
the blocks, an unusable delivery) writes nothing; its block ids go to vLLM through
`get_block_ids_with_load_errors`, and with ``kv_load_failure_policy: recompute`` vLLM computes
those tokens itself. Loading never leaves a wrong block.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvbus.integrations.vllm.client import KVBusClient
from kvbus.integrations.vllm.config import ConnectorConfig
from kvbus.integrations.vllm.errors import LoadFailed
from kvbus.integrations.vllm.keys import as_ids
from kvbus.integrations.vllm.layout import LayoutError, PagedLayout
from kvbus.integrations.vllm.loop import LoopThread
from kvbus.integrations.vllm.metadata import SOURCE_AGENT, SOURCE_LOCAL, KVBusConnectorMetadata, LoadSpec
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    spec: LoadSpec
    future: concurrent.futures.Future[KVCache]
    started: float


class WorkerSide:
    """The connector's worker role (one per worker process)."""

    def __init__(
        self, config: ConnectorConfig, signature: ModelSignature, *, block_size: int, writer_factory: Any = None
    ) -> None:
        self.config = config
        self.signature = signature
        self.block_size = block_size
        self._writer_factory = writer_factory
        self.layers: list[torch.Tensor] = []
        self.layout: PagedLayout | None = None
        self.client: KVBusClient | None = None
        self.loop: LoopThread | None = None
        self._pending: dict[str, _Pending] = {}
        self._errors: set[int] = set()
        self._fidelity: dict[str, float] = {}
        self.stats = {"loads": 0, "load_failures": 0, "blocks_loaded": 0, "saves": 0}
        self._forward_start: float | None = None

    # -- setup ------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take the engine's paged tensors (ordered by layer), learn their layout, start the agent."""
        from vllm.model_executor.models.utils import extract_layer_index

        ordered = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        self.layers = [t for _, t in ordered]
        if len(self.layers) != self.signature.n_layers:
            logger.error(
                "kvbus connector %s: %d KV layers, the model signature says %d; kvbus is off",
                self.config.agent,
                len(self.layers),
                self.signature.n_layers,
            )
            return
        first = self.layers[0]
        try:
            writer = self._writer_factory(first.dtype) if self._writer_factory is not None else None
            self.layout = PagedLayout.probe(
                block_size=self.block_size,
                n_kv_heads=self.signature.n_kv_heads,
                head_dim=self.signature.head_dim,
                dtype=first.dtype,
                writer=writer,
            )
            for layer in self.layers:
                self.layout.check(layer)
        except LayoutError as exc:
            logger.error("kvbus connector %s: %s; kvbus is off", self.config.agent, exc)
            self.layout = None
            return
        self.loop = LoopThread(name=f"kvbus-worker-{self.config.agent}")
        self.client = KVBusClient(self.config, self.signature, block_size=self.block_size, dtype=first.dtype)
        try:
            self.loop.run(self.client.start(), timeout=self.config.connect_timeout_s + 5)
        except Exception as exc:  # noqa: BLE001 - the engine serves without kvbus rather than not at all
            logger.error(
                "kvbus connector %s: could not join kvbus at %s (%s: %s); kvbus is off",
                self.config.agent,
                self.config.nats_url,
                type(exc).__name__,
                exc,
            )
            self.client = None
            return
        logger.info(
            "kvbus connector %s: %d layers, paged layout %s",
            self.config.agent,
            len(self.layers),
            self.layout.fingerprint(),
        )

    @property
    def active(self) -> bool:
        """Whether kvbus is on: the layout was learnt and the agent joined (else loads fail and saves are skipped)."""
        return self.client is not None and self.layout is not None and self.loop is not None

    def shutdown(self) -> None:
        """vLLM's shutdown hook: close the kvbus client (the agent leaves the bus) and stop the loop."""
        if self.loop is None:
            return
        if self.client is not None:
            try:
                self.loop.run(self.client.close(), timeout=10.0)
            except Exception:
                logger.debug("closing the kvbus client failed", exc_info=True)
        self.loop.stop()

    # -- loads ------------------------------------------------------------------------------------

    def forward_starts(self, meta: KVBusConnectorMetadata) -> None:
        """The step's forward starts now (vLLM binds the metadata just before it); `wait_for_save`,
        right after the forward, ends it: the engine's prefill speed (`PullGate.record_step`).

        Not `start_load_kv`: vLLM calls it *after* the forward when every load is asynchronous,
        right before `wait_for_save`. A step with a local load is no prefill sample.
        """
        local = any(spec.source == SOURCE_LOCAL for spec in meta.loads)
        self._forward_start = None if local or not meta.step_tokens else time.perf_counter()

    def start_load_kv(self, meta: KVBusConnectorMetadata) -> None:
        """vLLM's before-the-forward hook: carry out the step's loads.

        A local load is read from the store and written into its blocks now. A pull from the
        holding agent or a cache-tier load is started on the loop; `get_finished` writes it when
        it arrives. A load that cannot be done (kvbus off, or a local load that fails) is reported
        for recompute instead.
        """
        for spec in meta.loads:
            if not self.active:
                self._fail(spec, "kvbus is not connected")
                continue
            assert self.client is not None and self.loop is not None
            ids = as_ids(spec.tokens)
            if spec.source == SOURCE_LOCAL:
                t0 = time.perf_counter()
                try:
                    kv = self.loop.run(
                        self.client.get(ids, spec.stop, salt=spec.salt), timeout=self.config.load_timeout_s
                    )
                    self._write(spec, kv)
                except (LoadFailed, LayoutError, TimeoutError, RuntimeError) as exc:
                    self._fail(spec, str(exc))
                    continue
                self._loaded(spec, kv, time.perf_counter() - t0)
                continue
            if spec.source == SOURCE_AGENT:
                coro = self.client.pull(
                    spec.holder, ids, spec.stop, timeout=self.config.load_timeout_s, medium=spec.medium, salt=spec.salt
                )
            else:
                coro = self.client.load_tier(ids, spec.stop, salt=spec.salt)
            self._pending[spec.request_id] = _Pending(spec, self.loop.submit(coro), time.perf_counter())

    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose asynchronous loads ended this step (loaded, or failed and reported)."""
        done: set[str] = set()
        for rid, pending in list(self._pending.items()):
            fut = pending.future
            if not fut.done():
                if time.perf_counter() - pending.started > self.config.load_timeout_s + 10:
                    fut.cancel()
                else:
                    continue
            del self._pending[rid]
            done.add(rid)
            try:
                kv = fut.result(timeout=0)
                self._write(pending.spec, kv)
            except concurrent.futures.CancelledError:
                self._fail(pending.spec, "the load was cancelled")
                continue
            except Exception as exc:  # noqa: BLE001 - any failure means recompute, never a wrong block
                self._fail(pending.spec, str(exc))
                continue
            seconds = time.perf_counter() - pending.started
            self._loaded(pending.spec, kv, seconds)
            if self.client is not None:
                self.client.gate.record_load(pending.spec.stop - pending.spec.start, seconds)
        for rid in finished_req_ids:
            self._fidelity.pop(rid, None)
        return done

    def take_errors(self) -> set[int]:
        """The block ids of loads that failed since the last call (vLLM recomputes them); clears the set."""
        errors, self._errors = self._errors, set()
        return errors

    def _write(self, spec: LoadSpec, kv: KVCache) -> None:
        """Write tokens ``[start, stop)`` of ``kv`` into the request's blocks (after checking them)."""
        assert self.layout is not None
        n_blocks = (spec.stop - spec.start) // self.block_size
        if len(spec.block_ids) != n_blocks or spec.start % self.block_size or spec.stop % self.block_size:
            raise LoadFailed(spec.stop, f"{len(spec.block_ids)} blocks for tokens {spec.start}-{spec.stop}")
        if kv.seq_len < spec.stop or not torch.equal(kv.tokens[0, : spec.stop], as_ids(spec.tokens)[0, : spec.stop]):
            raise LoadFailed(spec.stop, "the KV is not of this prompt's prefix")
        if kv.n_layers != len(self.layers) or not kv.signature.compatible_with(self.signature):
            raise LoadFailed(spec.stop, f"KV of another model ({kv.signature.model}, {kv.n_layers} layers)")
        part = kv.slice(spec.start, spec.stop)
        for layer, k, v in zip(self.layers, part.keys, part.values):
            self.layout.write(layer, spec.block_ids, k, v)

    def _loaded(self, spec: LoadSpec, kv: KVCache, seconds: float) -> None:
        n_blocks = len(spec.block_ids)
        self.stats["loads"] += 1
        self.stats["blocks_loaded"] += n_blocks
        self._fidelity[spec.request_id] = float(kv.fidelity)
        logger.info(
            "kvbus connector %s: request %s: loaded %d blocks (tokens %d-%d) from %s in %.3f s",
            self.config.agent,
            spec.request_id,
            n_blocks,
            spec.start,
            spec.stop,
            spec.holder or spec.source,
            seconds,
        )
        self._emit(
            "load",
            request_id=spec.request_id,
            tokens=spec.stop - spec.start,
            blocks=n_blocks,
            peer=spec.holder or spec.source,
            seconds=seconds,
            fidelity=float(kv.fidelity),
        )

    def _fail(self, spec: LoadSpec, reason: str) -> None:
        self.stats["load_failures"] += 1
        self._errors.update(spec.block_ids)
        logger.warning(
            "kvbus connector %s: request %s: loading tokens %d-%d from %s failed (%s); reporting %d "
            "blocks to vLLM to recompute",
            self.config.agent,
            spec.request_id,
            spec.start,
            spec.stop,
            spec.holder or spec.source,
            reason,
            len(spec.block_ids),
        )
        self._emit(
            "load",
            ok=False,
            request_id=spec.request_id,
            tokens=spec.stop - spec.start,
            blocks=len(spec.block_ids),
            peer=spec.holder or spec.source,
            reason=reason,
        )

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.client is not None and self.loop is not None:
            try:
                self.loop.submit(self.client.emit(kind, **fields))
            except RuntimeError:
                pass

    # -- saves and pushes -------------------------------------------------------------------------

    def wait_for_save(self, meta: KVBusConnectorMetadata) -> None:
        """vLLM's after-the-forward hook: copy the step's finished prompt blocks out and start the pushes.

        Each save's blocks are read from every layer into a `KVCache` (with the fidelity of what
        was loaded into that request) now, while vLLM still owns the blocks; storing and indexing
        it runs in the background on the loop. Each push is submitted after the saves and logged
        when it ends. Nothing happens while kvbus is off.
        """
        if self._forward_start is not None and self.client is not None:
            self.client.gate.record_step(meta.step_tokens, time.perf_counter() - self._forward_start)
        self._forward_start = None
        if not self.active or (not meta.saves and not meta.pushes):
            return
        assert self.client is not None and self.loop is not None and self.layout is not None
        client = self.client
        for spec in meta.saves:
            keys, values = [], []
            for layer in self.layers:
                k, v = self.layout.read(layer, spec.block_ids)
                keys.append(k)
                values.append(v)
            kv = KVCache(
                tokens=as_ids(spec.tokens),
                signature=self.signature,
                keys=keys,
                values=values,
                fidelity=self._fidelity.get(spec.request_id, 1.0),
            )
            self.stats["saves"] += 1

            async def store(kv: KVCache = kv, rid: str = spec.request_id, salt: str = spec.salt) -> None:
                client.save(kv, rid, salt=salt)

            self.loop.submit(store())
        for push in meta.pushes:
            fut = self.loop.submit(client.push(push.to, push.tokens, push.medium, salt=push.salt))
            fut.add_done_callback(functools.partial(_log_push, self.config.agent, push.request_id, push.to))


def _log_push(agent: str, rid: str, to: list[str], fut: concurrent.futures.Future[Any]) -> None:
    try:
        reply = fut.result()
    except Exception as exc:  # noqa: BLE001 - logged
        logger.warning("kvbus connector %s: push of request %s to %s failed: %s", agent, rid, ",".join(to), exc)
        return
    if reply.ok:
        logger.info(
            "kvbus connector %s: pushed request %s's context (%d tokens, %s, %d bytes) to %s",
            agent,
            rid,
            reply.tokens,
            reply.medium,
            reply.nbytes,
            ",".join(to),
        )
    else:
        logger.warning(
            "kvbus connector %s: push of request %s to %s failed: %s", agent, rid, ",".join(to), reply.reason
        )
