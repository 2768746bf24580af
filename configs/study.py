"""The study: calibrate the mismatch budget and validate the admission check on the embedded task.

    python -m opd_jax.study --config=configs/study.py --workdir=/tmp/study         # round 7
    python -m opd_jax.study --config=configs/study.py:round8 --workdir=/tmp/study   # round 8
    python -m opd_jax.study --config=configs/study.py:round6 --workdir=/tmp/study   # round 6
    python -m opd_jax.study --config=configs/study.py:round5 --workdir=/tmp/study   # round 5
    python -m opd_jax.study --config=configs/study.py:rounds --workdir=/tmp/rounds  # rounds 1-4
    python -m opd_jax.study --config=configs/study.py:tiny --workdir=/tmp/study_tiny

`run` is the training run every setting starts from (`bf16_sync.py`, shortened); each entry of
`calibration` and `held_out` is an admission-check candidate (`rollout.<key>=<value>,...`) that
the study both measures (before training, at the probe run's student) and trains. The
reference runs (no override) repeat over `seeds` (`train.seed`: data order and sampling; the
teacher and the warm-started student are shared) to give the seed-to-seed noise floor. See
`opd_jax.experiments.study` for the procedure.

Variants (each reruns one round of `docs/study/history.md`, with its settings and rule):
  default   calibrates on GRID (fifteen settings, one run each) and five reference seeds;
            validates on twelve settings drawn by `draw_held_out` with ROUND7_SEED, each
            labelled by the mean of two runs (seeds 0 and 1). Rule: a combination is admitted
            when each of its parts alone is within its own source's limit (`per_part`), and
            a source's own limit needs its fit over τ on two of its records
            (`min_crossing_records = 2`; with fewer it takes the pooled max_kl).
  :round8   the default's calibration and rule, validated on six combinations of weight noise
            with sync staleness, half with an FP8 recipe (`draw_per_part_test`), chosen where
            the per-part rule and the whole-combination rule disagree.
  :round6   GRID; twelve draws (ROUND6_SEED); a combination's whole KL against the strictest
            of its sources' limits (`per_part = False`); `min_crossing_records = 2`.
  :round5   as `:round6` with ROUND5_SEED and `min_crossing_records = 1`.
  :rounds   rounds 1-4: calibrates on GRID, ROUND1, ROUND2 and the ROUND3_SEED draw (54
            settings, borderline ones re-run), validates on the ROUND4_SEED draw, each held-out
            setting labelled by three runs; `:round5`'s rule.
  :tiny     the minutes-long wiring check a test runs (two calibration settings, one held out).

Expected: the default's rule agrees with the two-run labels on about 11 of the 12 held-out
settings; every round's pre-set result is in `docs/study/history.md`.

Cost: a run is 500 OPD steps (half the default budget, the schedule compressed to it) and 512
held-out prompts. The default's 44 runs, two side by side, take 80-100 minutes on 2 CPU cores
with a cached teacher; `:rounds` takes about 4.5 hours from scratch (`borderline_seeds=()`
skips its re-runs).
"""

import random

import bf16_sync
import ml_collections

VARIANTS = ("tiny", "rounds", "round5", "round6", "round8")

