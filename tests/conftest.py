"""Shared fixtures: tiny random Hugging Face checkpoints built on the spot.

`make_hf_checkpoint(model_type, **overrides)` builds a tiny `transformers` model
(torch, CPU, seeded), perturbs every parameter, saves it with `save_pretrained`
and returns an `HFCheckpoint(path, model)`. Typical use:

    def test_something(make_hf_checkpoint):
      ckpt = make_hf_checkpoint("llama", tie_word_embeddings=True)
      cfg, params = opd_jax.io.hf.load_checkpoint(ckpt.path)
      logits = ckpt.model(torch.tensor(tokens)).logits   # the reference

Checkpoints are cached for the whole session by their arguments, so the same call
in two tests returns the same directory and the same torch model. Treat both as
read-only: copy the directory (`shutil.copytree`) before editing files in it, and
never change the model's parameters.

torch and transformers are imported inside the factory so that test files that
do not use it do not pay for the import.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
from typing import Any

# One persistent XLA compilation cache for the whole test session, its xdist workers and every
# subprocess they start (set before jax is imported, which reads these at import). The suite
# builds the same tiny programs again and again (each trainer run jits anew); a program
# compiled once is then loaded, not recompiled. A cached executable is the one XLA compiled, so
# results are bit for bit those of a fresh compile. The process that starts pytest makes the
# directory (the workers it spawns inherit the setting) and removes it at the end of the run.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="opd_jax_tests_")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402

from opd_jax.io import compile_cache  # noqa: E402
from opd_jax.model.config import ModelConfig  # noqa: E402


def pytest_configure(config):
  """XLA's backend (LLVM) optimisation off for the session, its workers and their
  subprocesses, as the admission check compiles (`io.compile_cache.fast_compilation`): the
  suite compiles hundreds of small programs and runs each for milliseconds, so compiling is
  most of its time; without backend optimisation the suite takes about four fifths as long on
  2 CPU cores. The HLO programs are the same; only their machine code is less optimised (the
  measured mismatch moves by about 2e-7 relative). `XLA_FLAGS` that set the level themselves win:
  XLA_FLAGS=--xla_backend_optimization_level=2 tests the optimised code. A script that imports
  this file as a module (for its tiny configs) keeps its own flags.
  """
  compile_cache.fast_compilation()


def xla_flags_with(*flags: str) -> str:
  """The session's `XLA_FLAGS` (with `pytest_configure`'s fast compilation) and `flags` after
  them, for a subprocess's environment: e.g. its own count of host devices."""
  return " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()


