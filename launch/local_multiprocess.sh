#!/usr/bin/env bash
# Rehearses a multi-host launch on one machine: N CPU processes, each with its own
# slice of the data and of the mesh, talking through a local coordinator.
#
#   launch/local_multiprocess.sh 2 --config=configs/bf16_sync.py:tiny --workdir=/tmp/opd_mp
set -euo pipefail
n="${1:?usage: local_multiprocess.sh NUM_PROCESSES [main flags...]}"
shift
port="${PORT:-$((20000 + RANDOM % 20000))}"
pids=()
for ((i = 0; i < n; i++)); do
  JAX_PLATFORMS=cpu JAX_COORDINATOR_ADDRESS="127.0.0.1:${port}" JAX_NUM_PROCESSES="${n}" \
    JAX_PROCESS_ID="${i}" python -m opd_jax.main --distributed "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "${pid}" || status=$?; done
exit "${status}"
