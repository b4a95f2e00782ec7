# SPDX-License-Identifier: BSD-3-Clause
"""Check this machine for multi-GPU training: bash run.sh doctor [--json PATH] [--nproc N] [--timeout S].

One line per check, `ok`, `warn`, `fail` or `skip`, with the fix where there is one; a summary line at the end.
Exit status 1 when a check fails (warnings alone give 0), 2 for bad arguments. The last check is a real all-reduce
between N processes on the backend the scripts use (nccl on GPUs, gloo on the CPU; N as in run.sh), reported like
nccl-tests: algbw = bytes / time, busbw = algbw * 2(N-1)/N. Its processes start first, so that they import torch
while the other checks run, and meet through a TCPStore on 127.0.0.1; every wait is bounded (--timeout).
Self-contained (standard library, torch, packaging): it must work when the rest of the project does not.
"""

import argparse
import contextlib
import errno
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30
MiB = 1 << 20
SHM_MIN = 1 * GiB  # Docker's default /dev/shm is 64 MiB; DataLoader workers pass every batch through it
DEFAULT_PORT = 29500  # what torchrun / torch.distributed.launch use without --standalone or --master-port
SLOW_NCCL_BUSBW = 5.0  # GB/s: below PCIe speed, NCCL is probably falling back to sockets
FORK_FIXED = {(3, 8): 20, (3, 9): 20, (3, 10): 15, (3, 11): 10}  # python/cpython#112275, September 2024


class Report:
    """The checks' results: a line each on stdout as it comes, all of them kept for --json."""

    def __init__(self):
        self.checks = []

    def add(self, name, status, message, fix=None, **data):
        self.checks.append({"name": name, "status": status, "message": message, "fix": fix, **data})
        print(f"{status:<6}{message}" + (f"; {fix}" if fix else ""), flush=True)

    def count(self, status):
        return sum(check["status"] == status for check in self.checks)


def human_bytes(n):
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def required(package, version):
    """("ok" or "warn", fix): the installed version against package's range in requirements.txt."""
    from packaging.requirements import InvalidRequirement, Requirement

    for line in (REPO / "requirements.txt").read_text().splitlines():
        try:
            requirement = Requirement(line.split("#")[0])
        except InvalidRequirement:  # comments, blank lines
            continue
        if requirement.name == package and not requirement.specifier.contains(version, prereleases=True):
            return "warn", f"outside requirements.txt ({requirement}): pip install -r requirements.txt"
    return "ok", None


# --------------------------------------------------------------------------------------------- the checks
def check_versions(report, torch):
    python = f"Python {platform.python_version()} ({sys.executable})"
    fixed = FORK_FIXED.get(sys.version_info[:2], 0)  # the first patch release without the deadlock
    if sys.version_info[2] < fixed:
        report.add(
            "python",
            "warn",
            f"{python} can deadlock a forked child (python/cpython#112275)",
            f"a DDP comm hook written in Python can then hang a loader worker at its fork: upgrade Python to "
            f"{sys.version_info[0]}.{sys.version_info[1]}.{fixed}+ or 3.12 (docs/robustness.md)",
            version=platform.python_version(),
        )
    else:
        report.add("python", "ok", python, version=platform.python_version())
    from torch.utils import collect_env  # what torch's own bug-report script reads: the build, cuDNN, the driver

    env = collect_env.get_env_info()
    build = (
        (f"CUDA build {env.cuda_compiled_version}" if torch.version.cuda else "CPU-only build")
        + (f", cuDNN {env.cudnn_version}" if torch.cuda.is_available() and env.cudnn_version else "")
        + (f", NVIDIA driver {env.nvidia_driver_version}" if env.nvidia_driver_version else "")
    )
    status, fix = required("torch", env.torch_version)
    if status == "ok" and not torch.version.cuda:
        status = "warn"
        fix = "this torch cannot use GPUs: install a CUDA build (https://pytorch.org/get-started)"
    report.add(
        "torch",
        status,
        f"torch {env.torch_version} ({build})",
        fix,
        version=env.torch_version,
        cuda_build=torch.version.cuda,
    )
    for package in ("torchvision", "tensorboard"):
        try:  # a torchvision built for another torch often fails right here
            module = __import__(package)
            version = metadata.version(package)
        except Exception as error:  # noqa: BLE001 (any import error is the finding)
            report.add(
                package,
                "fail",
                f"{package} does not import ({type(error).__name__}: {error})",
                "pip install -r requirements.txt",
            )
            continue
        status, fix = required(package, version)
        if package == "torchvision":
            try:  # its compiled operators: missing when torchvision and torch do not match
                module.ops.nms(torch.zeros(0, 4), torch.zeros(0), 0.5)
            except Exception as error:  # noqa: BLE001
                status = "fail"
                fix = (
                    f"its compiled operators do not load ({str(error).splitlines()[0][:80]}): "
                    f"reinstall torchvision for torch {torch.__version__}"
                )
        report.add(package, status, f"{package} {version}", fix, version=version)


