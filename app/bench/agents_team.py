"""The team of `kvbus bench agents`: four vLLM engines (planner, two executors, verifier) on one task.

Each engine is its own process (`EngineProcess`) and its own kvbus agent (`KVBusConnector`). A
workflow is a few turns over one shared context: a system prompt and documents from the shipped
texts; the planner writes a plan, each executor answers a question about the documents (a
passage to continue: its true continuation is in the documents, so the answer is checked), the
verifier reads both answers, and the whole transcript is the next turn's context. Every prompt is
the previous context plus new tokens, so each hand-off can carry the context's KV:

- planner -> executors: the planner's request pushes its prompt's context to both executors
  (``kvbus_push_to``), while it writes the plan;
- executors -> verifier and verifier -> planner (next turn): the receiver pulls the prefix it
  lacks from the agent the prefix index names.

An arm says how the engines hand over: as text (``kvbus_off``: kvbus neither loads, saves nor
pushes), with vLLM's prefix cache used (one ``cache_salt`` for the workflow) or defeated (a new
salt per request), or through kvbus with the cost model's medium or a fixed one.
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbus.app.bench.vllm import BLOCK, corpus_ids

GROUP = "bench-agents"
ROLES = ("planner", "executor-1", "executor-2", "verifier")
#: Cores the engines' single OpenMP thread is bound to: the two executors, which run at the same
#: time, on different cores; planner and verifier, which run alone, one on each.
CPUS = {"planner": "0", "executor-1": "0", "executor-2": "1", "verifier": "1"}
#: Tokens of a document passage an executor is asked to continue, and of the answer checked.
PASSAGE = 12
ANSWER = 4


def agent_name(role: str) -> str:
    """The kvbus agent of a role's engine."""
    return f"agents-{role}"


@dataclass(frozen=True)
class Arm:
    """How a workflow's engines hand over: ``text`` (kvbus off) or ``kvbus`` (``medium`` None: adaptive)."""

    name: str
    handoff: str
    prefix_cache: bool
    medium: str | None = None

    def params(self, push_to: list[str] | None = None, tenant: str = "") -> dict[str, Any]:
        """The request's ``kv_transfer_params`` (``tenant``: the workflow's, for kvbus)."""
        if self.handoff == "text":
            return {"kvbus_off": True}
        out: dict[str, Any] = {"kvbus_tenant": tenant} if tenant else {}
        if self.medium:
            out["kvbus_medium"] = self.medium
        if push_to:
            out["kvbus_push_to"] = [agent_name(r) for r in push_to]
        return out


PREFIX_CACHED_TEXT = Arm("prefix_cached_text", "text", prefix_cache=True)
NO_PREFIX_CACHE_TEXT = Arm("no_prefix_cache_text", "text", prefix_cache=False)
ADAPTIVE = Arm("kvbus_adaptive", "kvbus", prefix_cache=False)
FIXED_MEDIA = ("full", "int8", "int4")
FIXED = tuple(Arm(f"kvbus_{m}", "kvbus", prefix_cache=False, medium=m) for m in FIXED_MEDIA)
#: Media whose loaded KV is bit-exact: their outputs must agree with arm (a)'s.
LOSSLESS = ("full",)


@functools.cache
def _tok(text: str) -> tuple[int, ...]:
    from kvbus.app.models import model_folder

    return tuple(_tokenizer(str(model_folder()))(text, add_special_tokens=False)["input_ids"])


@functools.lru_cache(maxsize=1)
def _tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


SYSTEM = (
    "You are one agent of a team of four: a planner, two executors and a verifier. The team reads "
    "the documents below and answers questions about them with their exact words. Keep every "
    "answer short.\n\nDocuments:\n"
)


@dataclass(frozen=True)
class Question:
    """Continue ``passage`` (tokens of the documents): ``answer`` is what follows it there."""

    passage: tuple[int, ...]
    answer: tuple[int, ...]


@dataclass(frozen=True)
class DocSet:
    """The documents of one workflow and the questions its executors get, turn by turn."""

    offset: int
    docs: tuple[int, ...]
    questions: tuple[tuple[Question, Question], ...]


def docset(n_tokens: int, offset: int, turns: int) -> DocSet:
    """``n_tokens`` of the shipped texts from ``offset`` (wrapping) and two questions per turn.

    Each question's passage occurs once in the documents, so its continuation is the answer.
    """
    ids = corpus_ids()
    offset %= len(ids)
    docs = tuple((ids[offset:] + ids + ids)[:n_tokens])
    span = PASSAGE + ANSWER
    qs: list[Question] = []
    for k in range(2 * turns):
        start = (k + 1) * (n_tokens - span) // (2 * turns + 1)
        for pos in range(start, n_tokens - span):
            passage = docs[pos : pos + PASSAGE]
            if _count(docs, passage) == 1:
                qs.append(Question(passage, docs[pos + PASSAGE : pos + span]))
                break
        else:
            raise ValueError(f"no unique passage after token {start} of the documents at offset {offset}")
    return DocSet(offset, docs, tuple((qs[2 * t], qs[2 * t + 1]) for t in range(turns)))


