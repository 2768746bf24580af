"""Candidates: rollout configurations named in the config's own terms, and their sources.

A candidate is a comma-separated list of `rollout.<key>=<value>` overrides
(`--candidate=rollout.weights=fp8,rollout.kv_cache=fp8`), applied to a copy of the run config
and validated like any config (`parse_candidate`), so a misspelt key gets the same "did you
mean" as `main`. A tuple of strings may be typed unquoted (`rollout.noise_modules=(mlp, o)`).

Sources by what the engine does. A candidate's mismatch sources ("noise", "stale+fp8_kv") are
read from the difference between its engine and the trainer's (`engine_sources`), not from the
keys that were typed: the engine is `train.setup.engine_config` of its config (an
`inference.transform.EngineConfig`) plus its weight-version lag k (`candidate_lag`), and the
trainer's engine is the identity transform with the KV cache in the trainer's compute dtype and
k = 0 (`reference_engine`). Every field of the engine belongs to one source (ENGINE_SOURCES,
with a test that fails when EngineConfig gains a field it does not map):

  weights format and recipe   weights, weight_block_size, weight_group_size,   "<format>_weights"
                              weight_per_tensor, bf16_layers
  KV cache format             kv.dtype, kv.granularity, kv.bf16_layers,        "<format>_kv"
                              kv.tensor_headroom
  weight noise                noise_sigma, noise_layers, noise_modules         "noise"
  kernel                      kernel                                           "kernel"
  output head                 head_dtype                                       "bf16_head"
  staleness                   k > 0 (rollout.stale_k, or max_lag in async)     "stale"

A qualifier counts only where it acts (ACTIVE_WHEN: a block size only for quantized weights, a
KV granularity only for a quantized cache), and the KV cache is a source only when it is stored
below the engine's own compute dtype (a bf16-cast engine keeps its cache in bf16 under
`kv_cache=auto`: that is the cast's, not a KV source). A difference in a field no source owns,
or a format no source is named for, is refused with a message saying so. The sources are
"+"-joined in SOURCE_ORDER; a candidate whose engine is the trainer's is "reference".
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import ml_collections

from opd_jax.config import check as config_check
from opd_jax.config import values
from opd_jax.inference import transform
from opd_jax.mismatch import budget as budget_lib
from opd_jax.model import kvcache
from opd_jax.train import setup as setup_lib

CANDIDATE_PREFIX = "rollout."

# Roles of the engine's fields; the WEIGHTS and KV roles' source names depend on the format
# (WEIGHT_SOURCES, KV_SOURCES), the others are their source's name.
WEIGHTS, KV, NOISE, KERNEL, STALE = "weights", "kv", "noise", "kernel", "stale"
HEAD = "bf16_head"  # the output head (final norm, LM head, logits) below the trainer's f32

# Each field of EngineConfig (nested dataclasses as "kv.<field>") -> the role it belongs to.
ENGINE_SOURCES = {
  "weights": WEIGHTS,
  "weight_block_size": WEIGHTS,
  "bf16_layers": WEIGHTS,
  "weight_group_size": WEIGHTS,
  "weight_per_tensor": WEIGHTS,
  "head_dtype": HEAD,
  "noise_sigma": NOISE,
  "noise_layers": NOISE,
  "noise_modules": NOISE,
  "kernel": KERNEL,
  "kv.dtype": KV,
  "kv.granularity": KV,
  "kv.bf16_layers": KV,
  "kv.tensor_headroom": KV,
}

# The source a weights format is (EngineConfig.weights; "trainer" is no source).
WEIGHT_SOURCES = {
  "bf16": "bf16_weights",
  "fp8": "fp8_weights",
  "fp8_e5m2": "fp8_e5m2_weights",
  "int8": "int8_weights",
  "int4": "int4_weights",
  "fp4": "fp4_weights",
}

# The source a KV cache dtype is when it is below the engine's compute dtype.
KV_SOURCES = {
  "bfloat16": "bf16_kv",
  "float16": "fp16_kv",
  "float8_e4m3fn": "fp8_kv",
  "float8_e5m2": "fp8_e5m2_kv",
  "float4_e2m1fn": "fp4_kv",
}

# The roles in the order their sources are joined ("noise+stale+fp8_weights+fp8_kv+kernel").
SOURCE_ORDER = (NOISE, STALE, WEIGHTS, KV, KERNEL, HEAD)

# The rollout keys that set the weight-version lag: they belong to the "stale" source.
LAG_KEYS = ("rollout.stale_k", "rollout.max_lag", "rollout.mode", "rollout.max_ahead")

_UNQUANTIZED = ("trainer", "bf16")
_FULL_KV = ("float32", "bfloat16", "float16")


def _quantized_weights(e: transform.EngineConfig) -> bool:
  return e.weights not in _UNQUANTIZED


def _quantized_kv(e: transform.EngineConfig) -> bool:
  return e.kv.dtype not in _FULL_KV


# A qualifier field -> when it acts; elsewhere its value changes nothing the engine does.
ACTIVE_WHEN: dict[str, Callable[[transform.EngineConfig], bool]] = {
  "weight_block_size": _quantized_weights,
  "bf16_layers": _quantized_weights,
  "weight_group_size": _quantized_weights,
  "weight_per_tensor": _quantized_weights,
  "noise_layers": lambda e: e.noise_sigma > 0,
  "noise_modules": lambda e: e.noise_sigma > 0,
  "kv.granularity": _quantized_kv,
  "kv.bf16_layers": _quantized_kv,
  "kv.tensor_headroom": lambda e: _quantized_kv(e) and e.kv.granularity == "tensor",
}

# The rollout overrides that switch a role off (the trainer's engine for it): a combination's
# part is measured with every other source switched off (`source_parts`).
SWITCH_OFF = {
  NOISE: {"noise_sigma": 0.0, "noise_layers": (), "noise_modules": ()},
  WEIGHTS: {"weights": "trainer"},
  KV: {"kv_cache": "auto"},
  KERNEL: {"kernel": "reference"},
  HEAD: {"head_dtype": "float32"},
  STALE: {"stale_k": 0, "max_lag": 0, "max_ahead": -1},
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
      `--config.<key>=<value>` (`values.parse_value`).
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
  for item in values.split_spec(spec):
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
      value = values.parse_value(raw, current)
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
    engine_cfg=setup_lib.engine_config(setup_lib.run_spec(candidate_config), compute_dtype),
    lag=candidate_lag(candidate_config),
  )


# Which source a rollout key's override belongs to when a combination is split into its parts
# (`source_parts`). The keys that change neither the engine nor the lag (NEUTRAL_KEYS) go with
# every part; a key in neither table is placed by what resetting it changes in the engine.
ROLE_OF_KEY = {
  "rollout.weights": WEIGHTS,
  "rollout.weight_block_size": WEIGHTS,
  "rollout.bf16_layers": WEIGHTS,
  "rollout.weight_group_size": WEIGHTS,
  "rollout.weight_per_tensor": WEIGHTS,
  "rollout.head_dtype": HEAD,
  "rollout.kv_cache": KV,
  "rollout.kv_granularity": KV,
  "rollout.kv_bf16_layers": KV,
  "rollout.noise_sigma": NOISE,
  "rollout.noise_layers": NOISE,
  "rollout.noise_modules": NOISE,
  "rollout.kernel": KERNEL,
  "rollout.stale_policy": STALE,
  **dict.fromkeys(LAG_KEYS, STALE),
}
NEUTRAL_KEYS = (
  "rollout.temperature",
  "rollout.top_k",
  "rollout.top_p",
  "rollout.max_new_tokens",
  "rollout.producer_timeout_s",
  "rollout.score_teacher",
  "rollout.samples_per_prompt",
  "rollout.mesh_data",
  "rollout.mesh_fsdp",
  "rollout.mesh_tensor",
  "rollout.devices",
  "rollout.dispatch",
  "rollout.decode_attention",  # a numerical path, equal to f32 rounding (test_pallas_decode.py)
)


def compute_dtype(config: ml_collections.ConfigDict) -> str:
  """The trainer's compute dtype name (`config.student.dtype`)."""
  return jnp.dtype(config.student.dtype).name


