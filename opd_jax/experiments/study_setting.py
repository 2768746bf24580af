"""The study's settings: the reference seeds and the calibration and held-out candidates of a
study config (`Setting`, `study_settings`), their run directory names, and each one's training
config (`run_config`). Step 3 of `experiments.study` trains them.
"""

from __future__ import annotations

import dataclasses
import os
import re

import ml_collections

from opd_jax.experiments import runs
from opd_jax.mismatch import candidates as candidates_lib

REFERENCE = "reference"
REFERENCE_SPEC = "rollout.weights=trainer"  # a candidate that changes nothing: the exact engine


@dataclasses.dataclass(frozen=True)
class Setting:
  """One configuration of the study: a candidate spec, where it is used, and its run.

  Attributes:
    name: run directory name under DIR/runs.
    spec: the admission-check candidate (`candidates_lib.parse_candidate`).
    source: "reference", a source name, or several joined by "+" for combinations.
    role: "reference" | "calibration" | "held_out".
    seed: `train.seed` of its run.
  """

  name: str
  spec: str
  source: str
  role: str
  seed: int


def setting_name(spec: str) -> str:
  """A directory name for a spec: "rollout.noise_sigma=0.1,rollout.stale_k=2" ->
  "noise_sigma-0.1_stale_k-2"."""
  name = spec.replace("rollout.", "").replace("=", "-").replace(",", "_")
  return re.sub(r"[^A-Za-z0-9_.-]", "", name)


source_of = candidates_lib.candidate_source  # the sources a setting perturbs, "+"-joined


def study_settings(config: ml_collections.ConfigDict) -> list[Setting]:
  """The reference seeds, then the calibration and held-out settings, in config order.

  Raises:
    ValueError: a spec the admission check refuses, a spec given twice, or no seeds.
  """
  if not config.seeds:
    raise ValueError("config.seeds is empty: the reference needs at least one seed")
  out = [
    Setting(f"{REFERENCE}_seed{s}", REFERENCE_SPEC, REFERENCE, REFERENCE, int(s))
    for s in config.seeds
  ]
  seen = set()
  for role, specs in (("calibration", config.calibration), ("held_out", config.held_out)):
    for spec in specs:
      if spec in seen:
        raise ValueError(f"setting {spec!r} is listed twice (calibration and held_out overlap?)")
      seen.add(spec)
      candidate = candidates_lib.parse_candidate(spec, config.run)
      out.append(
        Setting(setting_name(spec), spec, source_of(candidate), role, int(config.seeds[0]))
      )
  return out


def run_config(config: ml_collections.ConfigDict, setting: Setting, workdir: str):
  """The training config of a setting: the candidate's config with its seed and the study's
  shared teacher cache."""
  candidate = candidates_lib.parse_candidate(setting.spec, config.run)
  cache = config.run.teacher.cache_dir or os.path.join(os.path.abspath(workdir), "teacher_cache")
  return runs.with_overrides(
    candidate.config, {"train.seed": setting.seed, "teacher.cache_dir": cache}
  )
