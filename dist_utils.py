# SPDX-License-Identifier: BSD-3-Clause
"""Helpers for the rungs that a launcher starts (DDP, AMP, FSDP), beside utils.py: the launcher's environment, elastic
restarts, the ranks' checks, stop vote and error exit, the run folder claimed for all ranks, the autocast dtype.
FSDP's own helpers are in fsdp_utils.py."""

import argparse
import contextlib
import datetime
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import utils
import guards
from guards import UsageError, first_line, load_checked


def require_launcher(launcher):
    """Ranks from a launcher, or filled in as torchrun would from an engine that starts each process itself: a Kubeflow
    pod's plain python (one process per pod) or SLURM's `srun python` (one task per process; docs/running.md).
    launcher: the script's, named in the line said without one: "torchrun", or "torch.distributed.launch" (its
    processes get --local-rank, and no ranks from srun)."""
    env = os.environ
    name = Path(sys.argv[0]).name
    launch = launcher == "torch.distributed.launch"
    if "RANK" in env and "LOCAL_RANK" not in env:  # a PyTorchJob's plain python: one process per pod
        if env.get("PET_NNODES", env["WORLD_SIZE"]) != env["WORLD_SIZE"]:  # nprocPerNode > 1: torchrun's to start
            raise UsageError(
                f"WORLD_SIZE {env['WORLD_SIZE']} for {env['PET_NNODES']} pods, but python starts one "
                f"process per pod: start the pod's command with torchrun (it reads PET_*)"
            )
        env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    elif "RANK" not in env and "SLURM_STEP_NUM_TASKS" in env and not launch:  # srun: a task per process
        # LOCAL_WORLD_SIZE: the first node's tasks; MASTER_ADDR: the step's first node, unless given
        host = re.match(r"([^,\[]*)(?:\[([^-,\]]*)[^\]]*\]([^,]*))?", env["SLURM_STEP_NODELIST"]).groups("")
        env.update(
            RANK=env["SLURM_PROCID"],
            WORLD_SIZE=env["SLURM_STEP_NUM_TASKS"],
            LOCAL_RANK=env["SLURM_LOCALID"],
            LOCAL_WORLD_SIZE=re.match(r"\d+", env["SLURM_STEP_TASKS_PER_NODE"])[0],
            MASTER_ADDR=env.get("MASTER_ADDR", "".join(host)),
            MASTER_PORT=env.get("MASTER_PORT", str(20000 + int(env["SLURM_JOB_ID"]) % 10000)),
        )
    if "RANK" not in env:
        command = "python -m torch.distributed.launch" if launch else "torchrun --standalone"
        modes = {
            "train_ddp_launch.py": "launch",
            "train_ddp_torchrun.py": "ddp",
            "train_ddp_amp.py": "amp",
            "train_fsdp.py": "fsdp",
        }
        # run.sh where it stands beside the script (not in a copy), for the script it knows (not a renamed one)
        beside = (Path(sys.argv[0]).resolve().parent / "run.sh").is_file()
        run_sh = f"bash run.sh {modes[name]} [N], or " if name in modes and beside else ""
        raise UsageError(
            f"start this script with a launcher, which runs one process per device: {run_sh}{command} "
            f"--nproc-per-node=N {name}"
        )
    # The launcher killed (kill -9, the OOM killer): SIGTERM, a stop that saves, instead of ranks that train on as
    # orphans into a folder whose job looks dead
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG, about the parent process


class Run(utils.Run):
    """utils.Run for the ranks of a job: global rank 0 claims the folder and every rank learns its outcome. With
    restarts=True: torchrun --max-restarts reruns the command after a failure, and the rerun continues this job's
    last.pt, in the same folder (named after the run id unless given)."""

    def __init__(self, args, script, metrics, restarts=False):
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        last = None  # this job's last.pt, read to learn that it is
        if restarts and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0:
            args, last = restarted(args, script, run_id)
        super().__init__(args, script, metrics, run_id)
        self.read = last  # read and checked once: load() takes it

    def claim(self):
        """utils.Run.claim() by global rank 0, its outcome told to every rank: a second job into the folder, or a
        folder that cannot be written, ends every rank alike, in one line from one of them."""
        outcome = [None, self.dir]  # (the error, the folder: a new one's name is rank 0's choice)
        try:
            super().claim()  # global rank 0 holds the folder; the others only note it
            outcome[1] = self.dir
        except UsageError as failure:
            outcome[0] = str(failure)
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0]:
            raise UsageError(outcome[0])
        if dist.get_rank() > 0:
            self.dir = guards.claim_output_dir(outcome[1])  # noted: rank 0's