def check_gpus(report, torch):
    """CUDA, the GPUs and NCCL; returns the number of GPUs torch can use."""
    import torch.distributed as dist

    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda and dist.is_nccl_available() else None
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if not torch.version.cuda:
            why = "CPU-only torch build"
        elif visible is not None and not visible.strip():
            why = "CUDA_VISIBLE_DEVICES is empty"
        else:
            why = "no NVIDIA GPU or driver found"
        report.add(
            "cuda",
            "warn",
            f"CUDA not available ({why}): training runs on the CPU with gloo; GPU checks skipped",
            available=False,
            reason=why,
        )
        report.add("gpus", "skip", "GPUs: none visible (skipped)", count=0, devices=[])
        report.add(
            "nccl", "skip", f"NCCL {nccl or '(not in this build)'}: not used without GPUs (skipped)", version=nccl
        )
        return 0
    report.add("cuda", "ok", f"CUDA available (torch built for CUDA {torch.version.cuda})", available=True)
    count = torch.cuda.device_count()
    arch_list = torch.cuda.get_arch_list()
    devices = []
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        devices.append(
            {
                "index": i,
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "total_bytes": total,
                "free_bytes": free,
            }
        )
    names = sorted({d["name"] for d in devices})
    status = "ok"
    fix = None
    if count == 1:
        status = "warn"
        fix = "multi-GPU modes will run one process; use a machine with 2+ GPUs or check CUDA_VISIBLE_DEVICES"
    elif len(names) > 1:
        status = "warn"
        fix = "DDP runs at the pace of the slowest GPU: pick one kind with CUDA_VISIBLE_DEVICES"
    report.add(
        "gpus",
        status,
        f"{count} GPU{'s' * (count > 1)} visible ({', '.join(names)})",
        fix,
        count=count,
        devices=devices,
    )
    for d in devices:
        status = "ok"
        fix = None
        used = d["total_bytes"] - d["free_bytes"]  # our context takes ~0.5 GiB
        if used > max(2 * GiB, 0.1 * d["total_bytes"]):
            status = "warn"
            fix = (
                f"{human_bytes(used)} in use by other processes (nvidia-smi): wait, or pick "
                f"another GPU with CUDA_VISIBLE_DEVICES"
            )
        major, minor = map(int, d["capability"].split("."))
        # kernels run on later minors of their major (sm_XY), PTX is compiled for any newer GPU (compute_XY)
        if (
            arch_list
            and not any(a == f"sm_{major}{m}" for a in arch_list for m in range(minor + 1))
            and not any(a.startswith("compute_") and int(a[8:].rstrip("af")) <= major * 10 + minor for a in arch_list)
        ):
            status = "warn"
            fix = (
                f"this torch has kernels for {' '.join(arch_list)} only: install a torch build "
                f"that supports compute {d['capability']}"
            )
        report.add(
            f"gpu{d['index']}",
            status,
            f"GPU {d['index']}: {d['name']}, {human_bytes(d['total_bytes'])} "
            f"({human_bytes(d['free_bytes'])} free), compute {d['capability']}",
            fix,
            **d,
        )
    if nccl is None:
        report.add(
            "nccl",
            "fail",
            "NCCL: not in this torch build",
            "install a CUDA build of torch with NCCL (the pip wheels from pytorch.org have it)",
            version=None,
        )
    else:
        report.add("nccl", "ok", f"NCCL {nccl}", version=nccl)
    return count


