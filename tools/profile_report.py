"""Where the profiled steps' time went, from the trace.json that --profile N writes (any train_*.py script).

    python tools/profile_report.py runs/<run>/trace.json

One line: the share of the step time spent waiting for the next batch, the share with a gradient all-reduce in
flight (in any thread or CUDA stream; it may overlap compute), and the host's reads of device values per step
(`.item()` and the like: on a GPU each one waits until the device has run everything queued before it). Only events
that the host records count as steps and reads: on CUDA the trace also holds the GPU-side copies of the steps.
"""
import json
import sys


def summary(trace):
    steps, step_us, data_us, reads, busy = 0, 0.0, 0.0, 0, []
    for event in trace["traceEvents"]:
        name, category = event.get("name", ""), event.get("cat")
        if category == "user_annotation" and name.startswith("ProfilerStep#"):
            steps, step_us = steps + 1, step_us + event["dur"]
        elif category == "user_annotation" and name.startswith("enumerate(DataLoader)"):
            data_us += event["dur"]
        elif category == "cpu_op" and name == "aten::_local_scalar_dense":
            reads += 1
        if "dur" in event and ("all_reduce" in name.lower() or "allreduce" in name.lower()):
            busy.append((event["ts"], event["ts"] + event["dur"]))
    communication_us, end = 0.0, 0.0
    for start, stop in sorted(busy):  # the union of the intervals: wall time with an all-reduce in flight
        communication_us += max(0.0, stop - max(start, end))
        end = max(end, stop)
    step_us = max(step_us, 1e-9)
    return (f"profile: {steps} steps: waiting for data {100 * data_us / step_us:.1f}% of the step time, "
            f"communication {100 * communication_us / step_us:.1f}% (may overlap compute; keep it under ~15%), "
            f"{reads / max(steps, 1):.2f} host reads of device values (syncs) per step")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {sys.argv[0]} TRACE_JSON")
    try:
        with open(sys.argv[1]) as f:
            trace = json.load(f)
    except (OSError, ValueError) as error:
        sys.exit(f"error: {sys.argv[1]}: not a readable trace ({error})")
    print(summary(trace))
