#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# bash run.sh MODE [N] [script arguments...]   (bash run.sh help for the modes)
set -euo pipefail
cd "$(dirname "$0")"

usage() {
  cat <<'TXT'
usage: bash run.sh MODE [N] [script arguments...]
  single          train_single.py on one device
  dp              train_dp.py: nn.DataParallel over all visible GPUs
  launch [N]      train_ddp_launch.py under python -m torch.distributed.launch, N processes
  ddp [N]         train_ddp_torchrun.py under torchrun, N processes per node
  amp [N]         train_ddp_amp.py (mixed precision) under torchrun, N processes per node
  fsdp [N]        train_fsdp.py (sharded model, FSDP2) under torchrun, N processes per node
  bench [N]       throughput benchmark (tools/bench.py; --quick for a short run)
  copy RUNG DEST  a script and exactly the helpers it needs into DEST, your project (tools/copy_rung.py)
  shrink SRC DST  a copy of a dataset with each image's longer side at most 512 px (--max-side N; tools/shrink.py)
  doctor          check this machine for multi-GPU training (tools/doctor.py)
  gpucheck        on a GPU machine: doctor, tests/gpu/test_gpu.py and the GPU bench rows, one report (tools/gpucheck.py)
  site            the ladder's pages into site/, pictures from 5 CPU runs (--no-runs, --check, --out DIR; tools/site.py)
  test [quick]    the test suite (pytest); quick: only the headline proofs, in a few minutes
N defaults to the number of visible GPUs, or 2 on a CPU-only machine; on one machine, N above the visible GPUs
trains the N processes on the CPU.
Environment: TORCHRUN_ARGS (extra launcher options); multi-node: NNODES, MASTER_ADDR, MASTER_PORT (29500),
NODE_RANK (0 on the first node: checks the port), RDZV_TIMEOUT (300 s), RDZV_ID, GLOO_SOCKET_IFNAME and
NCCL_SOCKET_IFNAME (derived from MASTER_ADDR unless set); PYTHON.
TXT
}

# SIGUSR1, SLURM's warning before a job's time is up (sbatch --signal=USR1@N), reaches every process of the step:
# ignored here and by what run.sh starts (the launcher, whose default would be to die), noted by the ranks, which
# stop and save on it as on SIGTERM
trap '' USR1
mode=${1:-}
case "$mode" in
  single|dp|launch|ddp|amp|fsdp|bench|copy|shrink|doctor|gpucheck|site|test) shift ;;
  -h|--help|help) usage; exit 0 ;;
  *) usage >&2; exit 2 ;;
esac

# Python: the current one if it has what we need, else .venv (made from requirements.txt on first use).
needs="torch torchvision tensorboard"
case "$mode" in test) needs="$needs pytest xdist pytest_timeout" ;; gpucheck) needs="$needs pytest" ;; esac
has_modules() {
  "$1" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" $needs \
    2>/dev/null
}
PYTHON=${PYTHON:-python3}
if ! has_modules "$PYTHON"; then
  if ! { [ -x .venv/bin/python ] && has_modules .venv/bin/python; }; then
    echo "run.sh: $needs not all importable by $PYTHON: installing requirements.txt into .venv" >&2
    python3 -m venv .venv
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
  fi
  PYTHON=.venv/bin/python
fi
# The site's browser test drives Debian's chromium with Playwright (requirements-site.txt), installed into .venv only:
# with your own Python, that test is skipped and says how to install it.
if [ "$mode" = test ] && [ "$PYTHON" = .venv/bin/python ] && ! "$PYTHON" -c "import playwright" 2>/dev/null; then
  echo "run.sh: installing requirements-site.txt (Playwright, for the site's browser test) into .venv" >&2
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-site.txt
fi

need() {  # one line where run.sh was copied into a project without its tools/
  [ -f "$1" ] || { echo "run.sh: $1 is missing: copy the tools/ folder beside run.sh" >&2; exit 2; }
}
case "$mode" in
  single) exec "$PYTHON" train_single.py "$@" ;;
  dp) exec "$PYTHON" train_dp.py "$@" ;;
  copy) need tools/copy_rung.py; exec "$PYTHON" tools/copy_rung.py "$@" ;;
  shrink) need tools/shrink.py; exec "$PYTHON" tools/shrink.py "$@" ;;
  doctor) need tools/doctor.py; exec "$PYTHON" tools/doctor.py "$@" ;;
  gpucheck) need tools/gpucheck.py; exec "$PYTHON" tools/gpucheck.py "$@" ;;
  site) need tools/site.py; exec "$PYTHON" tools/site.py "$@" ;;
  test)  # every proof; `test quick`: the headline ones (tests marked quick). Either way the slowest tests are listed,
    # and why each skipped test did not run.
    # pytest-xdist: a worker per two cores (each test starts 2-3 processes), two at least; a worker that runs out of
    # tests takes some of another's (worksteal), so none is left to run alone at the end. A test past --timeout fails
    # with its stack (pytest-timeout). A passed test's folder goes when it ends (a full run writes ~20 GB of
    # checkpoints, and pytest keeps the last 3 runs').
    if [ "${1:-}" = quick ]; then shift; set -- -m quick "$@"; fi
    workers=$(( $(nproc) / 2 > 2 ? $(nproc) / 2 : 2 ))
    exec "$PYTHON" -m pytest -q -n "$workers" --dist worksteal --timeout 900 -rs --durations=15 \
      -o tmp_path_retention_policy=failed tests "$@" ;;