def check_backends(report, torch):
    import torch.distributed as dist

    if dist.is_available() and dist.is_gloo_available():
        report.add("gloo", "ok", "gloo available (the CPU backend)", available=True)
    else:
        report.add(
            "gloo",
            "fail",
            "gloo not available",
            "the CPU runs need torch.distributed with gloo: install the pytorch.org wheels",
            available=False,
        )
    capability = torch.backends.cpu.get_cpu_capability()
    native = True  # (dist_utils.cpu_computes_bf16's question, asked here: the doctor imports nothing of ours)
    with contextlib.suppress(Exception):  # a private op (torch 2.14): where it is missing, assume the CPU can
        native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if native:
        report.add(
            "bf16", "ok", f"CPU bf16: computed natively (oneDNN has bf16 kernels; ATen: {capability})", native=True
        )
    else:
        report.add(
            "bf16",
            "warn",
            f"CPU bf16: no bf16 arithmetic (ATen: {capability}; oneDNN has no bf16 kernels for this CPU)",
            "bf16 autocast runs 10-30x slower than fp32 here: on this CPU train in fp32 "
            "(bash run.sh ddp); train_ddp_amp.py refuses unless --amp-dtype bf16 is given",
            native=False,
        )


def check_environment(report, torch, count):
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    listed = [v for v in (visible or "").split(",") if v.strip()]
    status = "ok"
    fix = None
    if visible is not None and (not listed or listed[0].strip() == "-1") and torch.version.cuda:
        status = "warn"
        fix = "unset it (or list the GPUs to use) to train on GPUs"
    elif count and len(listed) != count and visible is not None:
        status = "warn"
        fix = (
            f"it lists {len(listed)} but {count} GPU(s) are visible: an entry is wrong (CUDA "
            f"stops at the first invalid one); see nvidia-smi -L"
        )
    if visible is None:
        message = "CUDA_VISIBLE_DEVICES not set: every GPU is visible"
    else:
        hides = " hides every GPU" if not listed or listed[0].strip() == "-1" else ""
        message = f"CUDA_VISIBLE_DEVICES={visible!r}{hides}"
    report.add("cuda_visible_devices", status, message, fix, value=visible)

    values = {
        k: v
        for k, v in sorted(os.environ.items())
        if k.startswith(("NCCL_", "TORCH_NCCL_")) or k in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
    }
    problems = [
        f"{key}={values[key]}: all-reduce can be much slower; unset it unless it works around a known hang"
        for key in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE")
        if values.get(key, "0").strip() not in ("", "0")
    ]
    problems += [
        f"{old} is the old name: PyTorch reads TORCH_{old}"
        for old in ("NCCL_BLOCKING_WAIT", "NCCL_ASYNC_ERROR_HANDLING", "NCCL_DESYNC_DEBUG")
        if old in values
    ]
    report.add(
        "nccl_env",
        "warn" if problems else "ok",
        "NCCL/socket variables: " + (" ".join(f"{k}={v}" for k, v in values.items()) or "none set (NCCL defaults)"),
        "; ".join(problems) or None,
        variables=values,
    )

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = os.environ.get("OMP_NUM_THREADS")
    too_many = threads is not None and not (threads.isdigit() and int(threads) <= cores)
    if threads:
        omp = f"OMP_NUM_THREADS={threads}"
    else:
        omp = "OMP_NUM_THREADS not set (run.sh / torchrun set it per process)"
    fix = None
    if too_many:
        fix = (
            f"more threads than cores slows every process: use at most cores/processes ({max(1, cores // 2)} for 2 "
            f"processes)"
        )
    report.add(
        "cpu",
        "warn" if too_many else "ok",
        f"{cores} CPU cores; {omp}",
        fix,
        cores=cores,
        omp_num_threads=threads,
    )