def restarted(args, script, run_id):
    """The arguments of a job under torchrun --max-restarts, a copy: its folder, and --resume auto where its last.pt
    is this job's; and that last.pt, read, or None. Decided by the run id saved in last.pt, not
    TORCHELASTIC_RESTART_COUNT: each node's agent counts only its own failures. A job that was stopped (.stopped,
    written by StopOnSignal.exit) ends here at once."""
    output_dir = Path(args.output_dir or f"runs/{Path(script).stem}-{run_id}")
    stopped = output_dir / ".stopped"  # (a requeued SLURM job may have the run id of the stopped one)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0:
        with contextlib.suppress(OSError):  # (a folder that cannot be written: Run.claim says so)
            stopped.unlink(missing_ok=True)
    elif stopped.is_file() and stopped.read_text().split()[0] == run_id:
        sys.exit(128 + int(stopped.read_text().split()[1]))  # a stop of this job (said), taken for a failure
    last = output_dir / "last.pt"
    checkpoint = load_checked(last, "--resume") if last.exists() else None
    ours = checkpoint is not None and checkpoint.get("run_id") == run_id
    args = argparse.Namespace(
        **{**vars(args), "output_dir": str(output_dir), "resume": "auto" if ours else args.resume}
    )
    return args, checkpoint if ours else None


def restart_safe_store(timeout):
    """init_process_group's store under torchrun. The agent's store serves every attempt of a job, and a restarted
    group could read a dead attempt's keys and fail or hang. With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (run.sh sets
    it) each attempt gets a fresh store: None. Else a key prefix per restart: right on one node only, since each
    node's agent counts its own restarts."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # rank 0 will host the store (init_process_group)
        wait_for_master(timeout)
        return None
    if int(os.environ["GROUP_WORLD_SIZE"]) > 1 and int(os.environ["TORCHELASTIC_MAX_RESTARTS"]) > 0:
        raise UsageError(
            "restarts on several nodes need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's "
            "environment (run.sh sets it), or the restarted nodes may never meet again"
        )
    return dist.PrefixStore(
        f"restart{os.environ['TORCHELASTIC_RESTART_COUNT']}",
        dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout),
        ),
    )


def wait_for_master(timeout):
    """Where rank 0 hosts the store (plain python, srun, torchrun with a fresh store per attempt) the others wait for
    it; if it never answers, one line says why (init_process_group would end with dozens of C++ lines)."""
    address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    deadline = time.monotonic() + timeout
    while int(os.environ["RANK"]) > 0:
        try:
            return socket.create_connection(address, timeout=5).close()
        except OSError as error:  # not resolved, refused or unreachable yet: normal while rank 0 starts
            if time.monotonic() > deadline:
                raise UsageError(
                    f"rank {os.environ['RANK']} cannot reach MASTER_ADDR:MASTER_PORT {address[0]}:"
                    f"{address[1]} within --dist-timeout {timeout} s ({error.strerror or error}): check "
                    f"both, and that rank 0 (the master pod, the first task) runs"
                ) from None
            time.sleep(0.25)


@contextlib.contextmanager
def local_rank_0_first():
    """The block runs on local rank 0 first (a --weights download into the node's cache; torch.hub renames a whole
    download into place), then on the node's other ranks."""
    if int(os.environ.get("LOCAL_RANK", 0)) > 0:
        dist.barrier()
    yield
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        dist.barrier()