def reference_engine(config: ml_collections.ConfigDict) -> transform.EngineConfig:
  """The trainer's own engine for `config`'s student: the identity transform, the reference
  kernel, no noise, the KV cache in the trainer's compute dtype (lag 0)."""
  return transform.EngineConfig(kv=kvcache.KVCacheSpec(dtype=compute_dtype(config)))


def engine_fields(engine) -> dict[str, Any]:
  """Every field of an EngineConfig, nested dataclasses flattened as "<field>.<sub>"."""
  out = {}
  for field in dataclasses.fields(engine):
    value = getattr(engine, field.name)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
      out.update({f"{field.name}.{k}": v for k, v in engine_fields(value).items()})
    else:
      out[field.name] = value
  return out


def _engine_dtype(engine: transform.EngineConfig, trainer_dtype: str) -> str:
  """The dtype the engine computes in: bf16 for a bf16 cast, else the trainer's."""
  return "bfloat16" if engine.weights == "bf16" else trainer_dtype


def effective_fields(engine: transform.EngineConfig, trainer_dtype: str) -> dict[str, Any]:
  """`engine_fields` with what changes nothing the engine does put back to its default: a
  qualifier where it does not act (ACTIVE_WHEN), and a KV dtype equal to the engine's own
  compute dtype (shown as None: no KV source)."""
  fields = engine_fields(engine)
  defaults = engine_fields(transform.EngineConfig())
  for name, active in ACTIVE_WHEN.items():
    if name in fields and not active(engine):
      fields[name] = defaults[name]
  if fields.get("kv.dtype") == _engine_dtype(engine, trainer_dtype):
    fields["kv.dtype"] = None
  return fields


