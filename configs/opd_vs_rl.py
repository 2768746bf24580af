"""OPD against RL under the same rollout mismatch (`python -m opd_jax.opd_vs_rl`).

    python -m opd_jax.opd_vs_rl --config=configs/opd_vs_rl.py --workdir=/tmp/opd_vs_rl \
        --config.run.teacher.cache_dir=/tmp/tcache [--json]
    python -m opd_jax.opd_vs_rl --config=configs/opd_vs_rl.py:tiny --workdir=/tmp/ovr_tiny

`run` is the training run every method and setting starts from (`bf16_sync.py`: the same
teacher, the same warm-started student, the same prompts). For the reference engine and each
entry of `settings` (rollout overrides, parsed like an admission-check candidate) it trains
three methods, each once into <workdir>/runs/<method>__<setting> (`mismatch.runs.run_once`:
a restarted comparison reuses every finished run):

    opd     the run as it is: reverse_kl_full to the teacher at lr `run.train.lr`
    rl      train.loss=reinforce at lr `rl_lr`, no importance correction (ratio 1)
    rl_is   the same with the truncated ratio min(π_θ/π_b, `is_clip`)

Cost and resolution. A run is `run.train.steps` = 400 steps (the schedule compressed to
it), evaluated on 256 held-out prompts every 100 steps and logged every 5 steps: about
1.5-2 minutes per run on 2 quiet CPU cores with the teacher and the warm start cached, so
the 5 settings x 3 methods take about 30-40 minutes. 400 steps is 40 % of the default OPD
budget: a source that only slows learning shows as a drop here, and an instability that
builds up over thousands of steps (the usual RL failure under FP8 rollouts) may not show
at all. 256 prompts give a binomial standard error of about 3 points at 50 % accuracy and
1.4 points at 95 %; one seed per cell, so differences of a few points are noise. The
grad-norm statistics cover the logged steps only (every `log_every`-th step).
"""

import bf16_sync
import ml_collections

VARIANTS = ("tiny",)


def get_config(arg=None):
  """The comparison's settings; `arg="tiny"` is the minutes-long wiring check a test runs."""
  if arg not in (None, *VARIANTS):
    raise ValueError(f"unknown variant {arg!r} of opd_vs_rl.py; known: {', '.join(VARIANTS)}")
  c = ml_collections.ConfigDict()
  run = bf16_sync.get_config(arg)
  c.run = run  # the OPD run (bf16_sync); RL changes only train.loss, lr and is_clip
  c.rl_lr = 3e-5  # peak lr of both RL methods (configs/rl_sync.py: 3e-4 collapses)
  c.grpo_lr = 1e-5  # peak lr of the GRPO arms (configs/grpo_sync.py's)
  c.group_size = 4  # GRPO's completions per prompt (as many completions per step as the run)
  c.grpo_temperature = 1.0  # GRPO's sampling temperature T (π_θ is scored at the same T)
  c.grpo_kl_coef = 0.0  # β of GRPO's KL penalty to the initial student (0: none)
  c.is_clip = 2.0  # truncation C of the rl_is method
  c.methods = ("opd", "rl", "rl_is")  # which methods to train
  c.seeds = (0,)  # train.seed of every cell's runs; more give each cell a mean and an sd
  c.workers = 2  # runs trained side by side, each in a process (runs.run_many); same numbers
  c.settings = (  # mismatch settings besides the reference engine, largest mismatch first
    "rollout.noise_sigma=0.4",
    "rollout.stale_k=4",
    "rollout.weights=fp8,rollout.kv_cache=fp8",
    "rollout.noise_sigma=0.1",
  )
  run.train.steps = 400
  run.train.eval_every = 100
  run.train.checkpoint_every = 200
  run.train.log_every = 5
  if arg == "tiny":
    c.workers = 1  # its runs are mostly compilation, which a fresh process pays again
    c.settings = ("rollout.noise_sigma=0.5",)
    run.train.steps = 4
    run.train.eval_every = 4
    run.train.checkpoint_every = 4
    run.train.log_every = 1
  return c