# The calibration grid: a noise σ grid from harmless to destructive, stale
# k ∈ {1, 2, 4, 8} (k = 0 is the reference), FP8 weight recipes, FP8 KV at each granularity and
# both kernel variants.
GRID = (
  "rollout.noise_sigma=0.05",
  "rollout.noise_sigma=0.1",
  "rollout.noise_sigma=0.2",
  "rollout.noise_sigma=0.4",
  "rollout.noise_sigma=0.8",
  "rollout.stale_k=1",
  "rollout.stale_k=2",
  "rollout.stale_k=4",
  "rollout.stale_k=8",
  "rollout.weights=fp8",
  "rollout.weights=fp8,rollout.weight_block_size=32",
  "rollout.kv_cache=fp8,rollout.kv_granularity=token_head",
  "rollout.kv_cache=fp8,rollout.kv_granularity=tensor",
  "rollout.kernel=bf16_attention",
  "rollout.kernel=bf16_matmul",
)
# Round 1's held-out settings, chosen by hand; calibration settings in `:rounds`.
ROUND1 = (
  "rollout.noise_sigma=0.15",
  "rollout.noise_sigma=0.3",
  "rollout.stale_k=3",
  "rollout.stale_k=6",
  "rollout.noise_sigma=0.2,rollout.stale_k=2",
  "rollout.weights=fp8,rollout.noise_sigma=0.1",
  "rollout.kernel=bf16_matmul,rollout.kv_cache=fp8",
  "rollout.weights=fp8,rollout.kv_cache=fp8,rollout.kv_granularity=tensor,rollout.stale_k=2",
  "rollout.weights=fp8,rollout.bf16_layers=(0,),rollout.kv_cache=fp8,"
  "rollout.kv_granularity=tensor,rollout.mode=async,rollout.max_lag=1",
  "rollout.noise_sigma=0.25",
  "rollout.noise_sigma=0.35",
  "rollout.noise_sigma=0.5",
  "rollout.noise_sigma=0.3,rollout.stale_k=4",
  "rollout.weights=fp8,rollout.kv_cache=fp8,rollout.noise_sigma=0.4",
  "rollout.stale_k=5,rollout.kv_cache=fp8,rollout.kv_granularity=tensor",
)
# Round 2's held-out settings, chosen near the knees; calibration settings in `:rounds`.
ROUND2 = (
  "rollout.noise_sigma=0.22",
  "rollout.noise_sigma=0.28",
  "rollout.noise_sigma=0.32",
  "rollout.noise_sigma=0.38",
  "rollout.noise_sigma=0.45",
  "rollout.stale_k=7",
  "rollout.noise_sigma=0.15,rollout.stale_k=4",
  "rollout.noise_sigma=0.2,rollout.stale_k=6",
  "rollout.kernel=bf16_attention,rollout.noise_sigma=0.26",
  "rollout.noise_sigma=0.25,rollout.weights=fp8,rollout.kv_cache=fp8,rollout.kv_granularity=tensor",
  "rollout.weights=fp8,rollout.weight_block_size=64,rollout.kv_cache=fp8,rollout.stale_k=3",
  "rollout.weights=fp8,rollout.kv_cache=fp8,rollout.kv_granularity=tensor,"
  "rollout.mode=async,rollout.max_lag=2",
)

# Held-out settings drawn by `draw_held_out` (rounds 3-7): each knob independently, with these
# weights, from what a user would screen. A draw that changes nothing, or repeats a calibration
# setting or an earlier draw, is drawn again. One seed per round:
ROUND3_SEED = 20261201
ROUND4_SEED = 20261202
ROUND5_SEED = 20261203  # `:round5`'s held-out draw
ROUND6_SEED = 20261204  # `:round6`'s held-out draw
ROUND7_SEED = 20261205  # the default's held-out draw
ROUND8_SEED = 20261206  # `:round8`'s draw (`draw_per_part_test`)
DRAW_SIZE = 12
KNOBS = (  # (weight, overrides) per knob
  (
    (0.5, ""),
    (0.2, "rollout.weights=fp8"),
    (0.15, "rollout.weights=fp8,rollout.weight_block_size=32"),
    (0.15, "rollout.weights=fp8,rollout.weight_block_size=64"),
  ),
  (
    (0.5, ""),
    (0.25, "rollout.kv_cache=fp8,rollout.kv_granularity=token_head"),
    (0.25, "rollout.kv_cache=fp8,rollout.kv_granularity=tensor"),
  ),
  ((0.6, ""), (0.2, "rollout.kernel=bf16_attention"), (0.2, "rollout.kernel=bf16_matmul")),
  (
    (0.5, ""),
    *((0.35 / 8, f"rollout.stale_k={k}") for k in range(1, 9)),
    (0.075, "rollout.mode=async,rollout.max_lag=1"),
    (0.075, "rollout.mode=async,rollout.max_lag=2"),
  ),
)
NOISE = (0.5, 0.05, 0.45)  # P(noise), then sigma ~ U(lo, hi) rounded to 0.01


