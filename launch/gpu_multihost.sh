#!/usr/bin/env bash
# Multi-host GPU launch: run this same script on every host.
#
#   COORDINATOR=host0:1234 NUM_PROCESSES=2 PROCESS_ID=<0..N-1> \
#     launch/gpu_multihost.sh --config=configs/fp8_async.py --workdir=/shared/opd
#
# jax.distributed.initialize() (called once by opd_jax.main under --distributed) reads
# the coordinator address, process count and process id from these variables. Every
# host runs the same program; only process 0 writes logs, summaries and checkpoints'
# metadata. Under SLURM the variables can be left unset: JAX detects the cluster.
set -euo pipefail
if [[ -n "${COORDINATOR:-}" ]]; then
  export JAX_COORDINATOR_ADDRESS="${COORDINATOR}"
  export JAX_NUM_PROCESSES="${NUM_PROCESSES:?set NUM_PROCESSES}"
  export JAX_PROCESS_ID="${PROCESS_ID:?set PROCESS_ID}"
fi
# Let XLA use most of the GPU memory for weights, optimizer state and the KV cache.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
exec python -m opd_jax.main --distributed "$@"
