#!/usr/bin/env bash
# TPU pod slice launch, run from a workstation: the same command on every worker of the slice.
#
#   TPU_NAME=my-v5p-64 ZONE=us-east5-a launch/tpu_pod.sh \
#     --config=configs/fp8_async.py --workdir=/mnt/shared/opd
#   launch/tpu_pod.sh --dry-run ...   prints the gcloud command instead of running it
#
# Environment: TPU_NAME and ZONE (required); PROJECT (gcloud's default when unset); REPO_DIR,
# the checkout on every worker (default opd_jax, under the worker's home), installed there with
# `pip install -e ".[tpu]"`; PYTHON, the workers' interpreter (default python3); LIBTPU_INIT_ARGS
# and XLA_FLAGS are passed on to the workers when set here.
#
# On TPU VMs jax.distributed.initialize() discovers the slice itself (coordinator on worker 0,
# process id = worker id, one process per worker holding its local chips), so no coordinator
# variables are passed. JAX_PLATFORMS=tpu makes a worker fail rather than train on its CPU. The
# workdir must be a path every worker sees: a shared filesystem or a gs:// URL (workers need
# `pip install -e ".[gcs]"`; docs/guides/multihost.md). A REPO_DIR of ~/x is read as x under
# the worker's home.
set -euo pipefail
dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then
  dry_run=1
  shift
fi
tpu_name="${TPU_NAME:?set TPU_NAME to the TPU VM name}"
zone="${ZONE:?set ZONE to the TPU zone}"
remote_env=(JAX_PLATFORMS=tpu)
for var in LIBTPU_INIT_ARGS XLA_FLAGS; do
  if [[ -n "${!var:-}" ]]; then remote_env+=("${var}=${!var}"); fi
done
worker_cmd=(env "${remote_env[@]}" "${PYTHON:-python3}" -m opd_jax.main --distributed "$@")
repo_dir="${REPO_DIR:-opd_jax}"
repo_dir="${repo_dir#\~/}" # quoted below, so a leading ~/ would not expand: home-relative
remote="cd $(printf '%q' "${repo_dir}") && $(printf '%q ' "${worker_cmd[@]}")"
cmd=(gcloud compute tpus tpu-vm ssh "${tpu_name}" "--zone=${zone}" --worker=all)
if [[ -n "${PROJECT:-}" ]]; then cmd+=("--project=${PROJECT}"); fi
remote="${remote% }"
if ((dry_run)); then
  # The remote command single-quoted, so that it reads as the workers will run it.
  printf '%q ' "${cmd[@]}"
  printf -- "--command='%s'\n" "${remote//\'/\'\\\'\'}"
  exit 0
fi
exec "${cmd[@]}" "--command=${remote}"
