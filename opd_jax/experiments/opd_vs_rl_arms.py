"""OPD against RL: the arms, as overrides of the run each starts from.

`method_overrides` turns the OPD run (`config.run`) into any arm of `opd_vs_rl_report.METHODS`
(`experiments.opd_vs_rl`'s module docstring lists them); `grpo_correction` adds an engine
correction to a GRPO base run of its own (`config.grpo_run`), which `check_shared` holds to the
OPD run's teacher, warm start, prompts and length; `grpo_recipe` reads off the GRPO arms' lr,
groups and completions for the report.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from opd_jax.experiments import runs
from opd_jax.experiments.opd_vs_rl_report import METHODS

# configs/bf16_sync_sampled.py's recipe over bf16_sync.py (tests/experiments/test_opd_vs_rl.py
# holds the two files to it); the arms keep the run's batch so that every arm samples as many
# completions.
SAMPLED_OPD = {
  "train.loss": "reverse_kl_sampled",
  "train.lr": 5e-4,
  "train.advantage_clip": 0.5,
  "train.advantage_baseline": "batch_mean",
  "rollout.temperature": 1.0,
}
GRPO_LR = 1e-5  # GRPO's peak lr when the config has no grpo_lr (configs/grpo_sync.py's)
GROUP_SIZE = 4  # GRPO's completions per prompt when the config has no group_size


def method_overrides(
  method: str,
  rl_lr: float,
  is_clip: float,
  *,
  batch_size: int = 32,
  group_size: int = GROUP_SIZE,
  grpo_lr: float = GRPO_LR,
  grpo_temperature: float = 1.0,
  grpo_kl_coef: float = 0.0,
) -> dict[str, Any]:
  """The config overrides that turn the OPD run into `method` (the module docstring's arms).

  `batch_size` is the run's completions per step (`data.batch_size`); a GRPO arm samples
  batch_size / group_size prompts `group_size` times each, so it samples as many, at
  `grpo_temperature` T (the trainer scores π_θ at the same T: softmax(z / T)), with the KL
  penalty β = `grpo_kl_coef` to the initial student (0: none).

  Raises:
    ValueError: an unknown method, a non-positive is_clip for an arm that corrects (for a
      GRPO correction, C must be > 1), or a group size that does not divide the batch.
  """
  corrected = method in ("rl_is", "opd_sampled_tis") or (
    method.startswith("grpo_") and method in METHODS
  )
  if corrected and not is_clip > (1 if method.startswith("grpo") else 0):
    raise ValueError(f"method {method} needs is_clip > 0 (> 1 for grpo), got {is_clip!r}")
  if method.startswith("grpo") and not 0 < grpo_temperature <= 1:
    raise ValueError(f"grpo_temperature must be in (0, 1], got {grpo_temperature!r}")
  if method.startswith("grpo") and not grpo_kl_coef >= 0:
    raise ValueError(f"grpo_kl_coef must be >= 0, got {grpo_kl_coef!r}")
  if method == "opd":
    return {}
  if method in ("opd_sampled", "opd_sampled_tis"):
    return dict(SAMPLED_OPD, **{"train.is_clip": float(is_clip) if corrected else 0.0})
  if method == "rl":
    return {"train.loss": "reinforce", "train.lr": rl_lr, "train.is_clip": 0.0}
  if method == "rl_is":
    return {"train.loss": "reinforce", "train.lr": rl_lr, "train.is_clip": float(is_clip)}
  if method in METHODS and method.startswith("grpo"):
    if group_size < 2 or batch_size % group_size:
      raise ValueError(
        f"GRPO groups of {group_size} must be >= 2 and divide the run's {batch_size} "
        "completions per step"
      )
    return {
      "train.loss": "grpo",
      "train.lr": grpo_lr,
      "data.batch_size": batch_size // group_size,
      "rollout.samples_per_prompt": group_size,
      "rollout.temperature": float(grpo_temperature),
      "train.ppo_epochs": 1,
      "train.ppo_minibatches": 2,
      "train.mismatch_correction": method.removeprefix("grpo_") if corrected else "none",
      "train.mismatch_clip": float(is_clip) if corrected else 2.0,
      "train.kl_coef": float(grpo_kl_coef),
    }
  raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")


# The keys the OPD and GRPO base runs must agree on (`check_shared`): the teacher, the student
# and its warm start, the task and its prompts, the model seed and the run length.
SHARED_PREFIXES = ("teacher.", "student.", "data.")
SHARED_KEYS = ("seed", "train.steps", "train.eval_every")
NOT_SHARED = ("data.batch_size", "teacher.cache_dir")  # GRPO's prompts per step; where it is kept


def grpo_correction(method: str, is_clip: float) -> dict[str, Any]:
  """The overrides that add `method`'s engine correction to a GRPO base run: none for "grpo",
  else train.mismatch_correction = the method's suffix at threshold C = `is_clip`.

  Raises:
    ValueError: a method that is not a GRPO arm, or C <= 1 for a correction.
  """
  if not (method.startswith("grpo") and method in METHODS):
    raise ValueError(f"{method!r} is not a GRPO arm; known: {', '.join(METHODS)}")
  if method == "grpo":
    return {"train.mismatch_correction": "none"}
  if not is_clip > 1:
    raise ValueError(f"method {method} needs is_clip > 1, got {is_clip!r}")
  return {
    "train.mismatch_correction": method.removeprefix("grpo_"),
    "train.mismatch_clip": float(is_clip),
  }


def check_shared(run: ml_collections.ConfigDict, grpo_run: ml_collections.ConfigDict) -> None:
  """Refuses a GRPO base run that does not share the OPD run's teacher, warm start, prompts
  and length (SHARED_PREFIXES and SHARED_KEYS, less NOT_SHARED), or that is not GRPO.

  Raises:
    ValueError: naming the keys that differ (at most eight), or grpo_run's train.loss.
  """
  if grpo_run.train.loss != "grpo":
    raise ValueError(f"config.grpo_run.train.loss is {grpo_run.train.loss!r}, not 'grpo'")
  a, b = runs.config_repr(run), runs.config_repr(grpo_run)
  keys = sorted(
    k
    for k in set(a) | set(b)
    if (k.startswith(SHARED_PREFIXES) or k in SHARED_KEYS) and k not in NOT_SHARED
  )
  differ = [k for k in keys if a.get(k) != b.get(k)]
  if differ:
    raise ValueError(
      "config.grpo_run must share the OPD run's teacher, warm start, prompts and length; "
      "differs in: " + ", ".join(f"{k} ({a.get(k)} vs {b.get(k)})" for k in differ[:8])
    )


def grpo_recipe(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The GRPO arms' lr, group size, temperature, KL coefficient and completions per step: read
  off `config.grpo_run` when the config has one, else the config's keys (their defaults)."""
  grpo_run = config.get("grpo_run", None)
  if grpo_run is not None:
    return {
      "grpo_recipe": config.get("grpo_recipe", ""),
      "grpo_lr": grpo_run.train.lr,
      "group_size": grpo_run.rollout.samples_per_prompt,
      "grpo_temperature": grpo_run.rollout.temperature,
      "grpo_kl_coef": grpo_run.train.kl_coef,
      "grpo_completions": grpo_run.data.batch_size * grpo_run.rollout.samples_per_prompt,
    }
  return {
    "grpo_lr": config.get("grpo_lr", GRPO_LR),
    "group_size": config.get("group_size", GROUP_SIZE),
    "grpo_temperature": config.get("grpo_temperature", 1.0),
    "grpo_kl_coef": config.get("grpo_kl_coef", 0.0),
    "grpo_completions": config.run.data.batch_size * config.run.rollout.samples_per_prompt,
  }
