"""One process of a 2-process sliced checkpoint load (CPU, one device per process).

Run twice by tests/io/test_hf_sliced.py, as process 0 and process 1 of a local
`jax.distributed` job. Usage:

    python tests/io/_hf_sliced_check.py CHECKPOINT_DIR PROCESS_ID PORT

Loads the checkpoint onto a (data 1, fsdp 2, tensor 1) mesh spanning both processes with
the training layout (`sharding.tree_shardings`) and prints one JSON line: the bytes this
process read (`hf.bytes_read`), the bytes of every tensor of the checkpoint, the bytes of
the distinct slices this process's device holds, and whether every held slice equals the
same slice of the tensor read whole.
"""

import json
import sys

import jax
import numpy as np
import safetensors

from opd_jax.io import hf, hf_layout
from opd_jax.model import sharding
from opd_jax.model import transformer as model


def main(path, process_id, port):
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(process_id))
  mesh = sharding.make_mesh((1, 2, 1))
  cfg = hf.load_config(path)
  abstract = jax.eval_shape(lambda: model.init_params(jax.random.key(0), cfg))
  shardings = sharding.tree_shardings(abstract, mesh)
  hf.reset_bytes_read()
  _, params = hf.load_checkpoint(path, shardings=shardings)
  read = hf.bytes_read()

  weight_map, _ = hf._weight_map(path)
  total = held = 0
  equal = True
  for spec in hf_layout.tensor_specs(cfg):
    with safetensors.safe_open(weight_map[spec.hf_name], framework="numpy") as fh:
      full = spec.to_ours(fh.get_tensor(spec.hf_name))
    total += full.nbytes
    leaf = params
    for k in spec.key:
      leaf = leaf[k]
    seen = set()
    for shard in leaf.addressable_shards:
      key = tuple((s.start, s.stop) for s in shard.index)
      if key not in seen:
        seen.add(key)
        held += full[shard.index].nbytes
      equal &= bool(np.array_equal(np.asarray(shard.data), full[shard.index]))
  print(
    json.dumps(
      {
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "bytes_read": read,
        "checkpoint_bytes": total,
        "held_bytes": held,
        "equal": equal,
        "q_shard": list(params["layers"][0]["q_dnh"].addressable_shards[0].data.shape),
      }
    ),
    flush=True,
  )
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(*sys.argv[1:])
