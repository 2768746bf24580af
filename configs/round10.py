"""Round 10: the admission check validated, pre-registered, on held-out settings with no
synthetic noise (weight formats, KV formats and async lag as users run them), calibrated on the
realistic dose ladders and scored against admit-all, one pooled threshold and a format lookup
table that measures nothing.

    python -m opd_jax.validation --draw-held-out --study=LADDERS/study.json \
        --config=configs/round10.py        # once: paste its lines below, commit, then run
    mkdir -p DIR && cp -a LADDERS/runs LADDERS/measurements.json DIR/   # the ladders' parts
    python -m opd_jax.study --config=configs/round10.py --workdir=DIR --plan \
        --config.run.teacher.cache_dir=LADDERS/teacher_cache            # the cost, first
    python -m opd_jax.study --config=configs/round10.py --workdir=DIR \
        --config.run.teacher.cache_dir=LADDERS/teacher_cache
    python -m opd_jax.validation --study=DIR/study.json --config=configs/round10.py

LADDERS is the finished workdir of `configs/ladders.py`; `--plan` should then print 92 runs
reused and 90 to train (a run "recorded for another configuration" means another teacher
cache path than the ladders' runs recorded). Until the first command has been run
and its lines pasted over `HELD_OUT = ()` below, `get_config()` refuses to build the study
(`:tiny`, the seconds-long wiring variant the tests use, has its own fixed held-out list).
The config is committed with the drawn list before any round-10 run trains; every run,
measurement and study.json records the commit it was made by (`provenance`).

Calibration: exactly the ladders' study (`configs/ladders.py`: its 29 settings, its run of 600
OPD steps, the five reference seeds 0-4 and seeds 0, 1, 2 per setting, its 65-step probe, 64
measurement prompts, the label `teacher_kl` with accuracy beside it, the rule
`sum_of_fractions` per source with uncalibrated and out-of-range parts refused). This config is
built from `ladders.get_config()` and changes only what is round 10's own, so every calibration
run's config is the ladders' one, key for key (tested): copied into DIR/runs, the ladders' 92
runs, their probe and their measurements are reused (`runs.run_once` reuses a result.json of
the very config; the probe is reused by its checkpoint; measurements by the fingerprint of the
probe's student and the teacher). The runs record the ladders' teacher cache path, so DIR's
study names the same `teacher.cache_dir`. The reused parts were made by the ladders' commit and
the held-out ones by this round's, so `allow_mixed_code` is on and study.json lists both.

Held out (`HELD_OUT`, HELD_OUT_SIZE = 30 settings, three runs each: seeds 0, 1, 2), drawn by
`format_lookup.draw_held_out` with HELD_OUT_SEED from the ladders' labels:
  - SINGLES, six single-source rungs that no ladder has: INT4, FP4 and FP8 weights in groups
    of 64; stale k 6, 10 and 14;
  - then combinations of KNOBS, each present with its probability and its value uniform:
    a weight recipe (the ladders' rungs and the ones above), a KV recipe (the ladders'
    twelve), a lag (async max_lag 1, 2; stale k 4 to 16);
  - no weight noise, no setting of the calibration, every one passing `config.check.validate`;
  - only formats the ladders calibrate: a weight format no ladder has (INT8, FP8 E5M2) is
    refused by the check as an "uncalibrated source" whatever it costs, so such a setting
    would score the refusal default, not the budget; it is left out, and the README's claim
    covers the calibrated formats only.
The draw aims at DEGRADED_SHARE = 0.4 of the settings degrading, going by the ladders: a setting
is predicted degraded iff the lookup table below refuses it, and combinations are drawn until
exactly 12 of 30 are predicted degraded and 18 kept. Every lag is at most 16, the ladders'
largest, so their probe holds each stale engine's weights.

Pre-registered analysis (`ANALYSIS`, scored by `python -m opd_jax.validation`):
  primary   the frozen rule (the ladders' budget, refit on the same runs) through
            `admission.candidate_verdict`, the path of `python -m opd_jax.admit`: agreement with
            the held-out labels (kept ⇔ mean drop over three runs ≤ τ), Wilson 95 % interval,
            on all 30 settings and on those outside ±2 SE of τ; the same under accuracy.
            A part beyond its source's calibrated range is refused (`extrapolate =
            "refuse"`, the check's default with a budget); the pooled threshold and the table
            judge it.
  baselines frozen here:
            - admit_all;
            - pooled: one threshold on the check's KL, the budget's overall limit fitted on the
              calibration settings (round 9's);
            - lookup: the format lookup table (`format_lookup`), which measures nothing: per
              ladder (INT4, FP4, FP8 weights; each KV format with and without layer 0 in
              BF16; the lag, async max_lag L counted as lag L), refuse a part at or coarser
              than the finest rung that degraded on that ladder; a part of a format that no
              ladder covers is admitted (none is drawn); a combination is refused iff one of
              its parts is.
  tests     exact one-sided McNemar (α = 0.05) of the rule against each baseline.
            Goal: agreement ≥ 90 % and beating the lookup table (`must_beat`).
  too close a verdict whose KL falls inside its limit's bootstrap band is read as a refusal
            (`too_close = "refuse"`): the data cannot say it is safe, and the admit command's
            user has to act on it; read so, every setting has an answer and every baseline is
            compared on all 30 (scored "apart", the check would be scored on a subset it chose
            itself). Agreement under every reading (as called, admit, refuse, apart) and the
            share too close are reported beside it. (Eight settings no round had used, tried
            after round 9 with its budget: its three misses were all too-close calls, and read
            as refusals its verdicts agreed with training on 8 of 8.)

Cost (`--plan`): with the ladders' runs reused, 30 × 3 = 90 runs of 600 steps, two side by side
at 0.3 s per step: 90 · 600 · 0.3 / 2 = 8,100 s, plus one measurement (10 s) per held-out
setting and per part the ladders did not measure (about 31: 310 s), about 2.3 hours of 2 CPU
cores. With the ladders (2.4 h) and their run-length check (1.24 h), about 5.9 hours.

Cut to fit: 30 held-out settings (the least the round asks for), three runs each (the least
for a label with its SE); no held-out setting with the output head in BF16, a kernel, weight
noise or an FP4 KV combination beyond the ladders' recipes; FP8 weights in groups of 16 and 32
and FP4 per channel are off every list (`configs/ladders.py`).

Drawn (the command above) from the ladders' study.json, whose table refuses FP4 KV per
tensor with every layer quantized, and lags from 16 on (the only two rungs that degraded); the
list is committed before any round-10 run.

Expected (as found when run; docs/results/round10.md): 14 of the 30 held-out settings
degrade under the KL label; the check agrees with training on 19/30 (63.3 %), the pooled
threshold on 19/30, the lookup table on 24/30: the goal is not met.
"""

