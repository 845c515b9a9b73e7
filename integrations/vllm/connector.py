"""`KVBusConnector`: vLLM's KV-connector interface (``KVConnectorBase_V1``) over kvbus.

Configure it as vLLM users configure connectors::

    --kv-transfer-config '{"kv_connector": "KVBusConnector",
                           "kv_connector_module_path": "kvbus.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"nats_url": "nats://...", "agent": "planner",
                                                         "group": "g1"}}'

(or the same dict as ``LLM(kv_transfer_config=...)``). vLLM builds one instance per role: the
scheduler role (`SchedulerSide`) in the engine core, the worker role (`WorkerSide`) in each
worker; this class only dispatches to them.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from kvbus.integrations.vllm.config import ConnectorConfig
from kvbus.integrations.vllm.metadata import KVBusConnectorMetadata
from kvbus.integrations.vllm.scheduler_side import SchedulerSide
from kvbus.integrations.vllm.worker_side import WorkerSide
from kvbus.signature import ModelSignature

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def engine_signature(vllm_config: VllmConfig, config: ConnectorConfig) -> ModelSignature:
    """The kvbus model signature of the engine's model, in the engine's dtype."""
    model_config = vllm_config.model_config
    name = config.model_name
    if not name:
        served = getattr(model_config, "served_model_name", None)
        if isinstance(served, (list, tuple)):
            served = served[0] if served else None
        name = (
            served if served and served != model_config.model else os.path.basename(str(model_config.model).rstrip("/"))
        )
    dtype = model_config.dtype if isinstance(model_config.dtype, torch.dtype) else None
    return ModelSignature.from_hf_config(model_config.hf_config, model=str(name), dtype=dtype)


def cpu_writer_factory(block_size: int, head_dim: int, kv_cache_dtype: str) -> Any:
    """The CPU attention kernel's cache writer for a KV dtype (what `PagedLayout.probe` learns from)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    def factory(dtype: torch.dtype) -> Any:
        isa = _get_attn_isa(dtype, block_size, head_dim, kv_cache_dtype)

        def write(
            key: torch.Tensor,
            value: torch.Tensor,
            key_cache: torch.Tensor,
            value_cache: torch.Tensor,
            slot_mapping: torch.Tensor,
        ) -> None:
            ops.cpu_attn_reshape_and_cache(
                key.to(key_cache.dtype),
                value.to(value_cache.dtype),
                key_cache,
                value_cache,
                slot_mapping,
                isa,
                kv_cache_dtype=kv_cache_dtype,
            )

        return write

    return factory


class KVBusConnector(KVConnectorBase_V1):
    """Share vLLM's KV-cache through kvbus: push to named agents, pull the longest held prefix."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self.config, block_size=self.block_size)
        else:
            signature = engine_signature(vllm_config, self.config)
            factory = None
            if vllm_config.device_config.device_type == "cpu":
                factory = cpu_writer_factory(
                    self.block_size, signature.head_dim, str(vllm_config.cache_config.cache_dtype)
                )
            self._worker = WorkerSide(self.config, signature, block_size=self.block_size, writer_factory=factory)

    # -- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take the paged KV tensors and join kvbus."""
        if self._worker is not None:
            self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """vLLM's step begins: the worker side notes when its forward starts (see `WorkerSide.forward_starts`)."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVBusConnectorMetadata):
            self._worker.forward_starts(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Write local hits now; start pulls and cache-tier loads."""
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, KVBusConnectorMetadata):
            self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: local loads are written before the forward, others before the request runs."""
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Nothing per layer: `wait_for_save` reads every layer's finished blocks at once."""
        return

    def wait_for_save(self) -> None:
        """Read this step's finished prompt blocks and hand them to the store; start pushes."""
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, KVBusConnectorMetadata):
                self._worker.wait_for_save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Requests whose pulls ended (loaded, or failed and reported for recompute)."""
        if self._worker is None:
            return KVConnectorTransferResults()
        return KVConnectorTransferResults(finished_recving=self._worker.get_finished(finished_req_ids))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed: vLLM recomputes them (``kv_load_failure_policy: recompute``)."""
        return self._worker.take_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        """Leave kvbus."""
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()

    # -- scheduler side -------------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """Note the request's push targets."""
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that kvbus can deliver, and whether they load asynchronously."""
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the load into the blocks vLLM allocated."""
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads, saves and pushes."""
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Learn which loads failed (those requests are not offered kvbus tokens again)."""
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are never held past the request; ``kv_transfer_params`` say what kvbus did."""
        if self._scheduler is None:
            return False, None
        return self._scheduler.request_finished(request, block_ids)
