"""Two vLLM engines, in two processes, share a context through kvbus.

A planner and an executor each run SmolLM2-135M-Instruct in vLLM (CPU) with the kvbus KV
connector; both are kvbus agents of one group, whose scheduler grants every transfer and picks
its medium. The planner reads a long document and a task; as it prefills, its connector pushes
the document's KV to the executor (``kv_transfer_params: {"kvbus_push_to": ["executor"]}``), so
the executor's request on the same document starts from that KV instead of prefilling it. A
second question arrives at the executor without a push: its connector finds the planner in the
prefix index and pulls the prefix.

    python examples/vllm_two_agents.py                      # embedded nats-server and scheduler
    python examples/vllm_two_agents.py --nats-url nats://127.0.0.1:4222   # a running `kvbus up`

Needs the ``[vllm]`` extra (see the README). Takes 2-3 minutes on 2 cores, mostly engine start-up.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "kvbus" / "data" / "calibration_harbour.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nats-url", default=None, help="NATS of a running kvbus (default: start one here)")
    parser.add_argument("--group", default="default", help="the agents' group (its scheduler must run)")
    parser.add_argument("--tokens", type=int, default=24, help="tokens each engine generates")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from kvbus.app.local import NatsServer
    from kvbus.app.models import model_folder
    from kvbus.group_scheduler import GroupScheduler
    from kvbus.integrations.vllm import connector_config
    from kvbus.integrations.vllm.loop import LoopThread
    from kvbus.integrations.vllm.process import EngineProcess

    folder = str(model_folder("smollm2"))  # what `kvbus model-path smollm2` prints
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    server = None if args.nats_url else NatsServer().start()
    url = args.nats_url or server.url  # type: ignore[union-attr]
    loop = LoopThread()
    sched = None if args.nats_url else loop.run(GroupScheduler.connect(url, args.group), timeout=30)

    def engine(agent: str, role: str, cpu: str) -> EngineProcess:
        return EngineProcess(
            env={"VLLM_CPU_OMP_THREADS_BIND": cpu},
            log_path=f"/tmp/kvbus-example-{agent}.log",
            model=folder,
            dtype="float32",
            max_model_len=4096,
            enforce_eager=True,
            block_size=32,
            # vLLM's own prefix cache off, so that the last comparison (the same prompt prefilled
            # by the executor) is not served from it; kvbus works with it on as well.
            enable_prefix_caching=False,
            disable_log_stats=False,
            kv_transfer_config=connector_config(
                agent, nats_url=url, group=args.group, role=role, model_name="SmolLM2-135M-Instruct"
            ),
        )

    document = DOC.read_text()
    planner, executor = engine("planner", "coordinator", "0"), engine("executor", "executor", "1")
    try:
        t0 = time.perf_counter()
        planner.launch()
        executor.launch()
        planner.wait_ready()
        executor.wait_ready()
        print(f"two engines up in {time.perf_counter() - t0:.0f} s (logs: /tmp/kvbus-example-*.log)")

        def ids(question: str) -> list[int]:
            return list(tok(document + "\n\n" + question)["input_ids"])

        plan_prompt = ids("Task: list the three main steps of the harbour project.\nPlan:")
        plan = planner.generate(
            [plan_prompt], max_tokens=args.tokens, kv_transfer_params={"kvbus_push_to": ["executor"]}
        )[0]
        print(f"\nplanner ({len(plan_prompt)} prompt tokens, TTFT {plan['ttft']:.2f} s): {plan['text']!r}")
        print(f"  pushed its context to: {plan['kv_transfer_params']['kvbus']['pushed_to']}")
        time.sleep(1.0)  # the push runs in the background while the planner answers

        step = ids("Task: carry out step 1 of the plan.\nResult:")
        done = executor.generate([step], max_tokens=args.tokens)[0]
        kv = done["kv_transfer_params"]["kvbus"]
        print(
            f"\nexecutor, pushed context ({len(step)} prompt tokens): {done['num_cached_tokens']} tokens from kvbus "
            f"({kv['source']}), TTFT {done['ttft']:.2f} s: {done['text']!r}"
        )

        # A question on a prompt the executor has never seen: it pulls the planner's prefix.
        question = list(tok("Summary of the harbour text.\n" + document + "\n\nQuestion: who pays?")["input_ids"])
        planner.generate([question], max_tokens=1)
        time.sleep(0.5)
        answer = executor.generate([question], max_tokens=args.tokens)[0]
        kv = answer["kv_transfer_params"]["kvbus"]
        print(
            f"\nexecutor, pulled prefix ({len(question)} prompt tokens): {answer['num_cached_tokens']} tokens from "
            f"{kv['source']}, TTFT {answer['ttft']:.2f} s: {answer['text']!r}"
        )
        alone = executor.generate([question], max_tokens=1, kv_transfer_params={"kvbus_skip": True})[0]
        print(f"  the same prompt prefilled by the executor itself: TTFT {alone['ttft']:.2f} s")
    finally:
        planner.close()
        executor.close()
        if sched is not None:
            loop.run(sched.close(), timeout=10)
        loop.stop()
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
