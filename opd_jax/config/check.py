"""Validation of run configs before anything is built or compiled.

`RULES` is the schema: one entry per dotted key of `configs/base.py`. `validate`
rejects unknown keys (suggesting the nearest known one), wrong types, non-positive
sizes, out-of-range values and unknown choices, naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import ml_collections

# `data.eval_metric`: a built-in scorer (`data.scoring`) or "package.module:function".
BUILTIN_METRICS = ("exact_match", "none")
_PATH_RE = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*")


def is_import_path(metric: str) -> bool:
  """Whether `metric` has the form "package.module:function"."""
  return bool(_PATH_RE.fullmatch(metric))


def metric_problem(metric: Any) -> str | None:
  """What is wrong with a `data.eval_metric` value's form (not its import), or None."""
  if not isinstance(metric, str):
    return f"must be a string, got {metric!r}"
  if metric in BUILTIN_METRICS or is_import_path(metric):
    return None
  return (
    f"must be one of {', '.join(BUILTIN_METRICS)} or an import path 'package.module:function'; "
    f"got {metric!r}"
  )


@dataclasses.dataclass(frozen=True)
class Num:
  """An int (or float when `is_float`) in [lo, hi] (exclusive bounds when asked)."""

  is_float: bool = False
  lo: float | None = None
  hi: float | None = None
  lo_open: bool = False

  def check(self, value) -> str | None:
    kinds = (int, float) if self.is_float else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds):
      return f"must be {'a number' if self.is_float else 'an int'}, got {value!r}"
    if self.is_float and not math.isfinite(value):
      return f"must be finite, got {value!r}"
    if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
      return f"must be {'>' if self.lo_open else '>='} {self.lo}, got {value!r}"
    if self.hi is not None and value > self.hi:
      return f"must be <= {self.hi}, got {value!r}"
    return None


@dataclasses.dataclass(frozen=True)
class Choice:
  options: tuple[str, ...]

  def check(self, value) -> str | None:
    if value not in self.options:
      return f"must be one of {', '.join(self.options)}; got {value!r}"
    return None


@dataclasses.dataclass(frozen=True)
class Choices:
  """A tuple (or list) of strings, each one of `options`."""

  options: tuple[str, ...]

  def check(self, value) -> str | None:
    items = list(value) if isinstance(value, (tuple, list)) else None
    if items is None or not all(isinstance(i, str) for i in items):
      return f"must be a tuple of strings, got {value!r}"
    bad = [i for i in items if i not in self.options]
    if bad:
      return f"has unknown {', '.join(map(repr, bad))}; allowed: {', '.join(self.options)}"
    return None


@dataclasses.dataclass(frozen=True)
class Kind:
  """A value of a plain type: str, bool, or a tuple of non-negative ints."""

  kind: type

  def check(self, value) -> str | None:
    if self.kind is tuple:
      items = list(value) if isinstance(value, (tuple, list)) else None
      if items is None or not all(isinstance(i, int) and i >= 0 for i in items):
        return f"must be a tuple of non-negative ints, got {value!r}"
      return None
    if not isinstance(value, self.kind):
      return f"must be a {self.kind.__name__}, got {value!r}"
    return None


@dataclasses.dataclass(frozen=True)
class Rule:
  """A value checked by a function that says what is wrong with it, or returns None."""

  problem: Callable[[Any], str | None]

  def check(self, value) -> str | None:
    return self.problem(value)


POSITIVE = Num(lo=1)
NON_NEGATIVE = Num(lo=0)
DTYPES = Choice(("float32", "bfloat16"))
MESH_AXIS = Num(lo=-1)
ARCH = {
  "model_type": Choice(("llama", "qwen2", "qwen3")),
  "num_layers": POSITIVE,
  "hidden_size": POSITIVE,
  "num_heads": POSITIVE,
  "num_kv_heads": POSITIVE,
  "head_dim": POSITIVE,
  "intermediate_size": POSITIVE,
  "tie_word_embeddings": Kind(bool),
}