def _role_source(role: str, engine: transform.EngineConfig) -> str:
  """The source name of `role` for `engine` (ValueError for a format no source is named for)."""
  if role == WEIGHTS:
    if engine.weights not in WEIGHT_SOURCES:
      raise ValueError(
        f"the engine's weights format {engine.weights!r} belongs to no known mismatch source "
        f"(known: {', '.join(WEIGHT_SOURCES)}); name its source in candidates.WEIGHT_SOURCES"
      )
    return WEIGHT_SOURCES[engine.weights]
  if role == KV:
    if engine.kv.dtype not in KV_SOURCES:
      raise ValueError(
        f"the engine's KV cache dtype {engine.kv.dtype!r} belongs to no known mismatch source "
        f"(known: {', '.join(KV_SOURCES)}); name its source in candidates.KV_SOURCES"
      )
    return KV_SOURCES[engine.kv.dtype]
  return role


def engine_roles(
  engine: transform.EngineConfig,
  lag: int,
  reference: transform.EngineConfig,
  trainer_dtype: str | None = None,
) -> list[str]:
  """The roles (SOURCE_ORDER) in which `engine` with lag k differs from `reference` (lag 0),
  both read by `effective_fields` with the trainer's compute dtype (default: the reference's KV
  dtype, which it is for `reference_engine`).

  Raises:
    ValueError: a field that differs and that no source owns (ENGINE_SOURCES), naming it.
  """
  trainer_dtype = trainer_dtype or reference.kv.dtype
  mine = effective_fields(engine, trainer_dtype)
  theirs = effective_fields(reference, trainer_dtype)
  changed = [name for name in mine if mine[name] != theirs.get(name)]
  unowned = [name for name in changed if name not in ENGINE_SOURCES]
  if unowned:
    raise ValueError(
      f"the engine {engine.engine_id!r} differs from the trainer's in "
      f"{', '.join(f'{n}={mine[n]!r}' for n in unowned)}, which belongs to no known mismatch "
      "source, so no budget limit applies to it; map the field in candidates.ENGINE_SOURCES"
    )
  roles = {ENGINE_SOURCES[name] for name in changed}
  if lag > 0:
    roles.add(STALE)
  unordered = sorted(roles - set(SOURCE_ORDER))
  return [r for r in SOURCE_ORDER if r in roles] + unordered


def engine_sources(
  engine: transform.EngineConfig, lag: int, reference: transform.EngineConfig
) -> str:
  """The mismatch sources of `engine` with weight-version lag k against the trainer's engine
  `reference` (module docstring), "+"-joined in SOURCE_ORDER, or "reference" when none.

  Raises:
    ValueError: a difference that belongs to no known source (a field ENGINE_SOURCES does not
      map, or a weights or KV format that WEIGHT_SOURCES or KV_SOURCES does not name).
  """
  sources = [_role_source(r, engine) for r in engine_roles(engine, lag, reference)]
  return "+".join(dict.fromkeys(sources)) or budget_lib.REFERENCE_SOURCE


def config_source(config: ml_collections.ConfigDict) -> str:
  """The mismatch sources of the engine a run config builds (`setup.engine_config`, lag
  `candidate_lag`) against the trainer's (`reference_engine`)."""
  engine = setup_lib.engine_config(setup_lib.run_spec(config), compute_dtype(config))
  return engine_sources(engine, candidate_lag(config), reference_engine(config))


