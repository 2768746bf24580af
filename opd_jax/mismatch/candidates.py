"""Candidates: rollout configurations named in the config's own terms, and their sources.

A candidate is a comma-separated list of `rollout.<key>=<value>` overrides
(`--candidate=rollout.weights=fp8,rollout.kv_cache=fp8`), applied to a copy of the run config
and validated like any config (`parse_candidate`), so a misspelt key gets the same "did you
mean" as `main`. Its mismatch sources (`candidate_source`, `source_parts`: "noise",
"stale+fp8_kv") decide which of a budget's per-source limits it is held to.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
from typing import Any

import jax.numpy as jnp
import ml_collections
from absl import flags as absl_flags
from ml_collections.config_flags import tuple_parser

from opd_jax.config import check as config_check
from opd_jax.inference import transform
from opd_jax.mismatch import budget as budget_lib
from opd_jax.train import setup as setup_lib

CANDIDATE_PREFIX = "rollout."


# Which override makes a candidate belong to which mismatch source (the budget's per-source
# limits), checked in this order.
SOURCE_OF_KEY = (
  ("rollout.noise_sigma", "noise"),
  ("rollout.stale_k", "stale"),
  ("rollout.max_lag", "stale"),
  ("rollout.weights", "fp8_weights"),
  ("rollout.kv_cache", "fp8_kv"),
  ("rollout.kernel", "kernel"),
)


# A cast to bf16 is not FP8: it is a source of its own (with no fit, the pooled budget applies).
CAST_SOURCES = {
  ("rollout.weights", "bf16"): "bf16_weights",
  ("rollout.kv_cache", "bf16"): "bf16_kv",
}


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One parsed candidate.

  Attributes:
    spec: the text as given.
    overrides: dotted key -> parsed value, in the order given.
    config: a copy of the run config with the overrides applied, validated.
    engine_cfg: the engine the trainer would build from `config` (`setup_lib.engine_config`).
    lag: k, the weight-version lag it samples with: rollout.stale_k (sync) or rollout.max_lag
      (async).
  """

  spec: str
  overrides: dict[str, Any]
  config: ml_collections.ConfigDict
  engine_cfg: transform.EngineConfig
  lag: int

  @property
  def engine_id(self) -> str:
    return self.engine_cfg.engine_id


def split_spec(spec: str) -> list[str]:
  """Splits "a=1,b=(0,1),c=x" at the commas outside brackets: ["a=1", "b=(0,1)", "c=x"]."""
  parts, depth, current = [], 0, []
  for ch in spec:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
      if depth < 0:
        raise ValueError(f"candidate {spec!r}: unbalanced {ch!r}")
    if ch == "," and depth == 0:
      parts.append("".join(current))
      current = []
    else:
      current.append(ch)
  if depth:
    raise ValueError(f"candidate {spec!r}: unbalanced brackets")
  parts.append("".join(current))
  return [p.strip() for p in parts]


def _literal(raw: str):
  """A value of unknown type, as ml_collections parses one: a Python literal, else the text."""
  if raw in ("true", "false"):
    raw = raw.capitalize()
  try:
    return ast.literal_eval(raw)
  except (SyntaxError, ValueError):
    return raw


def parse_value(raw: str, current):
  """Parses `raw` as ml_collections' `--config.key=raw` would for a field now holding `current`.

  int, float and bool fields use absl's parsers ("1" becomes 1.0 for a float field), tuple
  fields `ast.literal_eval` with a single value wrapped ("0" -> (0,), "(0,1)" -> (0, 1)), str
  fields keep the text; a field of another type (or an unknown key) takes a Python literal,
  else the text.

  Raises:
    ValueError: the text does not parse as the field's type.
  """
  parsers = (
    (bool, absl_flags.BooleanParser()),
    (int, absl_flags.IntegerParser()),
    (float, absl_flags.FloatParser()),
    (tuple, tuple_parser.TupleParser()),
  )
  for kind, parser in parsers:
    if isinstance(current, kind):
      return parser.parse(raw)
  if isinstance(current, str):
    return raw
  return _literal(raw)


def _refuse_non_rollout(spec: str, key: str) -> None:
  rollout_keys = [k for k in config_check.RULES if k.startswith(CANDIDATE_PREFIX)]
  near = difflib.get_close_matches(key, rollout_keys, n=1, cutoff=0.8)
  if near:
    raise ValueError(f"candidate {spec!r}: unknown key {key!r}; did you mean {near[0]!r}?")
  raise ValueError(
    f"candidate {spec!r}: {key!r} is not a rollout setting; a candidate is a rollout "
    f"configuration, so only rollout.* keys may be set (allowed: {', '.join(rollout_keys)}). "
    "Other settings change the student, the teacher or the training, which the budget is "
    "calibrated for: pass them to --config instead"
  )


def candidate_lag(config: ml_collections.ConfigDict) -> int:
  """k: rollout.stale_k in sync mode, rollout.max_lag in async mode (its worst batches)."""
  r = config.rollout
  return int(r.max_lag) if r.mode == "async" else int(r.stale_k)