RULES: dict[str, Any] = {
  "seed": NON_NEGATIVE,
  "tokenizer": Kind(str),
  "mesh.data": MESH_AXIS,
  "mesh.fsdp": MESH_AXIS,
  "mesh.tensor": MESH_AXIS,
  "student.checkpoint": Kind(str),
  "student.dtype": DTYPES,
  **{f"student.arch.{k}": v for k, v in ARCH.items()},
  "student.warmup_steps": NON_NEGATIVE,
  "student.warmup_lr": Num(True, 0, lo_open=True),
  "student.warmup_batch_size": POSITIVE,
  "teacher.checkpoint": Kind(str),
  "teacher.dtype": DTYPES,
  **{f"teacher.arch.{k}": v for k, v in ARCH.items()},
  "teacher.pretrain_steps": NON_NEGATIVE,
  "teacher.pretrain_lr": Num(True, 0, lo_open=True),
  "teacher.pretrain_batch_size": POSITIVE,
  "teacher.target_accuracy": Num(True, 0, 1),
  "teacher.max_pretrain_steps": NON_NEGATIVE,
  "teacher.target_eval_size": POSITIVE,
  "teacher.cache_dir": Kind(str),
  "teacher.temperature": Num(True, 0, lo_open=True),  # τ_T (opd_jax/model/teacher_topk.py)
  "data.prompt_file": Kind(str),
  "data.task": Choice(("sum", "chain")),  # opd_jax/data/task.py KINDS
  "data.num_operands": Num(lo=2),
  "data.max_operand": POSITIVE,
  "data.train_size": POSITIVE,
  "data.eval_size": POSITIVE,
  "data.batch_size": POSITIVE,
  "data.max_prompt_tokens": NON_NEGATIVE,
  "data.overlong": Choice(("truncate_left", "drop", "error")),
  "data.eval_file": Kind(str),  # held-out JSONL (opd_jax/train/evaluate.py)
  "data.eval_metric": Rule(metric_problem),  # importable: checked by preflight
  "rollout.weights": Choice(("trainer", "bf16", "fp8", "fp8_e5m2", "int8", "int4", "fp4")),
  "rollout.weight_block_size": NON_NEGATIVE,
  "rollout.weight_group_size": NON_NEGATIVE,  # quantized weights (opd_jax/model/quant.py)
  "rollout.weight_per_tensor": Kind(bool),
  "rollout.head_dtype": Choice(("float32", "bfloat16")),  # model/quant.py HEAD_DTYPES
  "rollout.bf16_layers": Kind(tuple),
  "rollout.kv_cache": Choice(("auto", "bf16", "fp8", "fp8_e5m2", "fp4")),
  "rollout.kv_granularity": Choice(("token_head", "tensor")),
  "rollout.mesh_data": MESH_AXIS,  # 0 (all three) = the training mesh
  "rollout.mesh_fsdp": MESH_AXIS,
  "rollout.mesh_tensor": MESH_AXIS,
  "rollout.kv_bf16_layers": Kind(tuple),
  "rollout.noise_sigma": Num(True, 0),
  "rollout.noise_layers": Kind(tuple),
  "rollout.noise_modules": Choices(
    ("q", "k", "v", "o", "gate", "up", "down", "embed", "lm_head", "attention", "mlp", "embeddings")
  ),
  "rollout.kernel": Choice(("reference", "bf16_attention", "bf16_matmul")),
  # rollout.decode_attention: model.ATTENTIONS
  "rollout.decode_attention": Choice(("auto", "blockwise", "pallas", "reference")),
  "rollout.temperature": Num(True, 0),
  "rollout.top_k": NON_NEGATIVE,
  "rollout.top_p": Num(True, 0, 1, lo_open=True),
  "rollout.max_new_tokens": POSITIVE,
  "rollout.mode": Choice(("sync", "async")),
  "rollout.max_lag": NON_NEGATIVE,
  "rollout.max_ahead": Num(lo=-1),
  "rollout.stale_policy": Choice(("drop", "correct")),
  "rollout.producer_timeout_s": Num(True, 0, lo_open=True),
  "rollout.dispatch": Choice(("auto", "thread", "inline")),  # rollout/sources.py, Dispatch
  "rollout.devices": NON_NEGATIVE,  # set apart for rollouts (model/sharding.split_devices)
  "rollout.stale_k": NON_NEGATIVE,
  "rollout.score_teacher": Kind(bool),
  "rollout.samples_per_prompt": POSITIVE,
  "train.steps": POSITIVE,
  "train.stop_after": NON_NEGATIVE,
  "train.seed": Num(False, -1),
  "train.loss": Choice(
    ("reverse_kl_sampled", "reverse_kl_full", "forward_kl", "jsd", "reinforce", "grpo")
  ),
  "train.is_clip": Num(True),
  "train.group_std_normalize": Kind(bool),  # grpo (opd_jax/train/rl.py)
  "train.ppo_clip": Num(True, 0, 1, lo_open=True),  # grpo: ε
  "train.ppo_epochs": POSITIVE,  # grpo
  "train.ppo_minibatches": POSITIVE,  # grpo: divides B·n (_rl_errors)
  "train.mismatch_correction": Choice(("none", "tis", "mis", "seq_tis", "seq_mis")),  # grpo
  "train.mismatch_clip": Num(True, 1, lo_open=True),  # grpo: C > 1
  "train.reward": Choice(("exact_match", "partial", "step")),  # RL (opd_jax/data/rewards.py)
  "train.kl_coef": Num(True, 0),  # grpo only (_kl_coef_errors)
  "train.advantage_clip": Num(True, 0),
  "train.advantage_baseline": Choice(("none", "batch_mean")),
  "train.jsd_beta": Num(True, 0, 1),
  "train.mismatch_top_k": Num(lo=-1),
  "train.mismatch_bucket_tokens": NON_NEGATIVE,  # 0 = no position metrics
  "train.mismatch_cross_kl": Num(True, 0, lo_open=True),
  "train.lr": Num(True, 0, lo_open=True),
  "train.warmup_steps": NON_NEGATIVE,
  "train.weight_decay": Num(True, 0),
  "train.grad_clip": Num(True, 0, lo_open=True),
  "train.log_every": POSITIVE,
  "train.eval_every": NON_NEGATIVE,  # 0 = no evaluation
  "train.eval_sampled": Kind(bool),
  "train.checkpoint_every": POSITIVE,
  "train.keep_checkpoints": POSITIVE,
  "train.resume_schedule": Choice(("keep", "rebuild", "error")),
  "train.microbatches": POSITIVE,
  "train.remat": Choice(("none", "layer", "dots", "dots_no_batch")),  # model.REMAT_CHOICES
  "train.on_policy_fraction": Num(True, 0, 1),  # GKD's λ (opd_jax/rollout/off_policy.py)
  "train.teacher_top_k": NON_NEGATIVE,  # <= V checked at build (opd_jax/model/teacher_topk.py)
  "export.dir": Kind(str),
  "log.wandb_project": Kind(str),
  "budget.file": Kind(str),
  "budget.action": Choice(("warn", "fallback", "adaptive")),
  "budget.patience": POSITIVE,
  "budget.smoothing": Num(True, 0),
  "budget.recheck_every": POSITIVE,
  "budget.prompts": POSITIVE,
  "budget.conservative": Kind(bool),
  "budget.per_source": Kind(bool),
  "budget.force": Kind(bool),
  "budget.extrapolate": Choice(("refuse", "pooled", "default")),
}