import ladders
import ml_collections

HELD_OUT_SEED = 20261210
HELD_OUT_SIZE = 30
DEGRADED_SHARE = 0.4  # 12 of 30 predicted degraded by the ladders' lookup table

# Single-source rungs on no ladder, taken first.
SINGLES = (
  "rollout.weights=int4,rollout.weight_group_size=64",
  "rollout.weights=fp4,rollout.weight_group_size=64",
  "rollout.weights=fp8,rollout.weight_group_size=64",
  "rollout.stale_k=6",
  "rollout.stale_k=10",
  "rollout.stale_k=14",
)
# The combinations' knobs: (probability, values), each value uniform.
WEIGHTS = (
  0.7,
  (
    *ladders.INT4,
    *ladders.FP4,
    *ladders.FP8,
    *SINGLES[:3],
  ),
)
KV = (0.6, ladders.KV)
LAG = (0.5, (*ladders.LAG[:2], *(f"rollout.stale_k={k}" for k in (4, 6, 8, 10, 12, 14, 16))))
KNOBS = (WEIGHTS, KV, LAG)

# Pasted from `python -m opd_jax.validation --draw-held-out` on the ladders' study.json.
# The ladders' lookup table refuses fp4_kv from per tensor, stale from k 16. Predicted degraded by
# it: 12 of 30.
HELD_OUT = (
  "rollout.weights=int4,rollout.weight_group_size=64",  # predicted kept
  "rollout.weights=fp4,rollout.weight_group_size=64",  # predicted kept
  "rollout.weights=fp8,rollout.weight_group_size=64",  # predicted kept
  "rollout.stale_k=6",  # predicted kept
  "rollout.stale_k=10",  # predicted kept
  "rollout.stale_k=14",  # predicted kept
  "rollout.weights=fp8,rollout.weight_group_size=64,rollout.stale_k=8",  # predicted kept
  (
    "rollout.weights=fp4,rollout.weight_group_size=32,rollout.kv_cache=fp8_e5m2,"
    "rollout.kv_granularity=token_head,rollout.kv_bf16_layers=(0,),rollout.stale_k=10"
  ),  # predicted kept
  (
    "rollout.weights=int4,rollout.kv_cache=fp8_e5m2,rollout.kv_granularity=token_head,"
    "rollout.stale_k=14"
  ),  # predicted kept
  (
    "rollout.weights=int4,rollout.kv_cache=fp8,rollout.kv_granularity=token_head,"
    "rollout.kv_bf16_layers=(0,),rollout.stale_k=6"
  ),  # predicted kept
  (
    "rollout.weights=fp4,rollout.weight_group_size=64,rollout.kv_cache=fp8_e5m2,"
    "rollout.kv_granularity=token_head,rollout.kv_bf16_layers=(0,),rollout.mode=async,"
    "rollout.max_lag=2"
  ),  # predicted kept
  (
    "rollout.weights=fp8,rollout.weight_per_tensor=true,rollout.kv_cache=fp8,"
    "rollout.kv_granularity=token_head,rollout.kv_bf16_layers=(0,),rollout.stale_k=4"
  ),  # predicted kept
  "rollout.weights=int4,rollout.weight_group_size=32,rollout.stale_k=12",  # predicted kept
  (
    "rollout.weights=fp4,rollout.weight_group_size=16,rollout.kv_cache=fp8_e5m2,"
    "rollout.kv_granularity=token_head"
  ),  # predicted kept
  (
    "rollout.weights=int4,rollout.weight_per_tensor=true,rollout.kv_cache=fp8,"
    "rollout.kv_granularity=tensor,rollout.mode=async,rollout.max_lag=1"
  ),  # predicted kept
  (
    "rollout.weights=int4,rollout.weight_group_size=64,rollout.kv_cache=fp8_e5m2,"
    "rollout.kv_granularity=token_head"
  ),  # predicted kept
  (
    "rollout.weights=int4,rollout.weight_per_tensor=true,rollout.kv_cache=fp4,"
    "rollout.kv_granularity=token_head,rollout.kv_bf16_layers=(0,)"
  ),  # predicted kept
  "rollout.weights=int4,rollout.weight_per_tensor=true,rollout.stale_k=8",  # predicted kept
  (
    "rollout.weights=int4,rollout.kv_cache=fp4,rollout.kv_granularity=tensor,rollout.stale_k=10"
  ),  # predicted degraded
  "rollout.weights=int4,rollout.kv_cache=fp4,rollout.kv_granularity=tensor",  # predicted degraded
  "rollout.weights=int4,rollout.weight_group_size=16,rollout.stale_k=16",  # predicted degraded
  (
    "rollout.weights=fp4,rollout.weight_group_size=64,rollout.kv_cache=fp4,"
    "rollout.kv_granularity=tensor,rollout.stale_k=8"
  ),  # predicted degraded
  (
    "rollout.weights=fp4,rollout.weight_group_size=64,rollout.kv_cache=fp4,"
    "rollout.kv_granularity=tensor,rollout.stale_k=4"
  ),  # predicted degraded
  (
    "rollout.weights=int4,rollout.weight_per_tensor=true,rollout.kv_cache=fp4,"
    "rollout.kv_granularity=tensor"
  ),  # predicted degraded
  (
    "rollout.weights=fp8,rollout.kv_cache=fp8,rollout.kv_granularity=tensor,rollout.stale_k=16"
  ),  # predicted degraded
  (
    "rollout.weights=fp4,rollout.weight_group_size=32,rollout.kv_cache=fp4,"
    "rollout.kv_granularity=tensor"
  ),  # predicted degraded
  "rollout.kv_cache=fp4,rollout.kv_granularity=tensor,rollout.stale_k=14",  # predicted degraded
  (
    "rollout.weights=fp4,rollout.weight_group_size=16,rollout.kv_cache=fp4,"
    "rollout.kv_granularity=tensor"
  ),  # predicted degraded
  (
    "rollout.weights=int4,rollout.weight_per_tensor=true,rollout.kv_cache=fp8_e5m2,"
    "rollout.kv_granularity=tensor,rollout.kv_bf16_layers=(0,),rollout.stale_k=16"
  ),  # predicted degraded
  (
    "rollout.weights=fp4,rollout.weight_group_size=16,rollout.kv_cache=fp4,"
    "rollout.kv_granularity=tensor,rollout.stale_k=12"
  ),  # predicted degraded
)

