"""OPD against RL on the GRPO baseline that learns (`python -m opd_jax.opd_vs_rl`).

The comparison of `opd_vs_rl.py:fair` again, with its GRPO arms replaced by the recipe that
learns (`grpo_sweep.py`) and every arm trained from the 475-step warm start of
`grpo_practice.py`: OPD arms from `grpo_practice.get_config("opd")`, GRPO arms from the arm of
`grpo_sweep.py` named by GRPO_RECIPE (its own lr, groups of 8, one on-policy update per batch,
lr warmup), with only the engine correction added. Both bases share the teacher, the warm
start, the prompts and the run length, which `opd_vs_rl.check_shared` enforces.

Command:  python -m opd_jax.opd_vs_rl --config=configs/opd_vs_rl_learns.py \
              --workdir=/tmp/ovr_learns --config.run.teacher.cache_dir=/tmp/tcache --plan
          (prints the runs per block, what the workdir holds, the estimated wall time and its
          split into parts of about two hours; trains nothing), then per sitting
          python -m opd_jax.opd_vs_rl --config=configs/opd_vs_rl_learns.py \
              --workdir=/tmp/ovr_learns --config.run.teacher.cache_dir=/tmp/tcache --part=K
          for K = 1, 2, ... (each trains its part's runs and rewrites the report over every
          finished run; a part stopped midway resumes where it stopped). On machines that
          keep nothing between sittings, carry the finished runs (results and metrics.jsonl):
          python -m opd_jax.finished_runs --workdir=/tmp/ovr_learns --save=RECORDS after a
          part, --restore=RECORDS into the same workdir path before the next.
Verdict:  python -m opd_jax.opd_vs_rl_verdict --report=/tmp/ovr_learns/opd_vs_rl.json
          (the reading fixed below, applied to the report; it reads only the JSON, so code
          newer than the comparison's own commit reads it).
Tiny:     python -m opd_jax.opd_vs_rl --config=configs/opd_vs_rl_learns.py:tiny \
              --workdir=/tmp/ovrl_tiny
          (two arms, one setting: a wiring check, not learning).
Cost:     200 runs of 400 steps (116 GRPO, 84 OPD); from COSTS (one run alone on 2 quiet CPU
          cores: a GRPO run at 256 completions per step about 200 s, at 512 about 400 s, an OPD
          run about 35 s, 30 s of compilation for the first run of each arm and setting) and
          two side by side, about 6.6 h at GRPO_RECIPE "grpo_lr1e4_n256" and 12.1 h at
          "grpo_lr1e4_n512", plus 8 minutes for the teacher and warm start when not cached.
          Measured on its first part: with two runs side by side, a GRPO run takes about 3 s per
          step on quiet cores (1,200 s per run, 600 s of the pair's wall: 1.8x the plan), so
          about 20 h in all; `--plan` prints the rates of the runs already finished
          ("measured:"), which include any time the cores were shared.
Expected: not yet run.
"""

import grpo_practice
import grpo_sweep
import ml_collections
import opd_vs_rl

VARIANTS = ("tiny",)

# The GRPO recipe every GRPO arm trains with: an arm of grpo_sweep.py (GRPO_ARMS or
# STEP_ARMS). Set before the comparison's first run; changing it changes every GRPO run.
# Chosen on the sweep's confirmations alone, before any run of this comparison: the recipe
# that gained the most over five seeds, 512 completions per step (stage 2b: +11.7 points at
# T = 1, 0.41 of OPD's gain; 256 completions, stage 2: +7.8, 0.27). A larger gain resolves
# the share each setting keeps more finely; it costs 12.1 h of plan against 6.6 h.
GRPO_RECIPE = "grpo_lr1e4_n512"