def flatten(config: ml_collections.ConfigDict, prefix: str = "") -> Iterator[tuple[str, Any]]:
  """Yields (dotted key, value) for every leaf of a nested ConfigDict."""
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from flatten(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}", value


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError listing every invalid key of `config`; returns None if valid."""
  errors = []
  seen = set()
  for key, value in flatten(config):
    seen.add(key)
    rule = RULES.get(key)
    if rule is None:
      depth = key.count(".") + 1
      candidates = {".".join(k.split(".")[:depth]) for k in RULES}
      near = difflib.get_close_matches(key, candidates, n=1)
      hint = f"; did you mean {near[0]!r}?" if near else ""
      errors.append(f"unknown config key {key!r}{hint}")
      continue
    problem = rule.check(value)
    if problem:
      errors.append(f"config.{key} {problem}")
  missing = sorted(set(RULES) - seen)
  if missing:
    errors.append(f"config is missing keys: {', '.join(missing)}")
  mesh = [config.mesh.data, config.mesh.fsdp, config.mesh.tensor] if "mesh" in config else []
  if mesh.count(-1) > 1:
    errors.append(f"config.mesh may have at most one -1 axis, got {mesh}")
  if any(v == 0 for v in mesh):
    errors.append(f"config.mesh axes must be positive or -1, got {mesh}")
  for who in ("student", "teacher"):
    arch = config.get(who, {}).get("arch")
    if arch is not None and arch.num_heads % arch.num_kv_heads:
      errors.append(
        f"config.{who}.arch.num_heads ({arch.num_heads}) must be a multiple of "
        f"num_kv_heads ({arch.num_kv_heads})"
      )
  errors += _rollout_mesh_errors(config)
  errors += _rollout_errors(config)
  errors += _weight_format_errors(config)
  errors += _rl_errors(config)
  errors += _kl_coef_errors(config)
  errors += _budget_errors(config)
  errors += _on_policy_fraction_errors(config)
  errors += _teacher_target_errors(config)
  if errors:
    raise ValueError("invalid config:\n  " + "\n  ".join(errors))


def _rollout_mesh_errors(config: ml_collections.ConfigDict) -> list[str]:
  """rollout.mesh_*: all 0 (the training mesh) or all set, with at most one -1."""
  r = config.get("rollout")
  if r is None or not {"mesh_data", "mesh_fsdp", "mesh_tensor"} <= set(r):
    return []
  shape = [r.mesh_data, r.mesh_fsdp, r.mesh_tensor]
  if shape == [0, 0, 0]:
    return []
  if 0 in shape or shape.count(-1) > 1:
    return [
      "config.rollout.mesh_data/mesh_fsdp/mesh_tensor must all be 0 (the training mesh) or "
      f"all be positive with at most one -1, got {shape}"
    ]
  return []


def _rollout_errors(config: ml_collections.ConfigDict) -> list[str]:
  """Combinations of rollout and loss settings that cannot work together."""
  r, t = config.get("rollout"), config.get("train")
  if r is None or t is None or not {"mode", "stale_policy", "stale_k"} <= set(r):
    return []
  errors = []
  if (
    r.mode == "async"
    and r.stale_policy == "correct"
    and (t.get("loss") != "reverse_kl_sampled" or not t.get("is_clip", 0) > 0)
  ):
    errors.append(
      "config.rollout.stale_policy='correct' trains stale batches with the truncated "
      "importance ratio, which only train.loss='reverse_kl_sampled' with train.is_clip > 0 "
      f"applies (got loss={t.get('loss')!r}, is_clip={t.get('is_clip')!r}); use "
      "stale_policy='drop'"
    )
  if r.mode == "async" and r.stale_k:
    errors.append(
      f"config.rollout.stale_k={r.stale_k} is the synchronous stale-k setting; in async mode "
      "staleness comes from rollout.max_lag (set stale_k=0)"
    )
  return errors


def _weight_format_errors(config: ml_collections.ConfigDict) -> list[str]:
  """The scale grouping of quantized weights: at most one of blocks, groups and per tensor,
  and a group for fp4 (its MX block). With unquantized weights (trainer, bf16) the grouping
  keys act on nothing, like bf16_layers, so that a fallback to bf16 keeps them."""
  r = config.get("rollout")
  keys = {"weights", "weight_block_size", "weight_group_size", "weight_per_tensor"}
  if r is None or not keys <= set(r) or r.weights in ("trainer", "bf16"):
    return []
  errors = []
  chosen = [
    f"{k}={r[k]!r}"
    for k in ("weight_block_size", "weight_group_size", "weight_per_tensor")
    if r[k] not in (0, False)
  ]
  if len(chosen) > 1:
    errors.append(
      f"config.rollout sets {' and '.join(chosen)}: choose one scale grouping for "
      f"rollout.weights={r.weights!r} (none of them = per output channel)"
    )
  if r.weights == "fp4" and not r.weight_group_size:
    errors.append(
      "config.rollout.weights='fp4' shares one power-of-two scale per block of inputs (MX): "
      "set rollout.weight_group_size (MXFP4 uses 32)"
    )
  return errors


def _rl_errors(config: ml_collections.ConfigDict) -> list[str]:
  """The RL baselines (train.loss='reinforce' or 'grpo') score the built-in task's answers on
  sampled rollouts: they need the task's prompts and a temperature above 0. GRPO also needs
  groups (rollout.samples_per_prompt >= 2), minibatches that divide the batch and no
  gradient-accumulation micro-batches (its group baseline couples rows)."""
  r, t, d = config.get("rollout"), config.get("train"), config.get("data")
  loss = t.get("loss") if t is not None else None
  if r is None or d is None or loss not in ("reinforce", "grpo"):
    return []
  errors = []
  if not r.get("temperature", 1.0) > 0:
    errors.append(
      f"config.train.loss={loss!r} needs sampled rollouts: rollout.temperature must be > 0 "
      f"(got {r.get('temperature')!r})"
    )
  if d.get("prompt_file"):
    errors.append(
      f"config.train.loss={loss!r} rewards the built-in task's answers "
      f"(train.reward={t.get('reward', 'exact_match')!r}); data.prompt_file="
      f"{d.get('prompt_file')!r} has no reward (set it to '')"
    )
  if t.get("reward") == "step":
    errors += _step_reward_errors(config, loss)
  if loss != "grpo":
    return errors
  n = r.get("samples_per_prompt", 1)
  if isinstance(n, int) and n < 2:
    errors.append(
      f"config.train.loss='grpo' compares completions of the same prompt: "
      f"rollout.samples_per_prompt must be >= 2 (got {n}); with 1 every advantage is 0"
    )
  rows = d.get("batch_size", 1) * n if isinstance(n, int) else None
  m = t.get("ppo_minibatches", 1)
  if isinstance(m, int) and m >= 1 and rows and rows % m:
    errors.append(
      f"config.train.ppo_minibatches={m} must divide the batch: data.batch_size x "
      f"rollout.samples_per_prompt = {rows} completions"
    )
  if t.get("microbatches", 1) != 1:
    errors.append(
      f"config.train.microbatches={t.get('microbatches')} cannot split loss 'grpo' (its group "
      "baseline couples rows); use train.microbatches=1 (train.ppo_minibatches sets the "
      "update size)"
    )
  return errors


def _step_reward_errors(config: ml_collections.ConfigDict, loss: str) -> list[str]:
  """train.reward='step' (opd_jax/data/rewards.py) gives each written step's tokens that step's
  GRPO advantage: it needs loss 'grpo' and the character tokenizer (one token per character
  of the task's text; a prompt file is refused for every RL loss above)."""
  errors = []
  if loss != "grpo":
    errors.append(
      f"config.train.reward='step' gives per-token advantages that only train.loss='grpo' "
      f"reads (got {loss!r}); use grpo, or reward 'exact_match' or 'partial'"
    )
  student = config.get("student")
  name = config.get("tokenizer", "") or (student.get("checkpoint", "") if student else "")
  if name not in ("", "char"):
    errors.append(
      f"config.train.reward='step' maps each completion token to one character of the task's "
      f"text, so it needs the built-in character tokenizer; the run's tokenizer is {name!r} "
      "(config.tokenizer, or student.checkpoint's)"
    )
  return errors


def _kl_coef_errors(config: ml_collections.ConfigDict) -> list[str]:
  """train.kl_coef > 0 is GRPO's KL penalty to the initial student (opd_jax/train/rl.py): no
  other loss has one, so a positive β with another loss is refused rather than ignored."""
  t = config.get("train")
  beta = t.get("kl_coef", 0.0) if t is not None else 0.0
  if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0:
    return []
  if t.get("loss") == "grpo":
    return []
  return [
    f"config.train.kl_coef={beta!r} is GRPO's KL penalty to the initial student; "
    f"train.loss={t.get('loss')!r} has none: set train.loss='grpo' or train.kl_coef=0"
  ]


def _on_policy_fraction_errors(config: ml_collections.ConfigDict) -> list[str]:
  """train.on_policy_fraction < 1 trains some rows on reference completions: the sampled
  reverse KL and REINFORCE are score-function estimators, unbiased only for the student's own
  samples, and their importance ratio needs a behaviour probability the data does not have."""
  t = config.get("train")
  fraction = t.get("on_policy_fraction", 1.0) if t is not None else 1.0
  on_policy_losses = ("reverse_kl_sampled", "reinforce", "grpo")  # need y ~ π_θ (off_policy.py)
  if not isinstance(fraction, (int, float)) or fraction >= 1:
    return []
  if t.get("loss") not in on_policy_losses:
    return []
  return [
    f"config.train.on_policy_fraction={fraction} trains on reference completions, which "
    f"train.loss={t.get('loss')!r} cannot use: it estimates its gradient from the student's own "
    "samples (y ~ π_θ, with an importance ratio to the sampler). Use reverse_kl_full, "
    "forward_kl or jsd (GKD's divergences), or train.on_policy_fraction=1"
  ]


def _teacher_target_errors(config: ml_collections.ConfigDict) -> list[str]:
  """A teacher bootstrap held to teacher.target_accuracy > 0 continues from its first
  pretrain_steps: the cap teacher.max_pretrain_steps counts those too, so it is at least
  pretrain_steps (with the target off, the cap is unused)."""
  t = config.get("teacher")
  if t is None or not {"target_accuracy", "max_pretrain_steps", "pretrain_steps"} <= set(t):
    return []
  target, cap, first = t.target_accuracy, t.max_pretrain_steps, t.pretrain_steps
  numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (target, cap))
  if not numbers or not isinstance(first, int) or not target > 0 or cap >= first:
    return []
  return [
    f"config.teacher.max_pretrain_steps={cap} must be >= teacher.pretrain_steps={first}: it "
    f"caps all the bootstrap's steps, its first {first} included (teacher.target_accuracy="
    f"{target:g}); raise the cap, or set teacher.target_accuracy=0 for fixed steps"
  ]


def _budget_errors(config: ml_collections.ConfigDict) -> list[str]:
  """The budget guard's moving average needs a decay below 1 (at 1 it never moves)."""
  b = config.get("budget")
  smoothing = b.get("smoothing") if b is not None else None
  if isinstance(smoothing, (int, float)) and not isinstance(smoothing, bool) and smoothing >= 1:
    return [f"config.budget.smoothing must be < 1 (0 = compare each step), got {smoothing!r}"]
  return []