esac

# Multi-process modes: N, the GPU check and the threads per process.
if [ -n "${CUDA_VISIBLE_DEVICES+set}" ] && [ -z "$CUDA_VISIBLE_DEVICES" ]; then
  gpus=0  # every GPU hidden: no need to import torch (2-3 s) to count none
else
  # GPUs with a backend between processes (CUDA, ROCm, XPU; Apple's MPS has none: a Mac counts as CPU-only here)
  gpus=$("$PYTHON" -c "import torch; found = torch.accelerator.current_accelerator(check_available=True)
print(torch.accelerator.device_count() if found is not None and found.type != 'mps' else 0)")
fi
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then nproc=$1; shift; else nproc=$(( gpus > 0 ? gpus : 2 )); fi
if [ "$nproc" -lt 1 ]; then echo "run.sh: N must be at least 1" >&2; exit 2; fi
if [ "$gpus" -gt 0 ] && [ "$nproc" -gt "$gpus" ]; then
  if [ "$mode" = bench ] || [ "${NNODES:-1}" -gt 1 ]; then  # a measurement, or a cluster misconfigured
    echo "run.sh: $nproc processes but only $gpus visible GPU(s): use N <= $gpus (one process per GPU)" >&2
    exit 2
  fi
  # One machine: N processes on the CPU give the global batch and the results of N GPUs, so the first command
  # shows N processes cooperating wherever it runs.
  if [ "$gpus" -gt 1 ]; then plural=s; else plural=; fi
  echo "run.sh: $nproc processes but $gpus visible GPU$plural: training on the CPU (gloo); use N <= $gpus to train" \
       "on the GPU$plural" >&2
  export CUDA_VISIBLE_DEVICES=
  gpus=0
fi
if [ "$gpus" -eq 0 ] && [ -z "${OMP_NUM_THREADS:-}" ]; then
  cores=$(nproc)
  export OMP_NUM_THREADS=$(( cores / nproc > 0 ? cores / nproc : 1 ))  # the processes share the cores
fi

if [ "$mode" = bench ]; then need tools/bench.py; exec "$PYTHON" tools/bench.py --nproc "$nproc" "$@"; fi

# Single node: --standalone picks a free port. Multi-node: NNODES>1 and MASTER_ADDR:MASTER_PORT of node 0.
read -r -a extra <<< "${TORCHRUN_ARGS:-}"
port_free() {  # bound as torch's store binds it (SO_REUSEADDR): the last job's connections in TIME_WAIT are no obstacle
  "$PYTHON" -c "if True:
    import socket, sys
    probe = socket.socket()
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    probe.bind(('', int(sys.argv[1])))" "$1" 2>/dev/null
}
if [ "${NNODES:-1}" -gt 1 ]; then
  : "${MASTER_ADDR:?set MASTER_ADDR to the address of the first node}" "${MASTER_PORT:=29500}" "${RDZV_TIMEOUT:=300}"
  export NNODES MASTER_ADDR MASTER_PORT RDZV_TIMEOUT
  if [ "${NODE_RANK:-}" = 0 ] && ! port_free "$MASTER_PORT"; then
    echo "run.sh: MASTER_PORT $MASTER_PORT is already in use on this machine (the first node): choose another" \
         "port for every node, or stop what holds it (ss -ltnp 'sport = :$MASTER_PORT')" >&2
    exit 2
  fi
  # torchrun guesses from this machine's hostname whether it hosts the rendezvous and which address the others
  # reach it at, and gloo which interface to bind: wrong wherever the hostname names another interface. MASTER_ADDR
  # says it better (tools/hosts.py prints one line); what the user set (TORCHRUN_ARGS, *_SOCKET_IFNAME) wins.
  need tools/hosts.py
  plan=$("$PYTHON" tools/hosts.py plan) || exit 2
  read -r must_wait is_host local_addr ifname <<< "$plan"
  # This node holds MASTER_ADDR: its MASTER_PORT is free (torchrun hosts the store there), or another agent of the
  # job on this machine hosts the store there already. Anything else holding it would keep torchrun's client waiting
  # for an answer for ever, past RDZV_TIMEOUT: ask it as that client does, for 10 s at most.
  if [ "$must_wait" = 0 ] && ! port_free "$MASTER_PORT" && ! "$PYTHON" -c "if True:
         import datetime, os, sys, threading, torch.distributed as dist
         ask = lambda: dist.TCPStore(sys.argv[1], int(sys.argv[2]), timeout=datetime.timedelta(seconds=10))
         client = threading.Thread(target=ask, daemon=True)
         client.start()
         client.join(10)
         os._exit(client.is_alive())" "$MASTER_ADDR" "$MASTER_PORT" 2>/dev/null; then
    echo "run.sh: MASTER_PORT $MASTER_PORT on this machine (it holds MASTER_ADDR) is held by a process that is not" \
         "torch's store: choose another port for every node, or stop what holds it (ss -ltnp 'sport = :$MASTER_PORT')" >&2
    exit 2
  fi
  conf=join_timeout=$RDZV_TIMEOUT
  if [ "$is_host" != - ]; then conf+=,is_host=$is_host; fi
  where=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"
         --rdzv-id="${RDZV_ID:-${SLURM_JOB_ID:-train}}" --rdzv-conf="$conf")
  if [ "$local_addr" != - ]; then where+=(--local-addr="$local_addr"); fi
  if [ "$ifname" != - ]; then
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$ifname} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$ifname}
  fi
  # The other nodes wait here until the host's store answers, so that a wrong address or a closed port ends
  # within RDZV_TIMEOUT with one line saying what this node could not reach (torchrun's client retries for minutes).
  if [ "$must_wait" = 1 ]; then "$PYTHON" tools/hosts.py wait || exit $?; fi
