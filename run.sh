#!/usr/bin/env bash
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
  shrink SRC DST  a copy of a dataset with each image's longer side at most 512 px (--max-side N; tools/shrink.py)
  doctor          check this machine for multi-GPU training (tools/doctor.py)
  gpucheck        on a GPU machine: doctor, tests/test_gpu.py and the GPU bench rows, one report (tools/gpucheck.py)
  test            the test suite (pytest)
N defaults to the number of visible GPUs, or 2 on a CPU-only machine.
Environment: TORCHRUN_ARGS (extra launcher options); multi-node: NNODES, MASTER_ADDR, MASTER_PORT (29500),
NODE_RANK (0 on the first node: checks the port), RDZV_TIMEOUT (300 s), RDZV_ID; PYTHON.
TXT
}

mode=${1:-}
case "$mode" in
  single|dp|launch|ddp|amp|fsdp|bench|shrink|doctor|gpucheck|test) shift ;;
  -h|--help|help) usage; exit 0 ;;
  *) usage >&2; exit 2 ;;
esac

# Python: the current one if it has what we need, else .venv (made from requirements.txt on first use).
needs="torch torchvision tensorboard"
case "$mode" in test|gpucheck) needs="$needs pytest" ;; esac
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

case "$mode" in
  single) exec "$PYTHON" train_single.py "$@" ;;
  dp) exec "$PYTHON" train_dp.py "$@" ;;
  shrink) exec "$PYTHON" tools/shrink.py "$@" ;;
  doctor) exec "$PYTHON" tools/doctor.py "$@" ;;
  gpucheck) exec "$PYTHON" tools/gpucheck.py "$@" ;;
  test) exec "$PYTHON" -m pytest -q tests "$@" ;;
esac

# Multi-process modes: N, the GPU check and the threads per process.
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then nproc=$1; shift; else nproc=$(( gpus > 0 ? gpus : 2 )); fi
if [ "$nproc" -lt 1 ]; then echo "run.sh: N must be at least 1" >&2; exit 2; fi
if [ "$gpus" -gt 0 ] && [ "$nproc" -gt "$gpus" ]; then
  echo "run.sh: $nproc processes but only $gpus visible GPU(s): use N <= $gpus (one process per GPU)" >&2
  exit 2
fi
if [ "$gpus" -eq 0 ] && [ -z "${OMP_NUM_THREADS:-}" ]; then
  cores=$(nproc)
  export OMP_NUM_THREADS=$(( cores / nproc > 0 ? cores / nproc : 1 ))  # the processes share the cores
fi

if [ "$mode" = bench ]; then exec "$PYTHON" tools/bench.py --nproc "$nproc" "$@"; fi

# Single node: --standalone picks a free port. Multi-node: NNODES>1 and MASTER_ADDR:MASTER_PORT of node 0.
read -r -a extra <<< "${TORCHRUN_ARGS:-}"
if [ "${NNODES:-1}" -gt 1 ]; then
  : "${MASTER_ADDR:?set MASTER_ADDR to the address of the first node}" "${MASTER_PORT:=29500}" "${RDZV_TIMEOUT:=300}"
  if [ "${NODE_RANK:-}" = 0 ] && ! "$PYTHON" -c "import socket, sys; socket.socket().bind(('', int(sys.argv[1])))" \
       "$MASTER_PORT" 2>/dev/null; then
    echo "run.sh: MASTER_PORT $MASTER_PORT is already in use on this machine (the first node): choose another" \
         "port for every node, or stop what holds it (ss -ltnp 'sport = :$MASTER_PORT')" >&2
    exit 2
  fi
  where=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"
         --rdzv-id="${RDZV_ID:-${SLURM_JOB_ID:-train}}" --rdzv-conf=join_timeout="$RDZV_TIMEOUT")
else
  where=(--standalone)
fi
case "$mode" in
  launch) cmd=("$PYTHON" -m torch.distributed.launch) script=train_ddp_launch.py ;;
  ddp) cmd=("$PYTHON" -m torch.distributed.run) script=train_ddp_torchrun.py ;;
  amp) cmd=("$PYTHON" -m torch.distributed.run) script=train_ddp_amp.py ;;
  fsdp) cmd=("$PYTHON" -m torch.distributed.run) script=train_fsdp.py ;;
esac

# Run the launcher as a child in a process group of its own, and pass SIGTERM and Ctrl-C on to it exactly once
# (torchrun's agent cuts its own graceful shutdown short if a second signal arrives during it). A rendezvous that
# times out ends with one line saying what is missing. A stopped job ends with the scripts' own line: the traceback
# that the agent prints for the signal it received (SignalException) is left out, and the exit status is 128 + that
# signal, as for the workers. Every other line, and every other traceback, is shown.
tmp=$(mktemp -d) log=$tmp/log
trap 'rm -rf "$tmp"' EXIT
mkfifo "$tmp/stderr"
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}  # see train_ddp_torchrun.py
(trap '' INT TERM; exec "$PYTHON" -u -c '
import re, sys
held, dropped, log = [], False, open(sys.argv[1], "w")
for line in iter(sys.stdin.readline, ""):
    log.write(line)
    log.flush()
    if held and (line[:1] in " \t" or line == "\n"):  # inside a traceback: hold it until its last line says what
        held.append(line)  # it is (a blank line: a second signal interrupted the agent inside its handler)
        continue
    if held and re.match(r"torch\S*SignalException: Process \d+ got signal: \d+$", line):
        held, dropped = [], True  # the agent reporting the signal that stopped it: the scripts said so already
        continue
    if dropped and (not line.strip() or line.startswith("During handling of the above exception")):
        continue  # a second signal during the shutdown of the agent chains a second such traceback
    sys.stderr.writelines(held)
    held, dropped = ([line] if line.startswith("Traceback (most recent call last):") else []), False
    if not held:
        sys.stderr.write(line)
sys.stderr.writelines(held)' "$log" <"$tmp/stderr") &
filter=$!
set -m
"${cmd[@]}" "${where[@]}" --nproc-per-node="$nproc" "${extra[@]}" "$script" "$@" 2>"$tmp/stderr" &
pid=$!
set +m
trap 'kill -TERM "$pid" 2>/dev/null' TERM
trap 'kill -INT "$pid" 2>/dev/null' INT
status=0
wait "$pid" || status=$?
while kill -0 "$pid" 2>/dev/null; do wait "$pid" || status=$?; done  # a trapped signal interrupts wait
wait "$filter"
if grep -q RendezvousTimeoutError "$log"; then
  echo "run.sh: not all $NNODES nodes joined $MASTER_ADDR:$MASTER_PORT within ${RDZV_TIMEOUT}s (RDZV_TIMEOUT):" \
       "start the same command on every node, and check that they reach that address" >&2
fi
signum=$(sed -n 's/^torch.*SignalException: Process [0-9]* got signal: \([0-9]*\)$/\1/p' "$log" | tail -n 1)
if [ "$status" -ne 0 ] && [ -n "$signum" ]; then status=$(( 128 + signum )); fi
exit "$status"