def check_engine(report):
    """The cluster engine this process runs under, from the variables each sets, and how to start the scripts there
    (docs/running.md#engines)."""
    env = os.environ.get
    status = "ok"
    fix = None
    if env("PET_RDZV_ENDPOINT"):  # training-operator's elasticPolicy
        engine = (
            f"Kubeflow PyTorchJob, elastic (c10d rendezvous at {env('PET_RDZV_ENDPOINT')}, PET_NNODES "
            f"{env('PET_NNODES')}, PET_MAX_RESTARTS {env('PET_MAX_RESTARTS', '0')}): start torchrun, which "
            f"reads PET_*"
        )
        if (
            env("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1"
            and env("PET_MAX_RESTARTS", "0") != "0"
            and env("PET_NNODES", "1").split(":")[-1] != "1"
        ):
            status = "fail"
            fix = (
                "restarts on several pods need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the "
                "scripts refuse without it): add it to the container's env (examples/)"
            )
    elif env("PET_MASTER_ADDR") or (env("MASTER_ADDR") and env("RANK") and env("KUBERNETES_SERVICE_HOST")):
        kind = "PyTorchJob" if env("MASTER_ADDR") else "TrainJob (v2)"  # a TrainJob sets PET_* only
        engine = (
            f"Kubeflow {kind} (master {env('PET_MASTER_ADDR') or env('MASTER_ADDR')}:"
            f"{env('PET_MASTER_PORT') or env('MASTER_PORT')}, PET_NNODES {env('PET_NNODES')}, "
            f"PET_NPROC_PER_NODE {env('PET_NPROC_PER_NODE')}): start torchrun, which reads PET_*"
            + ("; or plain python, one process per pod" if kind == "PyTorchJob" else "")
        )
    elif env("TORCHX_RANK0_HOST") or any(k.startswith("VC_") and k.endswith("_HOSTS") for k in os.environ):
        engine = (
            "TorchX (dist.ddp runs torchrun); a retry restarts the job from scratch unless the command has "
            "--resume auto and an --output-dir on a shared volume"
        )
    elif env("SLURM_STEP_NUM_TASKS"):
        engine = (
            f"SLURM job {env('SLURM_JOB_ID')}, srun task {env('SLURM_PROCID')} of "
            f"{env('SLURM_STEP_NUM_TASKS')} on {env('SLURM_STEP_NODELIST')}: `srun python` needs no launcher "
            f"(the scripts read SLURM_*); `srun bash run.sh` runs torchrun, one task per node"
        )
    elif env("SLURM_JOB_ID"):
        engine = f"SLURM job {env('SLURM_JOB_ID')}, outside a job step: start the processes with srun"
    elif env("KUBERNETES_SERVICE_HOST"):
        engine = "a Kubernetes pod without Kubeflow's or TorchX's variables: run torchrun or run.sh in it"
    else:
        engine = "none found (no PET_*, SLURM_* or KUBERNETES_SERVICE_HOST): run.sh or a launcher on each machine"
    report.add("engine", status, f"engine: {engine}", fix)


def check_shm(report):
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return report.add("shm", "skip", "/dev/shm: not present on this system (skipped)", total_bytes=None)
    total = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    fix = None
    if total < SHM_MIN:
        fix = (
            "DataLoader workers may run out of shared memory: in Kubernetes mount an emptyDir with medium: Memory at "
            "/dev/shm (examples/), docker run --ipc=host or --shm-size=8g (or train with fewer --workers)"
        )
    elif free < SHM_MIN:
        fix = "nearly full: DataLoader workers may crash; remove stale files there (leftovers of killed runs)"
    report.add(
        "shm",
        "warn" if fix else "ok",
        f"/dev/shm {human_bytes(total)} ({human_bytes(free)} free)",
        fix,
        total_bytes=total,
        free_bytes=free,
    )


def check_network(report):
    """With MASTER_ADDR set (several machines): the address and interface this node meets the others from (what
    run.sh derives from MASTER_ADDR), and whether the hostname, which torchrun and gloo rely on where they are not
    told otherwise, resolves to an address the others can reach."""
    master_addr = os.environ.get("MASTER_ADDR")
    if not master_addr:
        return
    sys.path.insert(0, str(Path(__file__).parent))
    import hosts  # tools/hosts.py: what run.sh uses

    try:
        plan = hosts.Plan(master_addr)
    except OSError as error:
        return report.add("network", "fail", str(error), "without it the nodes cannot meet")
    uses = f"--local-addr={plan.local_addr}" + "".join(
        f" {name}={plan.interface}" for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if plan.interface
    )
    named = f"MASTER_ADDR {master_addr}" + (f" ({plan.target})" if plan.target != master_addr else "")
    fix = None
    if plan.loopback_name:
        fix = (
            f"{master_addr} resolves to {plan.target}, a loopback address, here: give MASTER_ADDR as the address the "
            f"other nodes reach this one at, or set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME"
        )
    if plan.is_host:
        message = f"{named} is this machine: it hosts the rendezvous (run.sh: {uses})"
    else:
        message = f"{named} is another machine; this node reaches it from {plan.where()} (run.sh: {uses})"
    report.add(
        "network",
        "warn" if fix else "ok",
        message,
        fix,
        master_addr=master_addr,
        is_host=plan.is_host,
        local_addr=plan.local_addr,
        interface=plan.interface,
    )

    name = socket.gethostname()
    breaks = (
        "torchrun alone then neither sees whether this node hosts the rendezvous nor gives the others an "
        "address they reach, and gloo and NCCL listen there: run.sh sets is_host, --local-addr, "
        "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME from MASTER_ADDR; by hand, set them too, or map "
        f"{name} to {plan.local_addr} in /etc/hosts"
    )
    try:
        addresses = hosts.resolve(name)
    except OSError as error:
        return report.add(
            "hostname",
            "warn",
            f"hostname {name} does not resolve ({error.strerror or error})",
            breaks,
            hostname=name,
            addresses=[],
        )
    said = f"hostname {name} resolves to {', '.join(addresses)}"
    held = [a for a in addresses if hosts.holds(a)]  # the addresses among them that this machine holds
    if hosts.is_loopback(plan.local_addr) and not plan.loopback_name:
        status = "ok"
        message = f"{said} (MASTER_ADDR is loopback: one machine)"
        fix = None
    elif plan.local_addr in held:
        status = "ok"
        message = f"{said}, the address this node uses"
        fix = None
    else:
        if held and all(map(hosts.is_loopback, held)):
            where = "a loopback address"
        elif held:
            where = f"not to the address that reaches MASTER_ADDR ({plan.where()})"
        else:
            where = "which this machine does not hold"
        status = "warn"
        message = f"{said}, {where}: other machines cannot connect there"
        fix = breaks
    report.add("hostname", status, message, fix, hostname=name, addresses=addresses)


def bind_error(host, port):
    """The OSError binding (host, port) raises (IPv4, and IPv6 for any host), or None if the port is free there."""
    for family, address in [(socket.AF_INET, host or "0.0.0.0")] + [(socket.AF_INET6, "::")] * (not host):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore: TIME_WAIT is no obstacle
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((address, port))
            except OSError as error:
                if not (family == socket.AF_INET6 and error.errno == errno.EADDRNOTAVAIL):  # no IPv6 here
                    return error
    return None


def check_port(report):
    addr = os.environ.get("MASTER_ADDR")
    text = os.environ.get("MASTER_PORT")
    if text is None:
        message = "MASTER_PORT not set: torchrun --standalone (bash run.sh ddp) picks a free port"
        if bind_error("", DEFAULT_PORT):
            return report.add(
                "port",
                "warn",
                message + f"; the default {DEFAULT_PORT} is in use",
                "launches without --standalone need another port: MASTER_PORT=29501 or --master-port",
                port=None,
            )
        return report.add("port", "ok", message + f" (the default {DEFAULT_PORT} is free too)", port=None)
    if not text.isdigit() or not 0 < int(text) < 65536:
        return report.add(
            "port",
            "fail",
            f"MASTER_PORT={text!r} is not a port number",
            "set MASTER_PORT to a free port between 1024 and 65535, e.g. 29500",
            port=text,
        )
    port = int(text)
    if addr and addr not in ("localhost", "127.0.0.1", "::1"):
        try:
            address = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][4][0]
        except OSError as error:
            return report.add(
                "port",
                "fail",
                f"MASTER_ADDR={addr} does not resolve ({error.strerror or error})",
                "set MASTER_ADDR to the IP address (or resolvable name) of node 0",
                port=port,
            )
        if getattr(bind_error(address, 0), "errno", None) == errno.EADDRNOTAVAIL:  # another machine's address
            status = "ok"
            fix = None
            try:
                socket.create_connection((addr, port), timeout=2).close()
                note = "something is listening there already (node 0's rendezvous?)"
            except ConnectionRefusedError:
                note = "nothing listens there yet (normal before node 0 starts)"
            except TimeoutError:
                note = "no answer within 2 s"
                status = "warn"
                fix = "a firewall may block it: open the port on node 0, or check MASTER_ADDR"
            except OSError as error:
                note = f"{error.strerror or error}"
                status = "warn"
                fix = "check MASTER_ADDR: no machine answers"
            return report.add(
                "port",
                status,
                f"MASTER_ADDR={addr} is another machine; MASTER_PORT {port} there: {note}",
                fix,
                port=port,
                local=False,
            )
    error = bind_error("", port)
    if error is None:
        report.add("port", "ok", f"MASTER_PORT {port} is free", port=port, local=True)
    elif error.errno == errno.EACCES:
        report.add(
            "port",
            "fail",
            f"MASTER_PORT {port} needs root to listen on",
            "choose a port of 1024 or more, e.g. MASTER_PORT=29500",
            port=port,
            local=True,
        )
    else:
        report.add(
            "port",
            "fail",
            f"MASTER_PORT {port} is already in use on this machine ({error.strerror})",
            f"choose another (e.g. MASTER_PORT={port + 1 if port < 65535 else 29500}) or stop what holds it "
            f"(ss -ltnp 'sport = :{port}'; often a stale torchrun)",
            port=port,
            local=True,
        )