# Small enough to run in milliseconds, large enough to exercise GQA (N=4, K=2),
# several RoPE frequencies, and two layers.
TINY_CONFIG = {
  "vocab_size": 128,
  "hidden_size": 32,
  "intermediate_size": 64,
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "max_position_embeddings": 64,
  "rms_norm_eps": 1e-6,
  "tie_word_embeddings": False,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


def tiny_model_cfg(vocab_size: int = 128) -> ModelConfig:
  """The suite's tiny Qwen3-shaped decoder (2 layers, D=32, GQA 4/2, H=8): milliseconds
  per call, yet several layers, grouped KV heads and q/k norms."""
  return ModelConfig(
    model_type="qwen3",
    vocab_size=vocab_size,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qk_norm=True,
  )


@dataclasses.dataclass(frozen=True)
class HFCheckpoint:
  """A saved tiny checkpoint and the torch model it was saved from."""

  path: pathlib.Path  # directory with config.json and safetensors weights
  model: Any  # transformers *ForCausalLM, eval mode, CPU, eager attention


@pytest.fixture(scope="session")
def make_hf_checkpoint(tmp_path_factory):
  """Factory fixture: `make(model_type="qwen3", *, seed=0, dtype="float32",
  max_shard_size=None, noise=0.05, **overrides) -> HFCheckpoint`.

  Args of the returned function:
    model_type: "llama", "qwen2" or "qwen3".
    seed: torch seed for the initialisation and the perturbation.
    dtype: torch dtype name the model is cast to before saving ("bfloat16" saves
      a bf16 checkpoint; perturbation happens in f32 first).
    max_shard_size: passed to `save_pretrained` (e.g. "20KB" gives a sharded
      checkpoint with model.safetensors.index.json); None saves one file.
    noise: std of the Gaussian added to every parameter. HF initialises norms to
      1 and biases to 0, which would hide a swapped norm or a dropped bias.
    **overrides: config fields replacing `TINY_CONFIG`, e.g. head_dim=16,
      num_key_value_heads=1, attention_bias=True, tie_word_embeddings=True,
      rope_parameters={"rope_type": "llama3", ...}.
  """
  cache: dict[str, HFCheckpoint] = {}

  def make(
    model_type: str = "qwen3",
    *,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    noise: float = 0.05,
    **overrides,
  ) -> HFCheckpoint:
    key = json.dumps([model_type, seed, dtype, max_shard_size, noise, overrides], sort_keys=True)
    if key in cache:
      return cache[key]
    import torch
    import transformers

    fields = TINY_CONFIG | overrides
    if model_type == "qwen3" and "head_dim" not in fields:
      # Qwen3Config defaults head_dim to 128 rather than hidden / heads.
      fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    config = transformers.AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
      for param in model.parameters():
        param.add_(noise * torch.randn(param.shape, generator=generator))
    model = model.to(getattr(torch, dtype)).eval()
    path = tmp_path_factory.mktemp(f"hf_{model_type}")
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    cache[key] = HFCheckpoint(path=path, model=model)
    return cache[key]

  return make


def tiny_char_cfg(hidden_size: int = 16, head_dim: int = 8) -> ModelConfig:
  """A one-layer Qwen3 over the character tokenizer's vocabulary (2 heads, 1 KV head, q/k
  norms, MLP 2 x hidden_size): the model of the rollout tests on the built-in task."""
  from opd_jax.model.tokenizer import CharTokenizer

  return ModelConfig(
    model_type="qwen3",
    vocab_size=CharTokenizer().vocab_size,
    hidden_size=hidden_size,
    intermediate_size=2 * hidden_size,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=head_dim,
    qk_norm=True,
  )


def tiny_step_cfg() -> ModelConfig:
  """The one-layer Qwen3 (V 24, d 32, tied embeddings, q/k norms) of the train-step tests."""
  return ModelConfig("qwen3", 24, 32, 64, 1, 4, 2, 8, qk_norm=True, tie_word_embeddings=True)


def student_teacher_rollout(cfg: ModelConfig, prompts, sampler_cfg):
  """(student, teacher, rollout): two random models of `cfg` (keys 0 and 1, init scale 0.3)
  and the student's rollout of `prompts` under `sampler_cfg` (key 2)."""
  import jax

  from opd_jax.inference import sampler
  from opd_jax.model import transformer as model

  student = model.init_params(jax.random.key(0), cfg, scale=0.3)
  teacher = model.init_params(jax.random.key(1), cfg, scale=0.3)
  return student, teacher, sampler.sample(student, prompts, jax.random.key(2), sampler_cfg, cfg)


def apply_overrides(config, overrides):
  """`config` with each dotted key of `overrides` ("train.steps": 2, ...) set; returned."""
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return config


def tiny_config(teacher_cache, **overrides):
  """`configs/bf16_sync.py:tiny` with a shared teacher cache and dotted-key overrides."""
  import sys

  configs = str(pathlib.Path(__file__).resolve().parent.parent / "configs")
  if configs not in sys.path:
    sys.path.insert(0, configs)
  import bf16_sync

  config = bf16_sync.get_config("tiny")
  config.teacher.cache_dir = teacher_cache
  return apply_overrides(config, overrides)


REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_module(module: str, *args: str, timeout: float = 120):
  """`python -m <module> <args>` in a subprocess at the repository root, with the repository
  on PYTHONPATH; the CompletedProcess, its stdout and stderr as text."""
  import subprocess
  import sys

  return subprocess.run(
    [sys.executable, "-m", module, *args],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
    env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
  )


def with_rollout(config, **rollout):
  """A copy of `config` with `rollout.<key>=value` for each keyword."""
  out = copy.deepcopy(config)
  out.rollout.update(rollout)
  return out


# Hand-made `study.json` results in the schema `experiments.study` writes (round 9's recorded
# study.json gives the key names), for the readings of two studies side by side.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUND9 = os.path.join(_REPO, "docs", "study", "round9", "study.json")
STUDY_TOP = ("run_steps", "num_eval", "label", "tolerance", "noise_floor")
STUDY_ROW = ("name", "spec", "source", "role", "accuracy_runs", "teacher_kl_runs", "mismatch/kl")


@pytest.fixture(scope="session")
def recorded_study():
  """Round 9's recorded study.json."""
  with open(ROUND9) as f:
    return json.load(f)


@pytest.fixture(scope="session")
def study_keys():
  """The top-level and row keys `make_study` copies from the recorded study."""
  return STUDY_TOP, STUDY_ROW


@pytest.fixture(scope="session")
def make_study(recorded_study):
  """make(steps, tolerance, reference, settings): a study.json of `steps` whose reference runs
  have (KL, accuracy) pairs `reference` and whose settings are (spec, [(KL, accuracy) per
  run]) or (spec, [(KL, accuracy) per run], check KL); every key copied from a recorded one.
  A setting given a check KL gets it as mismatch/kl and its own source, named by its spec's
  key; one without keeps the recorded row's."""

  def make(steps, tolerance, reference, settings):
    result = {key: copy.deepcopy(recorded_study[key]) for key in STUDY_TOP}
    result.update(run_steps=steps, tolerance=tolerance, label="teacher_kl", num_eval=256)
    template = next(r for r in recorded_study["rows"] if r["role"] == "calibration")
    rows = []
    for i, (kl, acc) in enumerate(reference):
      rows.append({**template, "name": f"reference_seed{i}", "spec": "", "source": "reference"})
      rows[-1].update(role="reference", teacher_kl_runs=[kl], accuracy_runs=[acc])
      rows[-1]["mismatch/kl"] = 0.0
    for spec, runs, *check_kl in settings:
      rows.append({**template, "name": spec.replace("=", "-"), "spec": spec, "role": "calibration"})
      rows[-1].update(teacher_kl_runs=[k for k, _ in runs], accuracy_runs=[a for _, a in runs])
      if check_kl:
        rows[-1].update({"mismatch/kl": check_kl[0], "source": spec.split("=")[0]})
    result["rows"] = rows
    return result

  return make


# The files that take longest on 2 cores, slowest first: they start first, so that the two
# xdist workers (`--dist loadfile`) finish together instead of one of them ending on a long file.
SLOW_FILES_FIRST = (
  "test_task.py",
  "test_study.py",
  "test_launch.py",
  "test_faults.py",
  "test_opd_vs_rl.py",
  "test_trainer.py",
  "test_user_eval.py",
  "test_guard.py",
  "test_walkthrough.py",
  "test_sharded_sampler.py",
  "test_sensitivity.py",
  "test_padded_vocab.py",
  "test_device_check.py",
  "test_round10.py",
)


def pytest_collection_modifyitems(items):
  """Runs `SLOW_FILES_FIRST` first; every other file keeps its place (a stable sort)."""
  rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_sessionfinish(session):
  """Removes the compilation cache this process made (module top), once every worker is done."""
  if _OWN_CACHE:
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)