ANALYSIS = {
  "primary": "sum_of_fractions",
  "metric": "agreement",
  "goal": 0.9,
  "baselines": ("pooled", "admit_all", "lookup"),
  "mcnemar_against": ("admit_all", "pooled", "lookup"),
  "must_beat": ("lookup",),  # the goal: agreement ≥ goal and McNemar p < α against these
  "alpha": 0.05,
  "noninferior_to": "pooled",
  "noninferiority_margin": 0.10,
  "interval": "wilson",
  "level": 0.95,
  "too_close": "refuse",
}

VARIANTS = ("tiny",)
# `:tiny`: ladders.py:tiny's calibration (lags below its 3-step probe) and two held-out settings.
TINY_HELD_OUT = (
  "rollout.weights=int4,rollout.weight_group_size=32,rollout.stale_k=1",
  "rollout.weights=int4,rollout.weight_group_size=64,rollout.kv_cache=fp4,"
  "rollout.kv_granularity=tensor",
)
UNREGISTERED = (
  "round 10's held-out settings are not drawn yet: run `python -m opd_jax.validation "
  "--draw-held-out --study=LADDERS/study.json --config=configs/round10.py` on the ladders' "
  "study.json, paste its lines over `HELD_OUT = ()` in configs/round10.py and commit them "
  "before any round-10 run"
)