def draw_distinct(name, seed, size, exclude, draw_spec):
  """Up to `size` specs `draw_spec(rng)` with `rng = random.Random(seed)`, skipping an empty
  spec and any that restates one of `exclude` or an earlier draw (`_canonical`), within
  1000 · `size` draws.

  Raises:
    ValueError: `size` not an int >= 0, or `exclude` leaving fewer than `size` settings to draw.
  """
  if isinstance(size, bool) or not isinstance(size, int) or size < 0:
    raise ValueError(f"{name}: size must be an int >= 0, got {size!r}")
  rng = random.Random(seed)
  out = []
  for _ in range(1000 * size):
    if len(out) == size:
      break
    spec = draw_spec(rng)
    if spec and _canonical(spec) not in {_canonical(x) for x in (*exclude, *out)}:
      out.append(spec)
  if len(out) < size:
    raise ValueError(f"{name}: {len(out)} distinct settings in {1000 * size} draws, not {size}")
  return tuple(out)


def draw_held_out(seed, size=DRAW_SIZE, exclude=()):
  """`size` candidate specs drawn from KNOBS and NOISE with `random.Random(seed)`
  (only `random()`, whose sequence Python keeps stable across versions).

  Raises:
    ValueError: `size` not an int >= 0, or `exclude` leaving fewer than `size` settings to draw.
  """

  def draw_spec(rng):
    def pick(options):
      u, acc = rng.random(), 0.0
      for weight, value in options:
        acc += weight
        if u < acc:
          return value
      return options[-1][1]

    parts = [pick(knob) for knob in KNOBS]
    p_noise, lo, hi = NOISE
    if rng.random() < p_noise:
      parts.append(f"rollout.noise_sigma={round(lo + (hi - lo) * rng.random(), 2)}")
    return ",".join(p for p in parts if p)

  return draw_distinct("draw_held_out", seed, size, exclude, draw_spec)


ROUND8_SIZE = 6
ROUND8_SIGMA = (0.05, 0.16)  # the noise part alone within the noise limit
ROUND8_STALE_K = tuple(range(2, 9))  # the whole combination over it


def uniform_choice(rng, options):
  """One of `options`, uniformly, from one `rng.random()`."""
  return options[min(int(rng.random() * len(options)), len(options) - 1)]


def draw_per_part_test(seed, size=ROUND8_SIZE, exclude=()):
  """`size` combinations of weight noise with staleness, and with probability 1/2 one FP8
  weight or KV recipe of KNOBS, drawn with `random.Random(seed)`: σ ~ U(ROUND8_SIGMA) rounded
  to 0.01 and k uniform on ROUND8_STALE_K. On round 6's budget these are where the per-part
  rule and the whole-combination rule disagree: each part alone is within its source's limit
  (the per-part rule admits), the whole combination's KL is over the noise limit (the
  whole-combination rule refuses). Sync staleness only: an async lag trains like its stale
  twin on CPU.

  Raises:
    ValueError: `size` not an int >= 0, or `exclude` leaving fewer than `size` settings.
  """
  fp8 = [value for _, value in (*KNOBS[0], *KNOBS[1]) if value]

  def draw_spec(rng):
    parts = [uniform_choice(rng, fp8)] if rng.random() < 0.5 else []
    lo, hi = ROUND8_SIGMA
    parts.append(f"rollout.stale_k={uniform_choice(rng, ROUND8_STALE_K)}")
    parts.append(f"rollout.noise_sigma={round(lo + (hi - lo) * rng.random(), 2)}")
    return ",".join(parts)

  return draw_distinct("draw_per_part_test", seed, size, exclude, draw_spec)


def _canonical(spec):
  """The overrides of a spec as a set, without those that restate a default (so that
  "kv_cache=fp8" and "kv_cache=fp8,kv_granularity=token_head" are one setting)."""
  defaults = {
    "rollout.kv_granularity=token_head",
    "rollout.weight_block_size=0",
    "rollout.max_lag=1",
  }
  return frozenset(spec.split(",")) - defaults


