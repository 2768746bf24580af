"""Round 9: the extended sources calibrated, one-scale and interaction data, and a fresh
validation of the admission rule against simple baselines, all fixed here before any run of it
trains.

    python -m opd_jax.study --config=configs/validation.py --workdir=DIR \
        --config.run.teacher.cache_dir=DIR/teacher_cache
    python -m opd_jax.validation --study=DIR/study.json --config=configs/validation.py

`--config=configs/validation.py:fp4_kv` on a copy of the same workdir calibrates, after the
fact and outside the validation, the KV formats that landed after this config was fixed (FP8
E5M2 and FP4 KV, and FP4 weights with FP4 KV), reusing round 9's reference and calibration runs.

The first command is the study (`opd_jax.experiments.study`): a 65-step probe, the admission
check's measurement of every setting (and of each part of a combination) at the probe's
student, 200-step OPD runs of every setting with two seeds, the fit, and the frozen rule's
verdicts. The second scores the pre-registered analysis below from its `study.json`
(`python -m opd_jax.validation`, the logic in `opd_jax.experiments.validation`).

The runs: `bf16_sync.py` on the built-in task, shortened to 200 steps as `calibrate --quick`
shortens it (`RUN_OVERRIDES`; the teacher at its fixed 1000 pretraining steps), 256 held-out
prompts. A run's quality is minus its held-out KL(student ‖ teacher) per token (`label =
teacher_kl`): at 200 steps the student is mid-way (about 60 % accuracy) and two seeds' accuracy
differs by several points, while the KL separates the settings; accuracy is reported beside it.
τ = 2 · max(sd of the five reference seeds' KL, 2.5 % of their mean).

Calibration (`CALIBRATION`, 22 settings, every one with seeds 0 and 1):
  - weight noise σ ∈ {0.1, 0.2, 0.3, 0.4, 0.8};
  - staleness k ∈ {4, 16, 32, 64} (the probe is longer than 64 steps);
  - FP8 weights (per channel, per tensor), FP8 KV (per token and head, per tensor);
  - the extended formats: INT4 weights with groups of 128, FP4 (E2M1, MX groups of 32);
  - a production-like stack: INT4 (groups of 128) + FP8 KV per tensor + the output head in BF16;
  - the interaction factorial: σ ∈ {0.2, 0.3} × k ∈ {4, 16}, and INT4 × k 16, FP4 × k 16.

Held out (`HELD_OUT`): 30 settings drawn by `draw_extended` with HELD_OUT_SEED from the
extended sources and their combinations (weight formats FP8 E4M3 and E5M2, INT8, INT4, FP4
with their scale recipes; FP8 KV; the head in BF16; the kernels; weight noise, sometimes
restricted to some layers or modules; staleness up to k = 64), excluding every calibration
setting. The draw's weights aim at 30-50 % of the settings degrading, from the calibration
ladders known before this round (weight noise degrades between σ 0.2 and 0.4 at this length).
A held-out setting is labelled by the mean of its two runs: kept ⇔ mean drop ≤ τ.

Pre-registered analysis (`ANALYSIS`; scored by `opd_jax.experiments.validation`):
  primary   the frozen rule, `sum_of_fractions` (a combination is admitted when Σ over its parts
            of part KL ÷ that source's limit ≤ 1; a source's own limit needs its fit over τ on
            two of its records), through `admission.candidate_verdict`, the code path of
            `python -m opd_jax.admit`: agreement with the labels, with its Wilson 95 % interval.
  baselines on the same settings, each frozen here:
            - pooled: one limit on the check's KL (the budget's overall max_kl), sources ignored;
            - admit-all;
            - measure-nothing: a threshold on the settings themselves, read off the calibration
              labels without measuring anything: refuse iff σ ≥ σ* or k ≥ k* or the weights
              format is one whose lone calibration setting lost quality, where σ* (k*) is the
              smallest σ (k) of a lone noise (stale) calibration setting that lost quality.
  tests     goal: agreement ≥ 90 %. Exact one-sided McNemar (α = 0.05) of the frozen rule
            against admit-all and against measure-nothing (H1: the rule agrees more often).
            Non-inferiority to pooled: the one-sided 95 % lower bound of the paired difference
            in agreement (Wald, over the discordant pairs) above −0.10.
  also      the same tables under the accuracy label; the one-scale fit (per-source offsets)
            and leave-one-source-out knees on the calibration runs; the factorial.

Cost: 5 reference runs, 22 calibration settings and 30 held-out ones with two runs each:
109 runs of 200 steps, about 90 s each with two side by side on 2 CPU cores, so 80-100
minutes; the runs of `calibrate --quick` on `bf16_sync.py --run-steps=200` with the same
teacher cache are the same configurations and are reused when copied into DIR/runs.
"""

