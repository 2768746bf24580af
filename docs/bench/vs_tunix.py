"""opd_jax's sampler against tunix's on one random 58M Qwen3 checkpoint: greedy, f32, 64-token
prompts; argv[1] = "batch:new_tokens,..." (default "1:1024,16:1024"), argv[2] = timed runs per
engine (default 2), argv[3] = the init std of the random weights (default 0.02); each engine
warmed up once, then timed interleaved. Both caches hold prompt + new-token slots.

Runs in a separate environment with tunix installed (never the project's), with this
repository on the path:

    python -m venv /tmp/tunix_venv && /tmp/tunix_venv/bin/pip install google-tunix
    PYTHONPATH=. /tmp/tunix_venv/bin/python docs/bench/vs_tunix.py 1:1024,16:128 1
"""

import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from tunix.generate import sampler as tunix_sampler
from tunix.models.qwen3 import model as tunix_model
from tunix.models.qwen3 import params as tunix_params

from opd_jax.bench.sampler import MODELS
from opd_jax.inference import sampler
from opd_jax.io import hf
from opd_jax.model import kvcache
from opd_jax.model import transformer as model

SHAPES = [
  tuple(map(int, x.split(":")))
  for x in (sys.argv[1] if len(sys.argv) > 1 else "1:1024,16:1024").split(",")
]
REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
PROMPT = 64
cfg = MODELS["qwen3-50m"]
SCALE = float(sys.argv[3]) if len(sys.argv) > 3 else 0.02  # init std; 0.02 is init_params' default
params = model.init_params(jax.random.key(0), cfg, jnp.float32, scale=SCALE)


class IdTokenizer:
  """Token ids written as text ("5 17 9"): no BOS, an EOS id that never occurs."""

  def encode(self, text, **kwargs):
    return [int(x) for x in text.split()]

  def decode(self, ids, **kwargs):
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return 0

  def eos_id(self):
    return cfg.vocab_size

  def pad_id(self):
    return 0


with tempfile.TemporaryDirectory() as directory:
  hf.save_checkpoint(directory, cfg, params)
  tcfg = tunix_model.ModelConfig(
    num_layers=cfg.num_layers,
    vocab_size=cfg.vocab_size,
    embed_dim=cfg.hidden_size,
    hidden_dim=cfg.intermediate_size,
    num_heads=cfg.num_heads,
    head_dim=cfg.head_dim,
    num_kv_heads=cfg.num_kv_heads,
    rope_theta=int(cfg.rope_theta),
    norm_eps=cfg.rms_norm_eps,
    use_tied_embedding=cfg.tie_word_embeddings,
  )
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    tmodel = tunix_params.create_model_from_safe_tensors(directory, tcfg, mesh, jnp.float32)
for batch, new in SHAPES:  # both caches hold PROMPT + new slots
  cache = tunix_sampler.CacheConfig(
    cache_size=PROMPT + new,
    num_layers=cfg.num_layers,
    num_kv_heads=cfg.num_kv_heads,
    head_dim=cfg.head_dim,
  )
  tsampler = tunix_sampler.Sampler(tmodel, IdTokenizer(), cache)
  scfg = sampler.SamplerConfig(
    max_new_tokens=new, temperature=0.0, kv=kvcache.KVCacheSpec("float32"), cache_len=PROMPT + new
  )
  tokens_bp = np.random.default_rng(batch).integers(3, cfg.vocab_size, (batch, PROMPT))
  texts = [" ".join(map(str, row)) for row in tokens_bp]
  prompts = (tokens_bp.astype(np.int32), np.full((batch,), PROMPT, np.int32))

  def opd(prompts=prompts, scfg=scfg):
    out = sampler.sample(params, prompts, jax.random.key(0), scfg, cfg)
    return np.asarray(out.completion_tokens)

  def tunix(tsampler=tsampler, texts=texts, new=new):
    out = tsampler(
      texts,
      max_generation_steps=new,
      max_prompt_length=PROMPT,
      temperature=0.0,
      eos_tokens=[cfg.vocab_size],
    )
    return np.asarray([np.asarray(t)[:new] for t in out.tokens])

  runners = {"opd_jax": opd, "tunix": tunix}
  first = {name: run() for name, run in runners.items()}  # compiles
  same = float(np.mean(first["opd_jax"][:, 0] == first["tunix"][:, 0]))
  times = {name: [] for name in runners}
  for _ in range(REPEATS):
    for name, run in runners.items():
      start = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - start)
  med = {name: statistics.median(t) for name, t in times.items()}
  print(
    {
      "batch": batch,
      "new_tokens": new,
      "opd_jax_s": round(med["opd_jax"], 2),
      "tunix_s": round(med["tunix"], 2),
      "speedup": round(med["tunix"] / med["opd_jax"], 3),
      "first_token_agrees": same,
    },
    flush=True,
  )