def same_on_every_rank(classes, train_set, val_set, resume_point):
    """Stop before training if the ranks do not see the same data or resume point (each node reads its own disk):
    they would train on mismatched samples, or hang on different numbers of steps."""
    if len(val_set) < dist.get_world_size():  # a rank with no validation image would wait in FSDP's evaluation
        raise UsageError(
            f"{len(val_set)} validation images for {dist.get_world_size()} processes: give each process "
            f"one at least (raise --val-fraction or add images)"
        )
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(
        gathered,
        dict(
            classes=classes, training_images=len(train_set), validation_images=len(val_set), resume_point=resume_point
        ),
    )
    for rank, seen in enumerate(gathered):
        for name, value in seen.items():
            if value != gathered[0][name]:
                raise UsageError(
                    f"rank {rank} sees {name} {str(value)[:60]}, rank 0 sees {str(gathered[0][name])[:60]}"
                    f": every node needs the same --data-path contents and --output-dir (a shared disk)"
                )


def mean_over_ranks(value):
    """The mean of a number (a 0-d tensor) over the ranks: the loss over the global batch, as one device computes it,
    where each rank's is over its share. One all-reduce (gloo has no AVG: a sum, divided)."""
    total = value.detach().float().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def check_replicas(model):
    """End the job in one line where the processes' weights have drifted apart, which DDP never does by itself: a
    parameter's requires_grad changed after the DDP(...) line (DDP then leaves its gradients unsynchronised), or
    code that differs by rank. One all-reduce of two figures per parameter (the sums of |w| and of w^2, sums with
    no cancellation, so another summation order moves them by rounding only)."""
    names, figures = [], []
    for name, parameter in model.named_parameters():
        weights = parameter.detach().float()
        names.append(name)
        figures += [weights.abs().sum(), weights.square().sum()]
    figures = torch.stack(figures)
    extremes = torch.cat([figures, -figures])  # their highest and lowest over the ranks, in one all-reduce
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    highest, lowest = extremes[: len(figures)], -extremes[len(figures) :]
    apart = sorted({i // 2 for i in (highest - lowest > 1e-5 * highest.abs()).nonzero().flatten().tolist()})
    if apart:
        raise UsageError(
            f"the processes' weights have drifted apart ({len(apart)} of {len(names)} parameters differ, the first "
            f"{names[apart[0]]}): a parameter's requires_grad changed after the DDP(...) line (say which parameters "
            f"train in set_trainable(), in the task block), or code that differs by rank changed the weights"
        )


PEER_GONE = re.compile(r"closed by peer|reset by peer|remote worker|broken pipe|communicator was aborted", re.I)
TIMED_OUT = re.compile(r"timed out|timeout", re.I)  # a DistError's (the store at start-up)
# gloo's (a wait, or a pair it closed when a coalesced broadcast timed out) and NCCL's: a RuntimeError
COLLECTIVE_TIMED_OUT = re.compile(
    r"Timed out waiting \d+ms for (send|recv)|Application timeout caused pair closure|"
    r"Watchdog caught collective operation timeout"
)


@contextlib.contextmanager
def one_line_errors(*every_rank_lines):
    """guards.one_line_errors() for the rungs that a launcher starts: a process of the job that ended, or did not
    answer within --dist-timeout, is one line too, not a traceback from every rank; so is DDP's unused parameter.
    The process group is destroyed on every exit, after the line."""
    try:
        with guards.one_line_errors(ddp_failure, *every_rank_lines):
            try:
                yield
            except Exception as error:
                # a loader worker of this process that was killed: its own line, not a peer's
                line = None if isinstance(error, UsageError) or guards.killed_worker(error) else peer_failure(error)
                if line is None:
                    raise
                print(line, file=sys.stderr)
                raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def ddp_failure(error):
    """The line for a failure of DDP's that every rank meets alike, or None."""
    text = str(error)
    if "Expected to have finished reduction in the prior iteration" in text:  # DDP: a parameter without a gradient
        unused = re.search(r"did not receive grad for rank \d+: ([^\n]+)", text)  # their indices, or names
        which = f" ({unused[1].strip()})" if unused else ""
        return (
            f"some parameters got no gradient in the last step{which}: the model holds a module that forward() "
            f"does not use; remove it, or pass find_unused_parameters=True in the DDP(...) line "
            f"(docs/troubleshooting.md)"
        )
    return None


def peer_failure(error):
    """The line for a failure that another process of the job caused, or None."""
    text = str(error).strip()
    if PEER_GONE.search(text):  # a consequence: the process that ended first says why
        return f"rank {os.environ.get('RANK', 0)} stops: another process of the job has ended ({first_line(error)})"
    if COLLECTIVE_TIMED_OUT.search(text) or (isinstance(error, dist.DistError) and TIMED_OUT.search(text)):
        # said by each rank that waited
        return (
            f"error: the other processes did not all answer within --dist-timeout ({first_line(error)}): one is "
            f"missing or stuck (a process that never started, a hung read, a stuck driver); start every process "
            f"(every node), or raise --dist-timeout"
        )
    return None


class StopOnSignal(utils.StopOnSignal):
    """utils.StopOnSignal for several ranks: they agree to stop after the same step, and save there. torchrun forwards
    a signal to every worker; SLURM and terminals reach every process of the job themselves; a signal that reaches
    one rank alone stops them all."""

    def __init__(self):
        super().__init__()
        # The vote is an all-reduce of a CPU tensor (gloo): reading a GPU's would wait for all the work queued on it
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def agreed(self):
        """The signal any rank has seen (0: none), by an all-reduce that every rank runs at the same points: before
        each micro-step and after the evaluation, so a job stops one step after the signal, however long a step
        takes."""
        seen = torch.tensor([self.seen[-1] if self.seen else 0])
        with torch.profiler.record_function("stop vote"):  # (--profile's report counts it apart from the training's)
            torch.distributed.all_reduce(seen, op=torch.distributed.ReduceOp.MAX, group=self.group)
        self.signum = int(seen.numpy()[0])  # (a CPU tensor: no device to wait for)
        return self.signum

    def exit(self, step, output_dir):
        """utils.StopOnSignal.exit. Under torchrun --max-restarts, a stop that only the ranks saw (not the launcher)
        looks to torchrun like a failure, and it would restart the job: the restarted ranks find .stopped and end
        at once (restarted()), so the stop stays one."""
        if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0 and int(os.environ.get("RANK", 0)) == 0:
            (Path(output_dir) / ".stopped").write_text(f"{os.environ['TORCHELASTIC_RUN_ID']} {self.signum}\n")
        return super().exit(step, output_dir)


def autocast_dtype(requested, device):
    """--amp-dtype as a torch dtype (default: bf16), refused where the device cannot compute it at speed. A CPU whose
    oneDNN has no bf16 kernels (x86 without AVX512, e.g. AVX2 only) runs bf16 autocast 10-30x slower than fp32."""
    if device.type == "cuda" and requested != "fp16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise UsageError("this GPU has no native bf16 support (emulated, it is slow); use --amp-dtype fp16")
    if device.type == "cpu" and requested == "fp16":
        raise UsageError("--amp-dtype fp16 needs a GPU; use --amp-dtype bf16 on the CPU")
    if device.type == "cpu" and not cpu_computes_bf16():
        slow = (
            "this CPU has no bf16 arithmetic (oneDNN has no bf16 kernels for it: x86 without AVX512): bf16 "
            "autocast runs 10-30x slower than fp32 here (docs/performance.md)"
        )
        if requested is None:
            raise UsageError(
                f"{slow}; train in fp32 with train_ddp_torchrun.py, or pass --amp-dtype bf16 to run anyway"
            )
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"warning: {slow}", flush=True)
    return torch.float16 if requested == "fp16" else torch.bfloat16


def cpu_computes_bf16():
    """Whether oneDNN has bf16 kernels for this CPU (AVX512 or AMX on x86, BF16 on ARM); ONEDNN_MAX_CPU_ISA counts."""
    with contextlib.suppress(Exception):  # a private op (torch 2.14): where it is missing, assume the CPU can
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return True