import bf16_sync
import ml_collections
import study

HELD_OUT_SEED = 20261209
HELD_OUT_SIZE = 30
RUN_STEPS = 200
PROBE_STEPS = 65  # longer than the largest lag, 64

# The run: `calibrate --quick --run-steps=200` on bf16_sync.py (its `make_plan` overrides).
RUN_OVERRIDES = {
  "train.steps": RUN_STEPS,
  "train.stop_after": 0,
  "train.eval_every": RUN_STEPS,
  "train.checkpoint_every": RUN_STEPS // 4,
  "export.dir": "none",
  "teacher.target_accuracy": 0.0,  # the fixed 1000-step teacher (95 % on this task)
}

NOISE = tuple(f"rollout.noise_sigma={s}" for s in (0.1, 0.2, 0.3, 0.4, 0.8))
STALE = tuple(f"rollout.stale_k={k}" for k in (4, 16, 32, 64))
FP8 = (
  "rollout.weights=fp8",
  "rollout.weights=fp8,rollout.weight_per_tensor=true",
  "rollout.kv_cache=fp8",
  "rollout.kv_cache=fp8,rollout.kv_granularity=tensor",
)
INT4 = "rollout.weights=int4,rollout.weight_group_size=128"
FP4 = "rollout.weights=fp4,rollout.weight_group_size=32"
STACK = f"{INT4},rollout.kv_cache=fp8,rollout.kv_granularity=tensor,rollout.head_dtype=bfloat16"
FACTORIAL = (
  "rollout.noise_sigma=0.2,rollout.stale_k=4",
  "rollout.noise_sigma=0.2,rollout.stale_k=16",
  "rollout.noise_sigma=0.3,rollout.stale_k=4",
  "rollout.noise_sigma=0.3,rollout.stale_k=16",
  f"{INT4},rollout.stale_k=16",
  f"{FP4},rollout.stale_k=16",
)
CALIBRATION = NOISE + STALE + FP8 + (INT4, FP4, STACK) + FACTORIAL

# The held-out draw: each knob independently, (probability, values) with values uniform.
WEIGHTS = (
  0.5,
  (
    "rollout.weights=fp8",
    "rollout.weights=fp8,rollout.weight_block_size=32",
    "rollout.weights=fp8_e5m2",
    "rollout.weights=fp8_e5m2,rollout.weight_per_tensor=true",
    "rollout.weights=int8",
    "rollout.weights=int4,rollout.weight_group_size=32",
    "rollout.weights=int4,rollout.weight_group_size=128",
    "rollout.weights=int4",
    "rollout.weights=fp4,rollout.weight_group_size=16",
    "rollout.weights=fp4,rollout.weight_group_size=32",
  ),
)
KV = (0.3, ("rollout.kv_cache=fp8", "rollout.kv_cache=fp8,rollout.kv_granularity=tensor"))
HEAD = (0.2, ("rollout.head_dtype=bfloat16",))
KERNEL = (0.1, ("rollout.kernel=bf16_matmul", "rollout.kernel=bf16_attention"))
STALE_DRAW = (0.35, tuple(f"rollout.stale_k={k}" for k in (2, 4, 8, 16, 24, 32, 48, 64)))
NOISE_DRAW = (0.6, 0.1, 0.6)  # probability, σ ~ U(lo, hi) rounded to 0.01
NOISE_WHERE = (0.2, ("rollout.noise_modules=(mlp,)", "rollout.noise_layers=(0,)"))
KNOBS = (WEIGHTS, KV, HEAD, KERNEL, STALE_DRAW)