def draw_config():
  """What the held-out draw reads (`python -m opd_jax.validation --draw-held-out`): the run the
  specs are parsed against, the calibration it excludes, and its parameters."""
  c = ml_collections.ConfigDict()
  c.run = ladders.get_config().run
  c.calibration = ladders.LADDERS
  c.draw = ml_collections.ConfigDict(
    {
      "seed": HELD_OUT_SEED,
      "size": HELD_OUT_SIZE,
      "degraded_share": DEGRADED_SHARE,
      "singles": SINGLES,
      "knobs": KNOBS,
    }
  )
  return c


def get_config(arg=None):
  """Round 10's study config (module docstring): the ladders' config with the held-out
  settings and the analysis; `:tiny` for the wiring tests.

  Raises:
    ValueError: an unknown variant, or HELD_OUT not drawn yet (UNREGISTERED).
  """
  if arg not in (None, *VARIANTS):
    raise ValueError(f"unknown variant {arg!r} of round10.py; known: {', '.join(VARIANTS)}")
  if arg is None and not HELD_OUT:
    raise ValueError(UNREGISTERED)
  c = ladders.get_config(arg)  # the calibration, its runs, probe and measurement, unchanged
  c.held_out = TINY_HELD_OUT if arg == "tiny" else HELD_OUT
  c.rerun_all_roles = ("calibration", "held_out")  # every setting: seeds 0 and borderline_seeds
  c.allow_mixed_code = True  # the ladders' runs, made by an earlier commit, are reused
  c.rule = ANALYSIS["primary"]
  c.analysis = ml_collections.ConfigDict(ANALYSIS)
  return c
