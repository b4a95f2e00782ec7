#!/bin/bash
# SLURM, one task per GPU and no launcher: srun starts the 16 processes, and the scripts take RANK, WORLD_SIZE,
# LOCAL_RANK and MASTER_ADDR (the step's first node) from SLURM_*. docs/running.md#slurm-one-task-per-gpu
# (With torchrun, one task per node: the SLURM section of the README.)
#   sbatch examples/sbatch.sh
#SBATCH --job-name=resnet
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8         # one task per GPU: RANK=SLURM_PROCID, LOCAL_RANK=SLURM_LOCALID
#SBATCH --gpus-per-node=8           # every task sees its node's GPUs and takes GPU LOCAL_RANK (no --gpus-per-task)
#SBATCH --cpus-per-task=8
#SBATCH --mem=512G
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@180           # 3 minutes before the time limit every task gets SIGTERM: stop and save
#SBATCH --requeue                   # a requeued job (preemption, a failed node, the line below) keeps its id
export OMP_NUM_THREADS=1            # as torchrun sets it for each of its processes
# --output-dir on the shared filesystem, named by the job id that a requeued job keeps; --resume auto continues it
status=0
srun python train_ddp_torchrun.py --data-path /shared/flowers --output-dir "/shared/runs/$SLURM_JOB_ID" \
    --resume auto --save-every 500 --workers $((SLURM_CPUS_PER_TASK - 1)) || status=$?
# stopped by the time limit's SIGTERM (exit 143, checkpoint saved): queue the job again to continue it
if [ "$status" = 143 ]; then scontrol requeue "$SLURM_JOB_ID"; fi
exit "$status"
