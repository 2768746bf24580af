"""Prefix shift of the GRPO student that learns and of the OPD student, under every setting of
`opd_vs_rl_learns.py` (`python -m opd_jax.main`, then `python -m opd_jax.prefix_shift`).

Where does each student's decode part from the unperturbed engine's, under the rollout settings
of the comparison? The students are the comparison's reference runs of seed 0, trained again
with checkpoints (its runs keep only their results and metrics): `:grpo` is the GRPO arm
(`opd_vs_rl_learns.grpo_base()`, GRPO_RECIPE, no correction), `:opd` the full-vocabulary OPD arm
(`opd_vs_rl_learns.get_config().run`). A checkpoint every step, the last 17 kept, so that
the run holds θ_400 and θ_399, θ_396, θ_384 for the stale settings. The measurement:
`prefix_shift` on the student of step 400, 256 calibration prompts, T = 1, up to the run's
`max_new_tokens`, for each of CANDIDATES; a stale setting (k = 1, 4, 16) samples with
θ_(400−k) of the same run.

Command:  python -m opd_jax.main --config=configs/prefix_shift_learns.py:grpo \
              --workdir=/tmp/ps_grpo --config.teacher.cache_dir=/tmp/tcache
          python -m opd_jax.main --config=configs/prefix_shift_learns.py:opd \
              --workdir=/tmp/ps_opd --config.teacher.cache_dir=/tmp/tcache
          then for STUDENT in grpo, opd (the candidates are CANDIDATES, in order):
          python -m opd_jax.prefix_shift --config=configs/prefix_shift_learns.py:$STUDENT \
              --config.teacher.cache_dir=/tmp/tcache --params-from=/tmp/ps_$STUDENT \
              --prompts=256 --json=prefix_shift_$STUDENT.json \
              --candidate=rollout.noise_sigma=0.1 --candidate=rollout.noise_sigma=0.2 \
              --candidate=rollout.noise_sigma=0.4 \
              --candidate=rollout.kv_cache=fp4,rollout.kv_granularity=tensor \
              --candidate=rollout.mode=async,rollout.max_lag=1 \
              --candidate=rollout.stale_k=4 --candidate=rollout.stale_k=16
          With the comparison's teacher cache the teacher and the warm start load instead of
          training.
Tiny:     python -m opd_jax.main --config=configs/prefix_shift_learns.py:tiny_grpo \
              --workdir=/tmp/ps_tiny (seconds: a wiring check, not learning).
Cost:     the two runs as one of each arm of the comparison, alone on 2 quiet CPU cores
          (opd_vs_rl_learns.COSTS: GRPO at 512 completions per step about 400 s, OPD about
          35 s), plus a minute or two per student for the seven measurements.

Fixed here before either run trained:

  students   the comparison's reference GRPO and full-vocabulary OPD arms, seed 0, 400 steps;
             each run's final accuracies must equal the comparison's grpo__reference and
             opd__reference results (the same config, with checkpoints added), or the
             measurement is not of the comparison's students
  figures    per student and setting: the KL on the unperturbed engine's prefixes and on the
             engine's own, the diverged fraction (seen and predicted from the per-token flip
             probabilities), E[min(d, L)] (seen and predicted), the median first divergence
  reading    whether a setting parts the GRPO student's decodes on more prompts than the OPD
             student's (diverged fraction), and whether either parts more than its per-token
             mismatch predicts (seen against predicted). Whether the TIS/MIS arms recover what
             GRPO loses is read from the comparison's table (its drops), not from this one:
             a per-token correction changes the update, not the engine's decodes.

Expected: (measured; docs/results/opd_vs_rl.md, "The students that learn") the OPD student
          trained by the current code ends bit for bit at the comparison's opd__reference
          (81.6 %); the GRPO student does only when trained by the comparison's own commit
          (62.1 %; the current sampler's last bits move it from step 235 on). Under noise and
          FP4 KV the GRPO student's decodes part on more prompts than the OPD student's (29-98 %
          against 21-85 %), under staleness on fewer (1-11 % against 2-24 %), and neither parts
          more than its per-token mismatch predicts (within 6.4 points).
"""

import ml_collections
import opd_vs_rl_learns as learns

VARIANTS = ("grpo", "opd", "tiny_grpo", "tiny_opd")

# The comparison's settings, the noise ladder's lower rungs first.
CANDIDATES = (
  *learns.LADDER,
  learns.NOISE,
  learns.FP4_KV,
  learns.ASYNC,
  learns.STALE_4,
  learns.STALE_16,
)
CHECKPOINT_EVERY = 1  # divides every lag (1, 4, 16)
KEEP_CHECKPOINTS = 17  # steps 384 ... 400: the largest lag, 16, back from the last step


def get_config(arg=None) -> ml_collections.ConfigDict:
  """The `:grpo` (the default) or `:opd` student's run (module docstring); `:tiny_*` their
  wiring checks."""
  if arg not in (None, *VARIANTS):
    known = ", ".join(VARIANTS)
    raise ValueError(f"unknown variant {arg!r} of prefix_shift_learns.py; known: {known}")
  arg = arg or "grpo"
  tiny = arg.startswith("tiny_")
  if arg.endswith("grpo"):
    c = learns.grpo_base(tiny)
  else:
    c = learns.get_config("tiny" if tiny else None).run
  c.train.checkpoint_every = CHECKPOINT_EVERY
  c.train.keep_checkpoints = KEEP_CHECKPOINTS
  if tiny:
    c.train.steps = 4
    c.train.eval_every = 4
  return c
