#!/usr/bin/env bash
# Rehearses a multi-host launch on one machine: N CPU processes, each with its own slice of
# every batch and of the mesh, talking through a local coordinator.
#
#   launch/local_multiprocess.sh 2 --config=configs/fp8_async.py:tiny --workdir=/tmp/opd_mp
#
# The main job (async rollouts) runs with any number of processes: its rollouts are dispatched
# inline by the trainer's thread (rollout.dispatch=auto). XLA_FLAGS=...device_count=4 and
# --config.rollout.devices=4 give the rollouts 2 devices of each process.
#
# Each process sees the CPU devices XLA gives it: one by default, d with
# XLA_FLAGS=--xla_force_host_platform_device_count=d (then the mesh has N x d devices).
# PORT picks the coordinator port (default: random in [20000, 40000)); PYTHON the interpreter.
# When one process fails the others are stopped rather than left waiting for their peer, and
# the script exits with the failed process's status.
set -euo pipefail
n="${1:?usage: local_multiprocess.sh NUM_PROCESSES [main flags...]}"
if [[ ! "${n}" =~ ^[1-9][0-9]*$ ]]; then
  echo "local_multiprocess.sh: NUM_PROCESSES must be a positive integer, got '${n}'" >&2
  exit 2
fi
shift
port="${PORT:-$((20000 + RANDOM % 20000))}"
stop_all() {
  # SIGTERM first (a process between steps stops cleanly), SIGKILL after 10 s for one that is
  # blocked in a collective waiting for its dead peer.
  local running
  read -ra running <<<"$(jobs -pr | tr '\n' ' ')"
  if ((${#running[@]} == 0)); then return 0; fi
  kill "${running[@]}" 2>/dev/null || true
  for _ in {1..20}; do
    if [[ -z "$(jobs -pr)" ]]; then return 0; fi
    sleep 0.5
  done
  kill -KILL "${running[@]}" 2>/dev/null || true
  wait "${running[@]}" 2>/dev/null || true
}
trap stop_all EXIT
for ((i = 0; i < n; i++)); do
  JAX_PLATFORMS=cpu JAX_COORDINATOR_ADDRESS="127.0.0.1:${port}" JAX_NUM_PROCESSES="${n}" \
    JAX_PROCESS_ID="${i}" "${PYTHON:-python}" -m opd_jax.main --distributed "$@" &
done
for ((i = 0; i < n; i++)); do
  wait -n || exit $?
done