else
  where=(--standalone)
fi
case "$mode" in
  launch) cmd=("$PYTHON" -m torch.distributed.launch) script=train_ddp_launch.py ;;
  ddp) cmd=("$PYTHON" -m torch.distributed.run) script=train_ddp_torchrun.py ;;
  amp) cmd=("$PYTHON" -m torch.distributed.run) script=train_ddp_amp.py ;;
  fsdp) cmd=("$PYTHON" -m torch.distributed.run) script=train_fsdp.py ;;
esac
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}  # see dist_utils.restart_safe_store
if [ ! -f tools/launcher.py ]; then  # run.sh copied without tools/: the launcher itself, its report and exit status
  echo "run.sh: no tools/launcher.py beside run.sh: the launcher runs as it is, with its own report after an error" \
       "or a stop (copy tools/ for one-line endings)" >&2
  exec "${cmd[@]}" "${where[@]}" --nproc-per-node="$nproc" "${extra[@]}" "$script" "$@"
fi

# Run the launcher as a child in a process group of its own, and pass SIGTERM, SIGHUP (a closed terminal or ssh
# session) and Ctrl-C on to it exactly once (torchrun's agent cuts its graceful shutdown short if a second signal
# arrives during it). If run.sh itself dies (kill -9, a job manager, a CI timeout), the launcher gets SIGTERM
# (tools/launcher.py tie), so that it never trains on alone. Its output goes through tools/launcher.py filter,
# which leaves out the launcher's own report where the ranks already said what happened (their `stopped by` or
# `error:` line; the report stays in a log file that one line names), shows any other traceback whole, keeps
# reading when the terminal is gone (so the ranks can still save), and exits with the number of the signal that
# stopped the launcher (the exit status is then 128 + that signal, as for the ranks).
tmp=$(mktemp -d) log=$(mktemp "${TMPDIR:-/tmp}/run.sh-$mode-log.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkfifo "$tmp/out" "$tmp/err"
export PYTHONUNBUFFERED=${PYTHONUNBUFFERED:-1}  # the ranks' lines reach the screen through the filter's pipe
set -m  # each in a process group of its own: a signal to run.sh's group reaches neither
(trap '' INT TERM HUP; exec "$PYTHON" tools/launcher.py filter "$tmp/out" "$tmp/err" "$log" </dev/null) &
filter=$!
"$PYTHON" tools/launcher.py tie $$ "${cmd[@]}" "${where[@]}" --nproc-per-node="$nproc" "${extra[@]}" "$script" "$@" \
  >"$tmp/out" 2>"$tmp/err" &
pid=$!
set +m
trap 'kill -TERM "$pid" 2>/dev/null' TERM
trap 'kill -INT "$pid" 2>/dev/null' INT
trap 'kill -HUP "$pid" 2>/dev/null' HUP
status=0
wait "$pid" || status=$?
while kill -0 "$pid" 2>/dev/null; do wait "$pid" || status=$?; done  # a trapped signal interrupts wait
signum=0
wait "$filter" || signum=$?
if [ "$status" -ne 0 ] && [ "$status" -lt 128 ] && [ "$signum" -gt 0 ] && [ "$signum" -lt 64 ]; then
  status=$(( 128 + signum ))  # the signal that stopped the agent, or the ranks (a launcher killed keeps its own)
fi
exit "$status"
