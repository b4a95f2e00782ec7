# SPDX-License-Identifier: BSD-3-Clause
"""Where the profiled steps' time went, from the trace.json that --profile N writes (any train_*.py script).

    python tools/profile_report.py runs/<run>/trace.json [--json]

One line: the share of the step time spent waiting for the next batch, the share with a gradient all-reduce in
flight (in any thread or CUDA stream; it may overlap compute), the host's reads of device values per step (`.item()`
and the like: on a GPU each one waits until the device has run everything queued before it), the CUDA runtime's own
synchronize calls per step (cudaDeviceSynchronize, cudaStreamSynchronize, cudaEventSynchronize: DDP's runtime
statistics make these on its steps 1-10 and every 100th), and the collectives
per step (DDP's all-reduces, FSDP's all-gathers and reduce-scatters: the c10d operators the trace holds, whatever the
backend; nothing is hooked into the training to count them). Only events that the host records count as steps and
reads: on CUDA the trace also holds the GPU-side copies of the steps. --json: the same figures as JSON.
"""

import json
import sys
from collections import Counter

SYNCS = {"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize"}


def figures(trace):
    """The trace's shares of the step time and its counts per profiled step (a dict, what --json prints)."""
    steps = 0
    step_us = 0.0
    data_us = 0.0  # waiting for the DataLoader
    reads = 0  # host reads of device values (.item() and the like)
    syncs = 0  # CUDA runtime synchronizations
    busy = []  # (start, end) of each all-reduce
    collectives = Counter()
    votes = [
        (event["tid"], event["ts"], event["ts"] + event["dur"])
        for event in trace["traceEvents"]
        if event.get("cat") == "user_annotation" and event.get("name") == "stop vote"
    ]
    for event in trace["traceEvents"]:
        name = event.get("name", "")
        category = event.get("cat")
        if category == "cpu_op" and any(
            tid == event["tid"] and start <= event["ts"] <= end for tid, start, end in votes
        ):
            continue  # the ranks' stop vote (dist_utils.StopOnSignal), a CPU all-reduce: counted apart
        if category == "user_annotation" and name.startswith("ProfilerStep#"):
            steps += 1
            step_us += event["dur"]
        elif category == "user_annotation" and name.startswith("enumerate(DataLoader)"):
            data_us += event["dur"]
        elif category == "cpu_op" and name == "aten::_local_scalar_dense":
            reads += 1
        elif category == "cuda_runtime" and name in SYNCS:
            syncs += 1
        elif category == "cpu_op" and name.startswith("c10d::"):  # c10d::allreduce_, c10d::_allgather_base_, ...
            collectives[name[6:].strip("_").removesuffix("_base")] += 1
        if "dur" in event and ("all_reduce" in name.lower() or "allreduce" in name.lower()):
            busy.append((event["ts"], event["ts"] + event["dur"]))
    communication_us = 0.0
    end = 0.0
    for start, stop in sorted(busy):  # the union of the intervals: wall time with an all-reduce in flight
        communication_us += max(0.0, stop - max(start, end))
        end = max(end, stop)
    step_us = max(step_us, 1e-9)
    per_step = max(steps, 1)
    return {
        "steps": steps,
        "data_wait_share": data_us / step_us,
        "communication_share": communication_us / step_us,
        "host_reads_per_step": reads / per_step,
        "cuda_syncs_per_step": syncs / per_step,
        "stop_votes_per_step": len(votes) / per_step,
        "collectives_per_step": {name: count / per_step for name, count in sorted(collectives.items())},
    }


def summary(trace):
    f = figures(trace)
    collectives = ", ".join(f"{count:g} {name}" for name, count in f["collectives_per_step"].items()) or "none"
    return (
        f"profile: {f['steps']} steps: waiting for data {100 * f['data_wait_share']:.1f}% of the step time, "
        f"communication {100 * f['communication_share']:.1f}% (may overlap compute; keep it under ~15%), "
        f"{f['host_reads_per_step']:.2f} host reads of device values (syncs) per step, "
        f"{f['cuda_syncs_per_step']:.2f} CUDA runtime syncs per step; collectives per step: {collectives}"
        + (f" (and {f['stop_votes_per_step']:g} stop vote, on the CPU)" if f["stop_votes_per_step"] else "")
    )


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[2:] not in ([], ["--json"]):
        sys.exit(f"usage: python {sys.argv[0]} TRACE_JSON [--json]")
    try:
        with open(sys.argv[1]) as f:
            trace = json.load(f)
    except (OSError, ValueError) as error:
        sys.exit(f"error: {sys.argv[1]}: not a readable trace ({error})")
    print(json.dumps(figures(trace)) if sys.argv[2:] else summary(trace))
