#!/usr/bin/env bash
# Multi-host GPU launch, one process: run this same script once per process, on every host.
#
#   COORDINATOR=host0:1234 NUM_PROCESSES=2 PROCESS_ID=<0..N-1> \
#     launch/gpu_multihost.sh --config=configs/fp8_async.py --workdir=/shared/opd
#   launch/gpu_multihost.sh --dry-run ...   prints the resolved command instead of running it
#
# jax.distributed.initialize() (called once by opd_jax.main under --distributed) reads the
# coordinator address, process count and process id from these variables; LOCAL_DEVICE_IDS
# (e.g. 3, or 0,1) limits a process to those GPUs of its host when a host runs several
# processes. With COORDINATOR unset JAX detects the cluster itself (SLURM, Open MPI, ...):
# launch/slurm_gpu.sbatch runs this script under srun that way. Every process runs the same
# program; only process 0 writes logs and summaries. The workdir must be a path every host sees.
set -euo pipefail
dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then
  dry_run=1
  shift
fi
if [[ -n "${COORDINATOR:-}" ]]; then
  export JAX_COORDINATOR_ADDRESS="${COORDINATOR}"
  export JAX_NUM_PROCESSES="${NUM_PROCESSES:?set NUM_PROCESSES}"
  export JAX_PROCESS_ID="${PROCESS_ID:?set PROCESS_ID}"
elif [[ -z "${SLURM_JOB_ID:-}${OMPI_COMM_WORLD_SIZE:-}${PMI_SIZE:-}" ]]; then
  echo "gpu_multihost.sh: COORDINATOR is unset and no SLURM or MPI job was found, so JAX" \
    "must detect the cluster itself; outside one, set COORDINATOR=host0:port," \
    "NUM_PROCESSES and PROCESS_ID on every process" >&2
fi
if [[ -n "${LOCAL_DEVICE_IDS:-}" ]]; then
  export JAX_LOCAL_DEVICE_IDS="${LOCAL_DEVICE_IDS}"
fi
# Let XLA use most of the GPU memory for weights, optimizer state and the KV cache.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
cmd=("${PYTHON:-python}" -m opd_jax.main --distributed "$@")
if ((dry_run)); then
  env_shown=()
  for var in JAX_COORDINATOR_ADDRESS JAX_NUM_PROCESSES JAX_PROCESS_ID JAX_LOCAL_DEVICE_IDS \
    XLA_PYTHON_CLIENT_MEM_FRACTION; do
    if [[ -n "${!var:-}" ]]; then env_shown+=("${var}=${!var}"); fi
  done
  printf '%q ' "${env_shown[@]}" "${cmd[@]}"
  printf '\n'
  exit 0
fi
exec "${cmd[@]}"
