"""An agent's side of the dialogue with its group scheduler.

Registration in the directory, grant requests (asked again while queued), the scheduler's
control messages (grants that come later, pause/resume/rate/cancel, memory hints), done
reports and bandwidth reservations. The scheduler is reached by NATS messages only.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from nats.aio.msg import Msg
from opentelemetry.trace import Span

from kvbus import telemetry
from kvbus.bus.budgets import Budget, BudgetKey, Budgets
from kvbus.bus.control import TransferControls
from kvbus.bus.endpoint import Endpoint
from kvbus.bus.errors import (
    BusClosed,
    ReceiverGone,
    SchedulerUnavailable,
    TransferError,
    TransferRejected,
    TransferTimeout,
)
from kvbus.bus.pacing import EmulatedLink, TokenBucket
from kvbus.errors import ReservationRefused, WireFormatError
from kvbus.kvcache import KVCache
from kvbus.net.buckets import with_retry
from kvbus.net.transport import NoResponders
from kvbus.protocol import (
    AgentRecord,
    Control,
    ControlReply,
    FlowReservation,
    Grant,
    Reason,
    RequestAck,
    ReservationReply,
    TransferDone,
    TransferRequest,
    check_name,
    decode_message,
    sched_subject,
)

logger = logging.getLogger(__name__)

#: A done report sent right after a reconnection is sent again this much later (and later again).
DONE_REPEATS_S = (0.5, 1.5)


class SchedulerLink:
    """Talks to the agent's group scheduler on behalf of its sender and its registration."""

    def __init__(
        self, endpoint: Endpoint, *, secure: bool, directory: Callable[[], Awaitable[Any]], host: str = ""
    ) -> None:
        self._ep = endpoint
        self._host = host
        """The data plane's host, for the directory record (the cost model's hint that ``shm`` can work)."""
        self._secure = secure
        """Per-agent permissions (no JetStream access): the group scheduler writes the agent's record."""
        self._directory = directory
        """Opens the JetStream KV bucket of agent records (`Bus.directory`; None when there is none)."""
        self._grants: dict[str, asyncio.Future[Grant]] = {}
        self.controls = TransferControls()
        """Applies the scheduler's controls to the agent's outgoing transfers (`controls.outgoing`)."""
        self._scheduler_seen = False
        """Whether the group scheduler has answered this agent (a silent one is then waited for)."""
        self._shed_tasks: set[asyncio.Task[Any]] = set()
        self._repeats: set[asyncio.Task[Any]] = set()
        """Done reports said again after a reconnection."""
        self.budgets = Budgets()
        """Rate budgets the scheduler granted (small transfers under one start without asking)."""
        self._end_on_done: set[str] = set()
        """Granted transfers whose budget ends with their own done report (ended while they ran)."""

    @property
    def queue_size(self) -> int:
        """Transfers waiting for a grant or streaming, as the probes report it."""
        return len(self._grants) + len(self.controls.outgoing)

    # -- registration -----------------------------------------------------------------------

    async def register(self) -> None:
        """Write (or, in secure mode, have the scheduler write) the agent's directory record."""
        ep = self._ep
        link = ep.link or EmulatedLink()
        record = AgentRecord(
            name=ep.name,
            group=ep.group,
            role=ep.role,
            priority=ep.priority,
            signature=ep.signature.to_dict() if ep.signature else None,
            link_bps=link.bandwidth_bps,
            latency_s=link.latency_s,
            recompute=ep.runner is not None,
            host=self._host,
        )
        if self._secure:
            # No JetStream rights: the group scheduler writes the record to the directory.
            try:
                await ep.transport.request(
                    sched_subject(ep.group, "register", ep.name), record.encode(), timeout=ep.config.request_timeout
                )
            except (NoResponders, TimeoutError):
                logger.warning("agent %s: no scheduler of group %s confirmed its registration", ep.name, ep.group)
            return
        directory = await self._directory()
        if directory is not None:
            # The same put again is harmless: it is asked again while the bucket's stream elects
            # a leader (a NATS server of the cluster died).
            await with_retry(lambda: directory.put(ep.name, record.encode()), f"registering {ep.name}")

    async def close(self) -> None:
        """Fail the sends still waiting for a grant and remove the agent from the directory."""
        for fut in self._grants.values():
            if not fut.done():
                fut.set_exception(BusClosed("agent"))
        for budget in self.budgets.clear():
            try:
                await self._end_budget(budget, [])
            except Exception:
                logger.debug("could not end a rate budget", exc_info=True)
        try:
            directory = await self._directory()
            if directory is not None:
                await directory.delete(self._ep.name)
        except Exception:
            logger.debug("could not remove %s from the directory", self._ep.name, exc_info=True)

    # -- grants -------------------------------------------------------------------------------

    async def request_grant(
        self,
        transfer_id: str,
        receivers: list[str],
        kv: KVCache,
        medium: str | None,
        deadline: float | None,
        critical: bool,
        base_tokens: int = 0,
        path: str = "",
    ) -> Grant:
        """Ask the group scheduler for a grant and wait for it.

        A queued request is asked again every ``regrant_interval`` (the same transfer id, so the
        scheduler keeps one entry): a scheduler that restarted, or a standby that took over,
        learns of it that way. While no scheduler answers, a sender that has seen one keeps
        trying until its wait is over; one that never saw a scheduler fails at once.

        Args:
            base_tokens: tokens at the start of ``kv`` every receiver already holds from this agent.
            path: the data path the bytes are expected to take (the cost model uses its link estimate).

        Raises:
            TransferRejected: the scheduler refused; ``code`` says why.
            SchedulerUnavailable: no scheduler answers for the group.
            TransferTimeout: no grant within the wait.
        """
        ep = self._ep
        key: BudgetKey = (tuple(receivers), medium, critical, base_tokens > 0)
        under = await self._under_budget(key, transfer_id, kv.nbytes, deadline)
        if under is not None:
            return under
        fut: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        self._grants[transfer_id] = fut
        wait_span = telemetry.start("kvbus.grant.wait")
        try:
            traceparent = telemetry.traceparent(wait_span)
            request = self._request(
                transfer_id, receivers, kv, medium, deadline, critical, base_tokens, path, traceparent
            )
            wait = deadline if deadline is not None else ep.config.grant_timeout
            with telemetry.using(wait_span, end=False):
                grant = await self._ask_scheduler(transfer_id, request.encode(), fut, wait, receivers)
        except BaseException:
            wait_span.end()
            raise
        finally:
            self._grants.pop(transfer_id, None)
        try:
            await self._accept(grant, key, transfer_id, receivers, wait_span)
        finally:
            if wait_span.is_recording():
                wait_span.set_attributes({"kvbus.medium": grant.medium, "kvbus.reason": grant.reason})
            wait_span.end()
        return grant

    async def _under_budget(
        self, key: BudgetKey, transfer_id: str, nbytes: int, deadline: float | None
    ) -> Grant | None:
        """A grant under a rate budget the agent holds for ``key``, if one has room; else end the
        budgets of the same receivers that cannot take it (or mark them to end when their
        running transfer reports), so the request does not queue behind them."""
        under = self.budgets.take(key, transfer_id, nbytes, deadline)
        if under is not None:
            self.controls.granted(transfer_id)
            return under
        for budget in self.budgets.end_for(key[0]):
            if budget.transfer_id in self.controls.outgoing or budget.transfer_id in self._grants:
                self._end_on_done.add(budget.transfer_id)
            else:
                await self._end_budget(budget, list(key[0]))
        return None

    def _request(
        self,
        transfer_id: str,
        receivers: list[str],
        kv: KVCache,
        medium: str | None,
        deadline: float | None,
        critical: bool,
        base_tokens: int,
        path: str,
        traceparent: str | None,
    ) -> TransferRequest:
        """The `TransferRequest` the scheduler decides on."""
        ep = self._ep
        return TransferRequest(
            transfer_id=transfer_id,
            src=ep.name,
            dst=receivers,
            group=ep.group,
            n_tokens=kv.n_tokens,
            nbytes=kv.nbytes,
            signature=kv.signature.to_dict(),
            medium=medium,
            deadline=time.time() + deadline if deadline is not None else None,
            critical=critical,
            fidelity=float(kv.fidelity),
            base_tokens=base_tokens,
            path=path,
            traceparent=traceparent,
            budget=ep.config.rate_budgets and deadline is None,
            inline_limit=ep.config.inline_limit,
        )

    async def _accept(self, grant: Grant, key: BudgetKey, transfer_id: str, receivers: list[str], span: Span) -> None:
        """Take ``grant``: raise its refusal, remember it for early controls (and as a budget),
        then wait until its start time (and the emulated link's round trips)."""
        ep = self._ep
        if not grant.medium:
            raise _refused(transfer_id, ep.group, receivers, grant.reason, grant.code)
        self.controls.granted(transfer_id)
        if ep.config.rate_budgets:
            self.budgets.add(key, grant)
        delay = grant.start_at - time.time()
        if grant.latency_s > 0:
            # Link emulation: the transfer's round trips (request, open, verdict) on a path with
            # this one-way latency; real links need no such sleep.
            delay = max(delay, 0.0) + 6 * grant.latency_s
        if delay > 0:
            with telemetry.using(span, end=False):
                await asyncio.sleep(min(delay, ep.config.grant_timeout))

    async def _ask_scheduler(
        self, transfer_id: str, payload: bytes, fut: asyncio.Future[Grant], wait: float, receivers: list[str]
    ) -> Grant:
        ep = self._ep
        subject = sched_subject(ep.group, "request", ep.name)
        started = time.monotonic()
        give_up = started + max(wait, ep.config.request_timeout)
        # A scheduler that never answered is given `request_timeout` to appear: one that is
        # starting, or whose first leader election waits on JetStream, has no responder yet.
        first_contact_until = started + ep.config.request_timeout
        backoff = 0.05
        while True:
            left = give_up - time.monotonic()
            if fut.done():
                return fut.result()
            if left <= 0:
                stage = "waiting for a grant" if self._scheduler_seen else f"asking the scheduler of group {ep.group!r}"
                raise TransferTimeout(transfer_id, stage, wait)
            try:
                data = await ep.transport.request(subject, payload, timeout=min(ep.config.request_timeout, left))
            except NoResponders:
                if not self._scheduler_seen and time.monotonic() + backoff >= first_contact_until:
                    raise SchedulerUnavailable(transfer_id, ep.group) from None
                # No scheduler yet, or it is gone (restarting, failing over): ask again shortly.
                await asyncio.wait({fut}, timeout=min(backoff, left))
                backoff = min(2 * backoff, ep.config.regrant_interval)
                continue
            except TimeoutError:
                continue
            self._scheduler_seen = True
            backoff = 0.05
            answer = decode_message(data, RequestAck, Grant)
            if isinstance(answer, Grant):
                return answer
            if not answer.ok:
                raise _refused(transfer_id, ep.group, receivers, answer.reason, answer.code)
            # Queued: the grant comes on the ctl subject. Ask again if it takes long.
            await asyncio.wait({fut}, timeout=min(ep.config.regrant_interval, max(0.0, give_up - time.monotonic())))

    async def report_done(
        self,
        transfer_id: str,
        medium: str,
        receivers: list[str],
        nbytes: int,
        seconds: float,
        error: BaseException | None,
        wire_s: float = 0.0,
        path: str = "",
        encode_s: float = 0.0,
        decode_s: float = 0.0,
    ) -> None:
        """Tell the scheduler a granted transfer finished (or failed), with its observed size and
        time, and the phases of that time the cost model learns from (encode, the slowest decode)."""
        ep = self._ep
        budget = self.budgets.finished(transfer_id)
        ending = transfer_id in self._end_on_done
        self._end_on_done.discard(transfer_id)
        done = TransferDone(
            transfer_id=transfer_id,
            src=ep.name,
            ok=error is None,
            medium=medium,
            nbytes=nbytes,
            seconds=seconds,
            error=str(error) if error else "",
            dst=receivers,
            wire_s=wire_s,
            path=path,
            budget=budget.transfer_id if budget is not None else (transfer_id if ending else ""),
            encode_s=encode_s,
            decode_s=decode_s,
        )
        await self._publish_done(done)

    def bucket(self, transfer_id: str) -> TokenBucket | None:
        """The pacing shared by the transfers of the budget ``transfer_id`` runs under, if any."""
        budget = self.budgets.under(transfer_id)
        return budget.bucket if budget is not None else None

    async def _end_budget(self, budget: Budget, receivers: list[str]) -> None:
        """Tell the scheduler this agent is done with ``budget`` (its slot is free now)."""
        done = TransferDone(
            transfer_id=budget.transfer_id,
            src=self._ep.name,
            ok=True,
            medium=budget.medium,
            nbytes=0,
            seconds=0.0,
            dst=receivers,
            budget=budget.transfer_id,
        )
        await self._publish_done(done)

    async def _publish_done(self, done: TransferDone) -> None:
        ep = self._ep
        transfer_id = done.transfer_id
        subject, data = sched_subject(ep.group, "done", ep.name), done.encode()
        try:
            await ep.transport.publish(subject, data)
        except Exception:
            logger.warning("could not report transfer %s done", transfer_id, exc_info=True)
        if ep.transport.settling():
            # Just reconnected: the scheduler may not be subscribed again yet, and a lost report
            # holds the pair's slot until its transfer_timeout. Saying it again costs nothing.
            task = asyncio.create_task(self._report_again(subject, data), name=f"kvbus-done-{transfer_id}")
            self._repeats.add(task)
            task.add_done_callback(self._repeats.discard)

    async def _report_again(self, subject: str, data: bytes) -> None:
        for delay in DONE_REPEATS_S:
            await asyncio.sleep(delay)
            try:
                await self._ep.transport.publish(subject, data)
            except Exception:
                logger.debug("could not repeat a done report", exc_info=True)

    # -- control messages -----------------------------------------------------------------------

    async def on_ctl(self, msg: Msg) -> None:
        """The agent's ``ctl`` subject: a grant that was queued, a control, or a memory hint."""
        ep = self._ep
        try:
            cmd = decode_message(msg.data, Grant, Control)
        except WireFormatError:
            logger.warning("agent %s: malformed control message dropped", ep.name, exc_info=True)
            return
        if isinstance(cmd, Grant):
            fut = self._grants.get(cmd.transfer_id)
            if fut is not None and not fut.done():
                fut.set_result(cmd)
            return
        if cmd.action == "shed":
            self._shed(cmd)
            return
        budget = self.budgets.named(cmd.transfer_id)
        if budget is not None:
            # A pause suspends the budget (the transfers under it are short: they finish), a
            # resume gives it back, a rate paces what runs under it from now on.
            if cmd.action in ("pause", "cancel"):
                budget.suspended = True
            elif cmd.action == "resume":
                budget.suspended = False
            elif cmd.action == "rate":
                budget.rate_bps = cmd.rate_bps
                budget.bucket.set_rate(cmd.rate_bps)
        reply = self.controls.apply(cmd)
        if budget is not None and cmd.transfer_id not in self.controls.outgoing:
            reply = ControlReply(cmd.transfer_id, cmd.action, True, 1.0, "rate budget")
        if not reply.ok:
            logger.debug("agent %s: %s of %s declined: %s", ep.name, cmd.action, cmd.transfer_id, reply.reason)
        if msg.reply:
            await ep.transport.reply(msg, reply.encode())

    def _shed(self, cmd: Control) -> None:
        """Memory hint from the scheduler: the cache passed its watermark. Without a cache tier, ignored."""
        name = self._ep.name
        cache = self._ep.cache
        if cache is None:
            return
        logger.info("agent %s: shedding cache (%s)", name, cmd.reason)

        async def run() -> None:
            try:
                await cache.shed(cmd.nbytes or None)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("agent %s: shedding the cache failed", name)

        task = asyncio.create_task(run(), name=f"kvbus-shed-{name}")
        self._shed_tasks.add(task)
        task.add_done_callback(self._shed_tasks.discard)

    # -- reservations ---------------------------------------------------------------------------

    async def reserve(self, to: str | Iterable[str], *, period: float, size: int, deadline: float) -> str:
        """Reserve bandwidth for a periodic critical flow; see `Agent.reserve`."""
        ep = self._ep
        receivers = [to] if isinstance(to, str) else list(dict.fromkeys(to))
        for rx in receivers:
            check_name("agent", rx)
        rid = uuid.uuid4().hex[:16]
        msg = FlowReservation(
            reservation_id=rid,
            src=ep.name,
            dst=receivers,
            group=ep.group,
            period_s=float(period),
            size_bytes=int(size),
            deadline_s=float(deadline),
        )
        reply = await self._reservation_request(msg)
        if not reply.ok:
            raise ReservationRefused(rid, reply.reason, reply.code or Reason.REFUSED)
        return rid

    async def unreserve(self, reservation_id: str) -> None:
        """Release a reservation made with `reserve`."""
        msg = FlowReservation(
            reservation_id=reservation_id,
            src=self._ep.name,
            dst=[],
            group=self._ep.group,
            period_s=0.0,
            size_bytes=0,
            deadline_s=0.0,
            cancel=True,
        )
        await self._reservation_request(msg)

    async def _reservation_request(self, msg: FlowReservation) -> ReservationReply:
        ep = self._ep
        try:
            data = await ep.transport.request(
                sched_subject(ep.group, "reserve", ep.name), msg.encode(), timeout=ep.config.request_timeout
            )
        except NoResponders:
            raise SchedulerUnavailable(msg.reservation_id, ep.group) from None
        except TimeoutError:
            raise TransferTimeout(
                msg.reservation_id,
                f"asking the scheduler of group {ep.group!r} for a reservation",
                ep.config.request_timeout,
            ) from None
        return ReservationReply.decode(data)


def _refused(transfer_id: str, group: str, receivers: list[str], reason: str, code: Reason) -> TransferError:
    """The error of a transfer the scheduler refused: `ReceiverGone` when a receiver left the group
    (`Reason.RECEIVER_GONE`), else `TransferRejected` with the code."""
    if code == Reason.RECEIVER_GONE:
        return ReceiverGone(transfer_id, receivers[0] if len(receivers) == 1 else ",".join(receivers), reason)
    return TransferRejected(transfer_id, f"scheduler of {group}", reason, code=code or Reason.OTHER)