# Fixed here before any of its runs trained:
#
#   arms       HEADLINE (five seeds, 0-4): full-vocabulary OPD, sampled-token OPD, GRPO, GRPO +
#              token TIS; REST (two seeds, 0-1): sampled-token OPD + TIS, GRPO + token MIS,
#              GRPO + sequence TIS, GRPO + sequence MIS; every correction at C = is_clip = 2.0
#   settings   the reference; weight noise σ 0.4 (NOISE); FP4 KV with one scale per tensor
#              (FP4_KV); the lag the async loop reaches (ASYNC: max_lag 1); staleness k 4 and
#              16 (STALE_4, STALE_16); σ 0.1 and 0.2 (LADDER, every arm, seeds 0-1), so that
#              each arm has three noise rungs (0.1, 0.2, 0.4) beside its reference
#   primary    per arm and setting: the drop of the mean held-out accuracy against the same
#              arm's reference, with Welch's 95 % interval, and the share of its own gain over
#              the warm start it keeps (bootstrap 95 %), at T = 1 (one sample per prompt) and
#              greedy, 256 prompts after 400 steps
#   secondary  grad-norm spikes (logged steps over 3× the arm's reference median) and the
#              loss's maximum; drops at equal training mismatch/kl (MATCHED_KL), interpolated
#              over the noise ladder (no extrapolation)
#
# The claim under test (the study's): OPD keeps its quality under rollout settings that
# destabilise RL. Read per setting on the T = 1 drop (greedy beside it): supported under a
# setting when GRPO's drop interval lies above 0 while full-vocabulary OPD's holds 0, or
# GRPO's drop at equal mismatch/kl exceeds OPD's by more than OPD's own interval's half
# width, or GRPO spikes where OPD does not; contradicted when OPD's drop exceeds GRPO's the
# same way; otherwise not shown. GRPO + TIS is read against GRPO: whether the correction
# recovers what GRPO loses. A reference that did not gain leaves the share undefined: that arm
# is read on its drop and spikes alone.
HEADLINE = opd_vs_rl.HEADLINE
REST = opd_vs_rl.REST
NOISE = opd_vs_rl.NOISE
FP4_KV = opd_vs_rl.FP4_KV
ASYNC = "rollout.mode=async,rollout.max_lag=1"
STALE_4 = "rollout.stale_k=4"
STALE_16 = "rollout.stale_k=16"
SETTINGS = (NOISE, FP4_KV, ASYNC, STALE_4, STALE_16)
LADDER = ("rollout.noise_sigma=0.1", opd_vs_rl.NOISE_MID)
MATCHED_KL = (0.01, 0.05, 0.1, 0.2)
# Wall seconds of one 400-step run alone on 2 quiet CPU cores, with its 5 evaluations (greedy
# and T = 1, 256 prompts); the plan (`experiments.opd_vs_rl_plan`) scales them by steps.
COSTS = {
  "steps": 400,  # the run length the constants below are for
  "opd_run_seconds": 35.0,  # an OPD run (32 completions per step)
  "rl_seconds_per_completion": 200.0 / 256,  # a GRPO run per completion per step
  "compile_seconds": 30.0,  # the first run of each (arm, setting); later ones load its programs
  "teacher_seconds": 480.0,  # the teacher bootstrap and warm start, when not cached
  "speedup": 1.18,  # `workers` runs side by side against one at a time (2 on 2 cores)
  "part_seconds": 7200.0,  # the length of a part (`--part`)
}


def grpo_base(tiny: bool = False) -> ml_collections.ConfigDict:
  """The GRPO run every GRPO arm starts from: grpo_sweep.py's arm GRPO_RECIPE."""
  table = {**grpo_sweep.GRPO_ARMS, **grpo_sweep.STEP_ARMS}
  if GRPO_RECIPE not in table:
    raise ValueError(f"GRPO_RECIPE {GRPO_RECIPE!r} is not an arm of grpo_sweep.py")
  return grpo_sweep.grpo_arm(*table[GRPO_RECIPE], tiny=tiny)


def get_config(arg=None):
  """The comparison; `arg="tiny"` the seconds-per-run wiring check."""
  if arg not in (None, *VARIANTS):
    known = ", ".join(VARIANTS)
    raise ValueError(f"unknown variant {arg!r} of opd_vs_rl_learns.py; known: {known}")
  tiny = arg == "tiny"
  c = ml_collections.ConfigDict()
  c.run = grpo_practice.get_config("opd_tiny" if tiny else "opd")  # the OPD arms' base
  c.grpo_run = grpo_base(tiny)  # the GRPO arms' base, whole: only the correction is added
  c.grpo_recipe = GRPO_RECIPE  # its name, for the report
  c.rl_lr = 3e-5  # the REINFORCE arms' lr (none of this comparison's arms)
  c.is_clip = 2.0  # the truncation C of every corrected arm
  c.workers = 2  # runs trained side by side, each in a process (the same numbers)
  c.allow_mixed_code = False  # refuse finished runs made by other code than the code running
  c.costs = ml_collections.ConfigDict(COSTS)  # per-run costs of the plan
  # the union of the blocks, for a reader: with blocks given, the plan reads only them
  c.methods = HEADLINE + REST
  c.settings = SETTINGS + LADDER
  c.seeds = (0, 1, 2, 3, 4)
  c.blocks = (
    {"methods": HEADLINE, "settings": SETTINGS, "seeds": (0, 1, 2, 3, 4)},
    {"methods": REST, "settings": SETTINGS, "seeds": (0, 1)},
    {"methods": HEADLINE + REST, "settings": LADDER, "seeds": (0, 1)},
  )
  c.matched_settings = (*LADDER, NOISE)
  c.matched_kl = MATCHED_KL
  if tiny:
    c.workers = 1  # its runs are mostly compilation, which a fresh process pays again
    c.methods = ("opd", "grpo_tis")
    c.settings = ("rollout.noise_sigma=0.5",)
    c.seeds = (0,)
    c.blocks = ()
    c.matched_settings = c.settings
    c.matched_kl = (0.01,)
    for run in (c.run, c.grpo_run):
      run.train.steps = 4
      run.train.eval_every = 4
      run.train.checkpoint_every = 4
      run.train.log_every = 1
  return c
