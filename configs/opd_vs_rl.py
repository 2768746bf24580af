"""OPD against RL under the same rollout mismatch (`python -m opd_jax.opd_vs_rl`).

    python -m opd_jax.opd_vs_rl --config=configs/opd_vs_rl.py --workdir=/tmp/opd_vs_rl \
        --config.run.teacher.cache_dir=/tmp/tcache [--json]
    python -m opd_jax.opd_vs_rl --config=configs/opd_vs_rl.py:tiny --workdir=/tmp/ovr_tiny
    python -m opd_jax.opd_vs_rl --config=configs/opd_vs_rl.py:fair --workdir=/tmp/ovr_fair

`:fair` is the like-for-like comparison of the OPD and GRPO estimators (the comment above
HEADLINE states its arms, settings and primary metric, fixed before it ran): 92 runs of 400
steps, about 80 minutes with two side by side on 2 CPU cores.

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

VARIANTS = ("tiny", "fair")

# `:fair`, the like-for-like comparison, fixed here before any of its runs trained:
#
#   arms       HEADLINE (five seeds, 0-4) and REST (two seeds, 0-1); the GRPO arms at the
#              configs/grpo_sync.py recipe (groups of 4 at T = 1, lr 1e-5, two PPO updates),
#              every correction at C = is_clip = 2.0
#   settings   the reference; weight noise σ 0.4 (NOISE); FP4 KV with one scale per tensor
#              (FP4_KV, the realistic source that crossed the budget's tolerance in round 9);
#              σ 0.2 (NOISE_MID, headline arms, two seeds) for the comparison at equal mismatch
#   primary    per arm and setting: the drop of the mean held-out greedy accuracy against the
#              same arm's reference, with Welch's 95 % interval, and the share of its own gain
#              over the warm start it keeps (bootstrap 95 %), 256 prompts after 400 steps
#   secondary  grad-norm spikes (logged steps over 3× the arm's reference median) and the
#              loss's maximum; drops at equal training mismatch/kl (MATCHED_KL), interpolated
#              over the noise ladder (no extrapolation)
#
# The claim under test (the study's): OPD keeps its quality under rollout settings that
# destabilise RL. It is supported if GRPO loses more than OPD at equal mismatch/kl, or spikes
# where OPD does not; an arm whose reference did not gain (share of gain undefined) is read
# on its drop and spikes alone.
HEADLINE = ("opd", "opd_sampled", "grpo", "grpo_tis")
REST = ("opd_sampled_tis", "grpo_mis", "grpo_seq_tis", "grpo_seq_mis")
NOISE = "rollout.noise_sigma=0.4"
NOISE_MID = "rollout.noise_sigma=0.2"
FP4_KV = "rollout.kv_cache=fp4,rollout.kv_granularity=tensor"
MATCHED_KL = (0.05, 0.1, 0.2)


def get_config(arg=None):
  """The comparison's settings; `arg="tiny"` is the minutes-long wiring check a test runs."""
  if arg not in (None, *VARIANTS):
    raise ValueError(f"unknown variant {arg!r} of opd_vs_rl.py; known: {', '.join(VARIANTS)}")
  c = ml_collections.ConfigDict()
  run = bf16_sync.get_config("tiny" if arg == "tiny" else None)
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
  c.allow_mixed_code = False  # refuse finished runs made by other code than the code running
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
  c.blocks = ()  # (methods, settings, seeds) dicts; empty: the one block above
  c.matched_settings = ()  # the ladder the at-equal-mismatch table interpolates over
  c.matched_kl = ()  # the training mismatch/kl values it reads the drops at
  if arg == "fair":
    # the union of the blocks below, for a reader: with blocks given, plan reads only them
    c.methods = HEADLINE + REST
    c.settings = (NOISE, FP4_KV, NOISE_MID)
    c.seeds = (0, 1, 2, 3, 4)
    c.blocks = (
      {"methods": HEADLINE, "settings": (NOISE, FP4_KV), "seeds": (0, 1, 2, 3, 4)},
      {"methods": REST, "settings": (NOISE, FP4_KV), "seeds": (0, 1)},
      {"methods": HEADLINE, "settings": (NOISE_MID,), "seeds": (0, 1)},
    )
    c.matched_settings = (NOISE_MID, NOISE)
    c.matched_kl = MATCHED_KL
  if arg == "tiny":
    c.workers = 1  # its runs are mostly compilation, which a fresh process pays again
    c.settings = ("rollout.noise_sigma=0.5",)
    run.train.steps = 4
    run.train.eval_every = 4
    run.train.checkpoint_every = 4
    run.train.log_every = 1
  return c