def candidate_source(candidate: Candidate) -> str:
  """The mismatch sources of a candidate's engine against the trainer's (`engine_sources`)."""
  return engine_sources(candidate.engine_cfg, candidate.lag, reference_engine(candidate.config))


def _key_roles(key: str, candidate: Candidate, base: ml_collections.ConfigDict) -> set[str]:
  """The roles an override of `key` belongs to: ROLE_OF_KEY, none for NEUTRAL_KEYS, else the
  roles whose engine fields change when the key is put back to the base config's value."""
  if key in ROLE_OF_KEY:
    return {ROLE_OF_KEY[key]}
  if key in NEUTRAL_KEYS:
    return set()
  leaf = key[len(CANDIDATE_PREFIX) :]
  probe = ml_collections.ConfigDict(candidate.config.to_dict())
  probe.rollout[leaf] = base.rollout[leaf]
  try:
    engine = setup_lib.engine_config(setup_lib.run_spec(probe), compute_dtype(probe))
  except ValueError as e:
    raise ValueError(
      f"candidate {candidate.spec!r}: cannot tell which source {key} belongs to ({e}); add it "
      "to candidates.ROLE_OF_KEY"
    ) from e
  roles = set(engine_roles(candidate.engine_cfg, candidate.lag, engine, compute_dtype(probe)))
  return roles | ({STALE} if candidate_lag(probe) != candidate.lag else set())


def source_parts(candidate: Candidate, base: ml_collections.ConfigDict) -> dict[str, str]:
  """A combination's parts: source -> the candidate spec (against `base`, the config the
  candidate modifies) of that source alone, in the candidate's source order; {} when the
  candidate has fewer than two sources. What the per_part and sum_of_fractions rules read,
  measured as "mismatch/kl/part/<source>".

  The part of source s holds the candidate's overrides of s (ROLE_OF_KEY), those of no source
  (NEUTRAL_KEYS), and the overrides that switch off each other source the base config itself
  has (SWITCH_OFF: a noise part on an async base sets max_lag=0), so that it changes s alone.

  Raises:
    ValueError: a part that does not come out as source s alone (naming the part).
  """
  sources = candidate_source(candidate).split("+")
  if len(sources) < 2:
    return {}
  roles = engine_roles(candidate.engine_cfg, candidate.lag, reference_engine(candidate.config))
  base_roles = [r for r in engine_roles_of(base) if r in SWITCH_OFF]
  groups: dict[str, list[str]] = {r: [] for r in roles}
  shared = []
  for item in values.split_spec(candidate.spec):
    key = item.partition("=")[0].strip().removeprefix("config.")
    owners = _key_roles(key, candidate, base)
    if not owners:
      shared.append(item.strip())
    for role in owners & set(groups):
      groups[role].append(item.strip())
  parts = {}
  for role, items in groups.items():
    typed = {it.partition("=")[0].strip().removeprefix("config.") for it in items + shared}
    off = [
      f"rollout.{k}={_spec_value(v)}"
      for r in base_roles
      if r != role
      for k, v in SWITCH_OFF[r].items()
      if f"rollout.{k}" not in typed and base.rollout.get(k) != v and k in base.rollout
    ]
    # A part the base config alone gives (its own staleness, say): a no-op override names it.
    spec = ",".join(items + shared + off) or f"rollout.mode={base.rollout.mode}"
    source = candidate_source(parse_candidate(spec, base))
    if source != _role_source(role, candidate.engine_cfg):
      raise ValueError(
        f"candidate {candidate.spec!r}: its part {spec!r} changes {source!r}, not "
        f"{_role_source(role, candidate.engine_cfg)!r} alone"
      )
    parts[source] = spec
  return {s: parts[s] for s in sources if s in parts}


def engine_roles_of(config: ml_collections.ConfigDict) -> list[str]:
  """The roles of the engine a run config builds against the trainer's (`engine_roles`)."""
  engine = setup_lib.engine_config(setup_lib.run_spec(config), compute_dtype(config))
  return engine_roles(engine, candidate_lag(config), reference_engine(config))


def _spec_value(value) -> str:
  """A value as a candidate spec writes it: tuples as "(a, b)", others by str."""
  if isinstance(value, tuple):
    return "(" + ", ".join(str(v) for v in value) + ("," if len(value) == 1 else "") + ")"
  return str(value)