def parse_candidate(spec: str, config: ml_collections.ConfigDict) -> Candidate:
  """Parses one candidate against the run config.

  Args:
    spec: comma-separated `rollout.<key>=<value>` overrides, e.g.
      "rollout.weights=fp8,rollout.kv_cache=fp8,rollout.kv_granularity=tensor" or
      "rollout.bf16_layers=(0,),rollout.weights=fp8". Values parse as ml_collections parses
      `--config.<key>=<value>` (`parse_value`).
    config: the run config (not modified).

  Returns:
    A Candidate.

  Raises:
    ValueError: an empty or malformed spec, a key set twice, a non-rollout key, an unknown key
      (with the nearest valid one), or a value `config_check.validate` refuses (naming the key
      and what is allowed).
  """
  if not spec or not spec.strip():
    raise ValueError("empty candidate; give rollout.<key>=<value>[,rollout.<key>=<value> ...]")
  overrides: dict[str, Any] = {}
  raw_items = []
  for item in split_spec(spec):
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
      raise ValueError(
        f"candidate {spec!r}: {item!r} is not <key>=<value> (a tuple value keeps its commas "
        "inside brackets: rollout.bf16_layers=(0,1))"
      )
    if key.startswith("config."):
      key = key[len("config.") :]
    if key in [k for k, _ in raw_items]:
      raise ValueError(f"candidate {spec!r}: {key!r} is set twice")
    if not key.startswith(CANDIDATE_PREFIX):
      _refuse_non_rollout(spec, key)
    raw_items.append((key, raw.strip()))

  candidate_config = ml_collections.ConfigDict(config.to_dict())  # unlocked deep copy
  for key, raw in raw_items:
    leaf = key[len(CANDIDATE_PREFIX) :]
    if "." in leaf:
      raise ValueError(f"candidate {spec!r}: {key!r} is not a rollout setting (nested key)")
    current = candidate_config.rollout.get(leaf)
    try:
      value = parse_value(raw, current)
    except ValueError as e:
      raise ValueError(f"candidate {spec!r}: {key}={raw!r}: {e}") from e
    try:
      candidate_config.rollout[leaf] = value
    except TypeError as e:  # ConfigDict refuses a value of another type than the field's
      raise ValueError(f"candidate {spec!r}: {key}={raw!r}: {e}") from e
    overrides[key] = candidate_config.rollout[leaf]
  try:
    config_check.validate(candidate_config)
  except ValueError as e:
    raise ValueError(f"candidate {spec!r}: {e}") from e
  compute_dtype = jnp.dtype(config.student.dtype).name
  return Candidate(
    spec=spec,
    overrides=overrides,
    config=candidate_config,
    engine_cfg=setup_lib.engine_config(candidate_config, compute_dtype),
    lag=candidate_lag(candidate_config),
  )


def candidate_source(candidate: Candidate, reference: ml_collections.ConfigDict) -> str:
  """The mismatch sources a candidate changes against the config it modifies (`config_source`)."""
  return config_source(candidate.config, reference, candidate.lag)


# Which source a candidate key belongs to when a combination is split into its parts
# (`source_parts`): each source's own key (SOURCE_OF_KEY) and the keys that only qualify it; a
# key not listed here goes with every part.
PART_OF_KEY = {
  **dict(SOURCE_OF_KEY),
  "rollout.mode": "stale",
  "rollout.weight_block_size": "fp8_weights",
  "rollout.bf16_layers": "fp8_weights",
  "rollout.kv_granularity": "fp8_kv",
}


def source_parts(candidate: Candidate, reference: ml_collections.ConfigDict) -> dict[str, str]:
  """A combination's parts: source -> the candidate spec of that source's overrides alone
  (with the overrides no source owns), in the candidate's source order; {} when the candidate
  changes fewer than two sources. What `budget.admit(..., per_part=True)` holds each source's
  limit against, measured as "mismatch/kl/part/<source>".

  Raises:
    ValueError: a part that is not one source of the candidate's own (a key PART_OF_KEY puts
      with the wrong group).
  """
  sources = candidate_source(candidate, reference).split("+")
  if len(sources) < 2:
    return {}
  groups: dict[str, list[str]] = {}
  shared = []
  for item in split_spec(candidate.spec):
    key = item.partition("=")[0].strip().removeprefix("config.")
    owner = PART_OF_KEY.get(key)
    if owner is None:
      shared.append(item.strip())
    else:
      groups.setdefault(owner, []).append(item.strip())
  parts = {}
  for items in groups.values():
    spec = ",".join(items + shared)
    source = candidate_source(parse_candidate(spec, reference), reference)
    if source not in sources:
      raise ValueError(
        f"candidate {candidate.spec!r}: its part {spec!r} changes {source!r}, not one of "
        f"its sources {sources}"
      )
    parts[source] = spec
  return {s: parts[s] for s in sources if s in parts}


def config_source(config, reference, lag: int) -> str:
  """The mismatch sources `config` changes against `reference`, "+"-joined in SOURCE_OF_KEY
  order ("noise+stale"), or "reference" when it changes none of them. Staleness is the lag
  the engine trains with (`lag` > 0: stale_k, or an async engine's lag bound), whatever the
  reference's own mode."""
  found = []
  for key, source in SOURCE_OF_KEY:
    section, leaf = key.split(".")
    value = config[section][leaf]
    changed = lag > 0 if source == "stale" else value != reference[section][leaf]
    source = CAST_SOURCES.get((key, value), source)
    if changed and source not in found:
      found.append(source)
  return "+".join(found) or budget_lib.REFERENCE_SOURCE