# ------------------------------------------------------------------------------------------- the all-reduce
def start_allreduce(backend, nproc, size_mib, timeout, workdir):
    """Hold a TCPStore on 127.0.0.1 (port chosen by the OS: no race for a free one) and start nproc processes."""
    import torch.distributed as dist
    import torch.multiprocessing

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)
    result = os.path.join(workdir, "allreduce.json")
    processes = torch.multiprocessing.start_processes(
        allreduce_worker,
        (nproc, store.port, backend, size_mib, timeout, result),
        nprocs=nproc,
        join=False,
        start_method="spawn",
    )
    return {
        "store": store,
        "processes": processes,
        "backend": backend,
        "nproc": nproc,
        "result": result,
        "deadline": time.monotonic() + timeout + 30,  # + 30 s to import torch
        "timeout": timeout,
    }


def finish_allreduce(report, job):
    from torch.multiprocessing.spawn import ProcessException

    backend = job["backend"]
    nproc = job["nproc"]
    what = f"all-reduce {backend}, {nproc} process{'es' if nproc > 1 else ''}"
    fix = (
        "if it is the network: GLOO_SOCKET_IFNAME=lo (gloo) or NCCL_SOCKET_IFNAME=lo, and check that `hostname -i` "
        "gives a local address"
    ) + ("; NCCL_DEBUG=INFO shows what NCCL tried" if backend == "nccl" else "")
    try:  # all succeed, one fails (the context then ends the others), or the deadline passes
        while not job["processes"].join(timeout=max(0.0, job["deadline"] - time.monotonic())):
            if time.monotonic() >= job["deadline"]:
                for process in job["processes"].processes:
                    process.kill()
                return report.add(
                    "allreduce",
                    "fail",
                    f"{what}: no result within {job['timeout'] + 30} s (killed)",
                    fix,
                    backend=backend,
                    world_size=nproc,
                )
    except ProcessException as error:  # its message ends with the rank's exception
        last = str(error).strip().splitlines()[-1]
        return report.add(
            "allreduce",
            "fail",
            f"{what}: rank {error.error_index} failed: {last[:200]}",
            fix,
            backend=backend,
            world_size=nproc,
            error=last,
        )
    result = json.loads(Path(job["result"]).read_text())
    slow = backend == "nccl" and nproc > 1 and result["busbw_gbps"] < SLOW_NCCL_BUSBW
    fix = None
    if slow:
        fix = (
            f"slower than PCIe ({SLOW_NCCL_BUSBW:g} GB/s): check NCCL_P2P_DISABLE / NCCL_SHM_DISABLE, nvidia-smi "
            f"topo -m, and NCCL_DEBUG=INFO"
        )
    report.add(
        "allreduce",
        "warn" if slow else "ok",
        f"{what}: latency {result['latency_us']:.0f} us "
        f"({result['small_bytes']} B), busbw {result['busbw_gbps']:.2f} GB/s (algbw {result['algbw_gbps']:.2f} "
        f"GB/s, {human_bytes(result['size_bytes'])})" + (": one process, nothing crosses a link" * (nproc == 1)),
        fix,
        **result,
    )