def _count(seq: tuple[int, ...], sub: tuple[int, ...]) -> int:
    n = len(sub)
    first = sub[0]
    return sum(1 for i in range(len(seq) - n + 1) if seq[i] == first and seq[i : i + n] == sub)


@dataclass
class Call:
    """One request of a workflow: who, which turn, what it was given and what it answered."""

    role: str
    turn: int
    handoff: str  # "" for the first request, else where its context came from ("planner" ...)
    prompt_len: int
    tokens: list[int]
    ttft_s: float | None
    cached_tokens: int
    loaded_tokens: int
    source: str
    declined_tokens: int
    prompt_hash: int
    answer: tuple[int, ...] = ()


@dataclass
class Workflow:
    """The outcome of one workflow of one arm."""

    arm: str
    offset: int
    e2e_s: float
    calls: list[Call] = field(default_factory=list)
    nbytes: int = 0
    media: list[str] = field(default_factory=list)
    deliveries: int = 0
    saves: int = 0
    decisions: list[str] = field(default_factory=list)
    """Per transfer a holder sent (a pull it served, a push): its medium and why (`why_medium`)."""

    def score(self) -> float | None:
        """Fraction of the executors' answers whose first tokens are the documents' continuation."""
        graded = [c for c in self.calls if c.answer]
        if not graded:
            return None
        return sum(1 for c in graded if tuple(c.tokens[: len(c.answer)]) == c.answer) / len(graded)


@dataclass(frozen=True)
class Lengths:
    """Generated tokens per role."""

    plan: int = 24
    answer: int = 8
    verdict: int = 16


#: Each engine's kvbus block store and codec arena pool, sized for four engines on a 24 GiB
#: machine. With the defaults (1 GiB each) the full run's engine workers grew to 4.7-5.9 GB
#: each by its second round (a 2048-token SmolLM2 context is 94 MB in float32; vLLM's own KV
#: takes 1 GiB), the machine ran out of memory and the run stalled.
STORE_BYTES = 512 << 20
ARENA_POOL_MB = 256


def _engine(role: str, nats_url: str, log: Path) -> Any:
    from kvbus.app.models import model_folder
    from kvbus.integrations.vllm import connector_config
    from kvbus.integrations.vllm.process import EngineProcess

    return EngineProcess(
        env={"VLLM_CPU_OMP_THREADS_BIND": CPUS[role], "KVBUS_ARENA_POOL_MB": str(ARENA_POOL_MB)},
        log_path=str(log),
        model=str(model_folder()),
        dtype="float32",
        max_model_len=4096,
        enforce_eager=True,
        block_size=BLOCK,
        # On for arm (a); the other arms defeat it per request with a new cache_salt.
        enable_prefix_caching=True,
        max_num_seqs=2,
        disable_log_stats=False,
        kv_transfer_config=connector_config(
            agent_name(role),
            nats_url=nats_url,
            group=GROUP,
            model_name="SmolLM2-135M-Instruct",
            role=role,
            # A lookup waits for deliveries being stored (a push still landing): on 2 busy cores
            # that takes more than the default 1 s, and a lookup that times out is a prefill.
            lookup_timeout_s=10.0,
            store_bytes=STORE_BYTES,
        ),
    )


class Team:
    """The four engines, started together (`start`) and stopped together (`close`)."""

    def __init__(self, nats_url: str, logs: Path) -> None:
        self.engines = {role: _engine(role, nats_url, logs / f"{role}.log") for role in ROLES}
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvbus-agents")

    def start(self) -> None:
        """Launch every engine, then wait until all are up (they load side by side)."""
        for e in self.engines.values():
            e.launch()
        for e in self.engines.values():
            e.wait_ready()

    def close(self) -> None:
        """Stop every engine and its process."""
        self.pool.shutdown(wait=False)
        for e in self.engines.values():
            e.close()


def _seg(text: str) -> list[int]:
    return list(_tok(text))


def _await_push(ctl: Any, since: int, timeout: float = 30.0) -> None:
    """Wait until both executors stored the planner's push (or it failed): the hand-off itself."""
    planner = agent_name("planner")
    executors = {agent_name("executor-1"), agent_name("executor-2")}

    def done() -> bool:
        evs = ctl.events[since:]
        if any(e.agent == planner and e.kind == "push" and not e.ok for e in evs):
            return True
        return {e.agent for e in evs if e.kind == "receive" and e.peer == planner} >= executors

    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.02)


