#!/usr/bin/env bash
# TorchX dist.ddp on Kubernetes (the kubernetes scheduler, Volcano): 2 pods of 8 GPUs, torchrun in each with c10d
# rendezvous at the first pod ($TORCHX_RANK0_HOST:29500). TorchX mounts a memory-backed /dev/shm in every pod
# itself. --max_retries restarts the whole job, with 0 restarts inside it: it continues only because the command
# says --resume auto and the output folder is on a volume every pod shares. docs/running.md#torchx
# Replace the image (this folder and requirements.txt in it) and the volume claim; the other values are examples.
set -euo pipefail
torchx run --scheduler kubernetes -cfg queue=default \
    dist.ddp -j 2x8 --gpu 8 --cpu 64 --memMB 524288 \
    --max_retries 3 \
    --env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
    --mounts type=volume,src=resnet-shared,dst=/shared \
    --image registry.example.com/multigpu-train:latest \
    --script train_ddp_torchrun.py -- \
    --data-path=/shared/flowers --output-dir=/shared/runs/resnet --resume=auto --save-every=500