def allreduce_worker(rank, world_size, port, backend, size_mib, timeout, result):
    """One rank of the all-reduce check; rank 0 writes the results as JSON to `result`."""
    for fd in (1, 2):  # the report's lines only: gloo's and NCCL's own logging goes nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout)
    gpu = backend == "nccl"
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        store=dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        **({"device_id": device} if gpu else {}),
    )
    sync = torch.cuda.synchronize if gpu else (lambda: None)  # gloo's CPU all_reduce returns when it is done

    def timed(tensor, warmup, iterations):
        """Seconds of an all-reduce of tensor: the median of single calls, as nccl-tests reports one size."""
        for _ in range(warmup):
            dist.all_reduce(tensor)
        sync()
        dist.barrier()
        times = []
        for _ in range(iterations):
            start = time.perf_counter()
            dist.all_reduce(tensor)
            sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    check = torch.full((1024,), float(rank + 1), device=device)  # correctness first: 1 + 2 + ... + world_size
    dist.all_reduce(check)
    if not torch.all(check == world_size * (world_size + 1) / 2):
        raise RuntimeError(f"all-reduce gave {check[0].item()}, expected {world_size * (world_size + 1) / 2}")
    small = torch.zeros(2, device=device)  # 8 B, as nccl-tests: the latency
    big = torch.zeros(size_mib * MiB // 4, device=device)  # --size MiB: the bandwidth
    worst = torch.tensor(
        [timed(small, 10, 200 if gpu else 50), timed(big, 3 if gpu else 1, 20 if gpu else 5)],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the slowest rank decides
    latency, seconds = worst.tolist()
    dist.destroy_process_group()
    if rank == 0:
        algbw = big.numel() * 4 / seconds / 1e9
        Path(result).write_text(
            json.dumps(
                {
                    "backend": backend,
                    "world_size": world_size,
                    "small_bytes": small.numel() * 4,
                    "latency_us": latency * 1e6,
                    "size_bytes": big.numel() * 4,
                    "seconds": seconds,
                    "algbw_gbps": algbw,
                    "busbw_gbps": algbw * 2 * (world_size - 1) / world_size,
                }
            )
        )


# ------------------------------------------------------------------------------------------------- main
def main(argv=None):
    parser = argparse.ArgumentParser(prog="bash run.sh doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument(
        "--nproc",
        type=int,
        help="processes for the all-reduce (default: as run.sh: the visible GPUs, or 2 on a CPU-only machine)",
    )
    parser.add_argument("--size", type=int, default=64, metavar="MIB", help="all-reduce size for the bandwidth")
    parser.add_argument(
        "--timeout",
        type=int,
        default=30,
        metavar="S",
        help="process-group timeout of the all-reduce check (it is killed after S + 30 s)",
    )
    parser.add_argument("--no-allreduce", action="store_true", help="skip the all-reduce check (saves several seconds)")
    args = parser.parse_args(argv)
    if args.nproc is not None and args.nproc < 1 or args.size < 1 or args.timeout < 1:
        parser.error("--nproc, --size and --timeout must be positive")
    started = time.monotonic()
    report = Report()
    try:
        import torch
        import torch.distributed as dist
    except Exception as error:  # noqa: BLE001 (a broken install is the finding)
        report.add(
            "torch",
            "fail",
            f"torch does not import ({type(error).__name__}: {error})",
            "pip install -r requirements.txt (or let bash run.sh make .venv)",
        )
        return finish(report, args, started)
    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    backend = "nccl" if available else "gloo"
    nproc = args.nproc or (count if available else 2)
    usable = dist.is_available() and (dist.is_nccl_available() if available else dist.is_gloo_available())
    job = None
    with tempfile.TemporaryDirectory(prefix="doctor-") as workdir:
        if not args.no_allreduce and usable and not (available and nproc > count):
            job = start_allreduce(backend, nproc, args.size, args.timeout, workdir)  # runs meanwhile
        try:
            for check, *check_args in (
                (check_versions, torch),
                (check_gpus, torch),
                (check_backends, torch),
                (check_environment, torch, count),
                (check_engine,),
                (check_shm,),
                (check_network,),
                (check_port,),
            ):
                try:
                    check(report, *check_args)
                except Exception as error:  # noqa: BLE001 (a doctor that crashes tells nobody anything)
                    name = check.__name__.removeprefix("check_")
                    report.add(
                        name,
                        "fail",
                        f"the {name} check itself failed ({type(error).__name__}: {error})",
                        "please report this with the output of bash run.sh doctor",
                    )
        finally:
            if job:
                finish_allreduce(report, job)
    if args.no_allreduce:
        report.add("allreduce", "skip", "all-reduce: skipped (--no-allreduce)")
    elif not job and not usable:
        report.add(
            "allreduce",
            "fail",
            f"all-reduce: the {backend} backend is not available",
            "install the pytorch.org wheels",
            backend=backend,
        )
    elif not job:
        report.add(
            "allreduce",
            "fail",
            f"all-reduce: --nproc {nproc} but {count} GPU(s) visible",
            "use one process per GPU",
            backend=backend,
        )
    return finish(report, args, started)


def finish(report, args, started):
    counts = {s: report.count(s) for s in ("ok", "warn", "fail", "skip")}
    seconds = time.monotonic() - started
    if counts["fail"]:
        verdict = f"{counts['fail']} check(s) failed: fix them before training"
    else:
        verdict = "ready" + (" (with warnings)" if counts["warn"] else "")
    print(
        f"doctor: {counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail, {counts['skip']} skipped "
        f"in {seconds:.1f} s: {verdict}",
        flush=True,
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "checks": report.checks,
                    "summary": counts,
                    "exit_status": int(bool(counts["fail"])),
                    "seconds": seconds,
                },
                indent=1,
            )
            + "\n"
        )
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