#: No connector event for this long after a workflow: its saves and deliveries are all in.
SETTLE_QUIET_S = 1.0


def settle(ctl: Any, quiet_s: float = SETTLE_QUIET_S, timeout: float = 15.0) -> int:
    """Wait until ``ctl`` has collected no new event for ``quiet_s`` (at most ``timeout``); how many
    it holds then. A connector publishes a save's or a delivery's event once it is stored, after
    the request that made it returned: counted without this wait, the last ones of a workflow
    were counted in the next (a text arm that "saved" one block)."""
    deadline = time.monotonic() + timeout
    seen, since = len(ctl.events), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = len(ctl.events)
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return seen


def run_workflow(team: Team, ctl: Any, arm: Arm, ds: DocSet, lengths: Lengths, label: str) -> Workflow:
    """One workflow of ``arm`` on ``ds``: ``len(ds.questions)`` turns of planner, executors, verifier."""
    salt_of_workflow = f"{label}-{uuid.uuid4().hex[:8]}"

    def salt() -> str:
        return salt_of_workflow if arm.prefix_cache else uuid.uuid4().hex

    def call(
        role: str,
        turn: int,
        handoff: str,
        prompt: list[int],
        max_tokens: int,
        push_to: list[str] | None = None,
        question: Question | None = None,
    ) -> Call:
        out = team.engines[role].generate(
            [prompt],
            max_tokens=max_tokens,
            kv_transfer_params=arm.params(push_to, tenant=salt_of_workflow),
            cache_salt=salt(),
        )[0]
        kv = (out.get("kv_transfer_params") or {}).get("kvbus") or {}
        return Call(
            role=role,
            turn=turn,
            handoff=handoff,
            prompt_len=len(prompt),
            tokens=list(out["token_ids"]),
            ttft_s=out["ttft"],
            cached_tokens=int(out["num_cached_tokens"]),
            loaded_tokens=int(kv.get("loaded_tokens") or 0),
            source=str(kv.get("source") or ""),
            declined_tokens=int(kv.get("declined_tokens") or 0),
            prompt_hash=hash(tuple(prompt)),
            answer=question.answer if question else (),
        )

    n_events = settle(ctl)  # the previous workflow's last events are its own
    wf = Workflow(arm=arm.name, offset=ds.offset, e2e_s=0.0)
    t0 = time.perf_counter()
    # The task number first: no block of one workflow's prompts is a block of another's.
    context = _seg(f"Task {ds.offset}. {SYSTEM}") + list(ds.docs)
    for turn, (q1, q2) in enumerate(ds.questions):
        planner_seg = _seg(f"\n\nPlanner (turn {turn + 1}): the plan for the two executors.\nPlan:")
        p = context + planner_seg
        n_plan = len(ctl.events)
        plan = call("planner", turn, "verifier" if turn else "", p, lengths.plan, push_to=["executor-1", "executor-2"])
        wf.calls.append(plan)
        if arm.handoff == "kvbus":
            _await_push(ctl, n_plan)
        shared = p + plan.tokens
        ex_prompts = []
        for i, q in ((1, q1), (2, q2)):
            ex_prompts.append(
                shared
                + _seg(f"\n\nExecutor {i}: continue this passage of the documents word for word:\n")
                + list(q.passage)
            )
        futures = [
            team.pool.submit(call, f"executor-{i}", turn, "planner", ex_prompts[i - 1], lengths.answer, None, q)
            for i, q in ((1, q1), (2, q2))
        ]
        e1, e2 = (f.result() for f in futures)
        wf.calls += [e1, e2]
        v = (
            ex_prompts[0]
            + e1.tokens
            + ex_prompts[1][len(shared) :]
            + e2.tokens
            + _seg(f"\n\nVerifier (turn {turn + 1}): are both continuations the documents' words?\nVerdict:")
        )
        verdict = call("verifier", turn, "executors", v, lengths.verdict)
        wf.calls.append(verdict)
        context = v + verdict.tokens
    wf.e2e_s = time.perf_counter() - t0
    settle(ctl)
    ours = {agent_name(r) for r in ROLES}
    for ev in ctl.events[n_events:]:
        if ev.kind == "save" and ev.agent in ours:
            wf.saves += 1
        if ev.kind == "receive" and ev.agent in ours:
            wf.nbytes += int(ev.nbytes)
            wf.deliveries += 1
            wf.media.append(ev.medium)
        if ev.kind in ("serve", "push") and ev.ok and ev.agent in ours:
            wf.decisions.append(f"{ev.medium}: {ev.reason}")
    return wf