ANALYSIS = {
  "primary": "sum_of_fractions",
  "metric": "agreement",
  "goal": 0.9,
  "baselines": ("pooled", "admit_all", "measure_nothing"),
  "mcnemar_against": ("admit_all", "measure_nothing"),
  "alpha": 0.05,
  "noninferior_to": "pooled",
  "noninferiority_margin": 0.10,
  "interval": "wilson",
  "level": 0.95,
}


def draw_extended(seed=HELD_OUT_SEED, size=HELD_OUT_SIZE, exclude=CALIBRATION):
  """`size` distinct candidate specs from KNOBS and NOISE_DRAW with `random.Random(seed)`
  (only `random()`), skipping one that changes nothing and any in `exclude`
  (`study.draw_distinct`, the draws of configs/study.py's rounds).

  Raises:
    ValueError: fewer than `size` distinct settings in 1000 · `size` draws.
  """

  def draw_spec(rng):
    parts = []
    for p, values in KNOBS:
      if rng.random() < p:
        parts.append(study.uniform_choice(rng, values))
    p_noise, lo, hi = NOISE_DRAW
    if rng.random() < p_noise:
      parts.append(f"rollout.noise_sigma={round(lo + (hi - lo) * rng.random(), 2)}")
      if rng.random() < NOISE_WHERE[0]:
        parts.append(study.uniform_choice(rng, NOISE_WHERE[1]))
    return ",".join(parts)

  return study.draw_distinct("draw_extended", seed, size, exclude, draw_spec)


HELD_OUT = draw_extended()

VARIANTS = ("fp4_kv",)
# `:fp4_kv`, added after round 9 had run and not part of its validation: the KV formats that
# landed after its config was fixed, calibrated on the same runs (the same workdir reuses
# round 9's reference and calibration runs) with two seeds each and no held-out set.
FP4_KV = (
  "rollout.kv_cache=fp8_e5m2",
  "rollout.kv_cache=fp4",
  "rollout.kv_cache=fp4,rollout.kv_granularity=tensor",
  f"{FP4},rollout.kv_cache=fp4",
)


def get_config(arg=None):
  """Round 9's study config (module docstring); `:fp4_kv` adds the FP4 and E5M2 KV ladder."""
  if arg not in (None, *VARIANTS):
    raise ValueError(f"unknown variant {arg!r} of validation.py; known: {', '.join(VARIANTS)}")
  c = ml_collections.ConfigDict()
  run = bf16_sync.get_config()
  for key, value in RUN_OVERRIDES.items():
    section, leaf = key.split(".")
    run[section][leaf] = value
  c.run = run
  c.seeds = (0, 1, 2, 3, 4)
  c.probe_steps = PROBE_STEPS
  c.probe_lag = 64
  c.num_eval = 0  # data.eval_size: 256
  c.num_prompts = 64
  c.tolerance = 0.0  # auto
  c.sensitivity = False
  c.workers = 2
  c.label = "teacher_kl"
  c.rule = ANALYSIS["primary"]
  c.per_source = True
  c.per_part = False
  c.min_crossing_records = 2
  # Pre-registered before extrapolation was refused: its verdicts are the rule's own, with an
  # uncalibrated or out-of-range source held to the pooled limit (now flagged in each row).
  c.extrapolate = "pooled"
  c.allow_mixed_code = False  # True: go on with parts made by different code
  c.calibration = CALIBRATION
  c.held_out = HELD_OUT
  c.borderline_roles = ()
  c.borderline_seeds = (1,)
  c.rerun_all_roles = ("calibration", "held_out")  # every setting: seeds 0 and 1
  c.analysis = ml_collections.ConfigDict(ANALYSIS)
  if arg == "fp4_kv":
    c.calibration = CALIBRATION + FP4_KV
    c.held_out = ()
    c.rerun_all_roles = ("calibration",)
  return c
