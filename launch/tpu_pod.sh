#!/usr/bin/env bash
# TPU pod slice launch: the same command on every worker.
#
#   gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command \
#     "cd opd_jax && bash launch/tpu_pod.sh --config=configs/fp8_async.py --workdir=/mnt/shared/opd"
#
# On TPU VMs jax.distributed.initialize() discovers the slice topology itself, so no
# coordinator variables are needed. The workdir must be a filesystem path that every
# worker sees (checkpoints and logs use plain file I/O; gs:// URLs are not supported yet). Install with `pip install -e ".[tpu]"` first.
set -euo pipefail
exec python -m opd_jax.main --distributed "$@"