def _calibration_and_held_out(arg):
  """(calibration, held_out): the default's one round (GRID, then round 7's draw, which
  excludes every setting an earlier round used), `round6`'s or `round5`'s (GRID, that round's
  draw), or `rounds`' four (every earlier round's held-out settings are calibration, round 4's
  draw is held out)."""
  seen = GRID + ROUND1 + ROUND2
  round3 = draw_held_out(ROUND3_SEED, exclude=seen)
  round4 = draw_held_out(ROUND4_SEED, exclude=seen + round3)
  if arg == "rounds":
    return seen + round3, round4
  round5 = draw_held_out(ROUND5_SEED, exclude=seen + round3 + round4)
  if arg == "round5":
    return GRID, round5
  round6 = draw_held_out(ROUND6_SEED, exclude=seen + round3 + round4 + round5)
  if arg == "round6":
    return GRID, round6
  round7 = draw_held_out(ROUND7_SEED, exclude=seen + round3 + round4 + round5 + round6)
  if arg == "round8":
    return GRID, draw_per_part_test(
      ROUND8_SEED, exclude=seen + round3 + round4 + round5 + round6 + round7
    )
  return GRID, round7


def get_config(arg=None):
  """The study's settings; `arg="tiny"` is the minutes-long wiring check a test runs."""
  if arg not in (None, *VARIANTS):
    raise ValueError(f"unknown variant {arg!r} of study.py; known: {', '.join(VARIANTS)}")
  c = ml_collections.ConfigDict()
  run = bf16_sync.get_config("tiny" if arg == "tiny" else None)
  run.tokenizer = "char"  # the built-in task's (explicit, as when the study's runs were recorded)
  c.run = run
  c.seeds = (0, 1, 2, 3, 4)  # train.seed of the reference runs (the noise floor)
  c.probe_steps = 40  # the probe run: this many steps of the reference, every step checkpointed
  c.num_prompts = 64  # calibration prompts per admission-check measurement
  c.tolerance = 0.0  # quality-drop tolerance; 0 = auto: max(2 sd of seeds, 2 binomial SE)
  c.sensitivity = True  # also run the layer-sensitivity scan at the probe's student
  # Runs trained side by side, each in a process of its own (`runs.run_many`), with the same
  # numbers as one at a time, sooner.
  # Their compiled programs come from <workdir>/jax_cache after the first run of each kind.
  c.workers = 2
  # A run whose drop is within one seed-sd of τ is trained again with these seeds (one run
  # cannot tell kept from degraded there): a held-out setting is labelled by the mean of its
  # runs, and each run of a calibration setting in `borderline_roles` is a budget record.
  c.borderline_roles = ("held_out",)  # calibration settings run once
  c.borderline_seeds = (1,)  # so a held-out label is the mean of two runs
  c.rerun_all_roles = ("held_out",)  # every setting of these roles gets borderline_seeds too
  c.per_source = True  # verdicts by per-source limits (`mismatch.budget`); False: pooled budget
  # True: each part of a combination alone against its own source's limit (budget_rules.admit's
  # per_part); False (`:rounds`, `:round5`, `:round6`): the whole combination's KL
  c.per_part = arg not in ("rounds", "round5", "round6")
  # A source's own limit needs its fit over τ on this many of its records (1 for `:rounds`
  # and `:round5`).
  c.min_crossing_records = 1 if arg in ("rounds", "round5") else 2
  # A setting the budget's records do not reach (an uncalibrated source, or beyond its source's
  # calibrated range): refuse | pooled | default, as `python -m opd_jax.admit --extrapolate`.
  c.extrapolate = "refuse"
  c.allow_mixed_code = False  # True: go on with parts made by different code (study.json says so)
  c.calibration, c.held_out = _calibration_and_held_out(arg)
  run.train.steps = 500
  run.train.eval_every = 100
  run.train.checkpoint_every = 100
  run.data.eval_size = 512
  if arg in ("rounds", "tiny"):  # borderline calibration settings are re-run too
    c.borderline_roles = ("calibration", "held_out")
    c.borderline_seeds = (1, 2)
  if arg == "tiny":
    c.workers = 1  # its runs are mostly compilation, which a fresh process pays again
    c.seeds = (0, 1)
    c.probe_steps = 3
    c.num_prompts = 8
    c.sensitivity = False
    c.rerun_all_roles = ()
    c.calibration = ("rollout.noise_sigma=0.5", "rollout.stale_k=1")
    c.held_out = ("rollout.noise_sigma=0.2,rollout.stale_k=1",)  # a combination: two parts
    run.train.steps = 6
    run.train.eval_every = 3
    run.train.checkpoint_every = 3
    run.data.eval_size = 16
  return c
