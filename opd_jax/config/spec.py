"""The run spec: a validated run config as one frozen dataclass tree (docs/design.md, "The
run spec").

`RunSpec` mirrors `configs/base.py` block for block and key for key (`configs/base.py` keeps
the defaults and the meaning of every field; `check.RULES` their allowed values); the
ConfigDict is read once, after `check.validate`, by `train.setup.run_spec`. Every layer below
the trainer takes the spec or the sub-spec it needs, never the ConfigDict. `derive` builds a
typed settings dataclass (`ModelConfig`, `EngineConfig`, `SamplerConfig`, `LossConfig`) from
a sub-spec's fields of the same name, so a field is never copied by hand.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")
frozen = dataclasses.dataclass(frozen=True)


@frozen
class MeshSpec:
  data: int
  fsdp: int
  tensor: int


@frozen
class ArchSpec:
  model_type: str
  num_layers: int
  hidden_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  tie_word_embeddings: bool


@frozen
class StudentSpec:
  checkpoint: str
  dtype: str
  arch: ArchSpec
  warmup_steps: int
  warmup_lr: float
  warmup_batch_size: int


@frozen
class TeacherSpec:
  checkpoint: str
  dtype: str
  arch: ArchSpec
  pretrain_steps: int
  pretrain_lr: float
  pretrain_batch_size: int
  target_accuracy: float
  max_pretrain_steps: int
  target_eval_size: int
  cache_dir: str
  temperature: float


@frozen
class DataSpec:
  prompt_file: str
  task: str
  num_operands: int
  max_operand: int
  train_size: int
  eval_size: int
  batch_size: int
  max_prompt_tokens: int
  overlong: str
  eval_file: str
  eval_metric: Any  # "exact_match" | "none" | "package.module:function" (or a callable)


@frozen
class RolloutSpec:
  weights: str
  weight_block_size: int
  weight_group_size: int
  weight_per_tensor: bool
  bf16_layers: tuple
  head_dtype: str
  kv_cache: str
  kv_granularity: str
  kv_bf16_layers: tuple
  noise_sigma: float
  noise_layers: tuple
  noise_modules: tuple
  kernel: str
  decode_attention: str
  temperature: float
  top_k: int
  top_p: float
  max_new_tokens: int
  mode: str
  max_lag: int
  max_ahead: int
  stale_policy: str
  producer_timeout_s: float
  dispatch: str
  devices: int
  score_teacher: bool
  stale_k: int
  mesh_data: int
  mesh_fsdp: int
  mesh_tensor: int
  samples_per_prompt: int


@frozen
class TrainSpec:
  steps: int
  stop_after: int
  seed: int
  loss: str
  is_clip: float
  reward: str
  group_std_normalize: bool
  ppo_clip: float
  ppo_epochs: int
  ppo_minibatches: int
  mismatch_correction: str
  mismatch_clip: float
  kl_coef: float
  advantage_clip: float
  advantage_baseline: str
  jsd_beta: float
  mismatch_top_k: int
  mismatch_bucket_tokens: int
  mismatch_cross_kl: float
  lr: float
  warmup_steps: int
  weight_decay: float
  grad_clip: float
  log_every: int
  eval_every: int
  eval_sampled: bool
  checkpoint_every: int
  keep_checkpoints: int
  resume_schedule: str
  microbatches: int
  remat: str
  on_policy_fraction: float
  teacher_top_k: int


@frozen
class BudgetSpec:
  file: str
  action: str
  patience: int
  smoothing: float
  recheck_every: int
  prompts: int
  conservative: bool
  per_source: bool
  force: bool
  extrapolate: str


@frozen
class ExportSpec:
  dir: str


@frozen
class LogSpec:
  wandb_project: str


@frozen
class RunSpec:
  """A validated run config (`configs/base.py` documents every field)."""

  seed: int
  tokenizer: str
  mesh: MeshSpec
  student: StudentSpec
  teacher: TeacherSpec
  data: DataSpec
  rollout: RolloutSpec
  train: TrainSpec
  budget: BudgetSpec
  export: ExportSpec
  log: LogSpec
  # Every config key with the repr of its value as the ConfigDict held it, in its order: what
  # a checkpoint records (`io.run_history.run_fingerprint`), unchanged by the spec's tuples.
  values: tuple[tuple[str, str], ...] = ()


def from_mapping(cls: type[T], block: Any) -> T:
  """`cls` (a spec dataclass) from `block`, a mapping with a key per field (a ConfigDict
  block): nested spec fields recursively, lists as tuples."""
  kwargs = {}
  for field in dataclasses.fields(cls):
    if field.name == "values":
      continue
    value = block[field.name]
    if isinstance(field.type, str) and field.type in SUB_SPECS:
      value = from_mapping(SUB_SPECS[field.type], value)
    elif isinstance(value, list):
      value = tuple(value)
    kwargs[field.name] = value
  return cls(**kwargs)


def derive(cls: type[T], source: Any, **overrides) -> T:
  """`cls(**overrides)` with every other field of `cls` that `source` has (same name) taken
  from `source`; the fields `source` lacks keep `cls`'s defaults."""
  names = {f.name for f in dataclasses.fields(cls) if f.init} - set(overrides)
  taken = {n: getattr(source, n) for n in names if hasattr(source, n)}
  return cls(**taken, **overrides)


SUB_SPECS = {
  c.__name__: c
  for c in (
    MeshSpec,
    ArchSpec,
    StudentSpec,
    TeacherSpec,
    DataSpec,
    RolloutSpec,
    TrainSpec,
    BudgetSpec,
    ExportSpec,
    LogSpec,
  )
}
