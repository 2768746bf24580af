"""The OPD loop end to end on the tiny variant: logs, resume, and bad-input errors."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax.data import pipeline as data
from opd_jax.io import checkpointing, metrics_writer, params_digest, provenance, run_history
from opd_jax.train import setup as setup_lib
from opd_jax.train import signals, trainer
from opd_jax.train.setup import run_spec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "configs"))

from conftest import tiny_config, xla_flags_with  # noqa: E402


@pytest.fixture(scope="module")
def teacher_cache(tmp_path_factory):
  """One bootstrapped tiny teacher shared by every run in this module."""
  return str(tmp_path_factory.mktemp("teacher_cache"))


@pytest.fixture(scope="module")
def tiny_run(teacher_cache, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("run"))
  result = trainer.run(tiny_config(teacher_cache), workdir, log=lambda *a: None)
  return workdir, result


def test_tiny_run_logs_every_namespace_to_tensorboard_and_jsonl(tiny_run):
  workdir, result = tiny_run
  scalars = metrics_writer.read_scalars(workdir)
  for name in (
    "loss/total",
    "teacher/reverse_kl",
    "quality/student_accuracy",
    "quality/teacher_accuracy",
    "rollout/tokens_per_s",
    "perf/train_seconds",
  ):
    assert name in scalars, f"{name} missing from TensorBoard; have {sorted(scalars)}"
  assert [s for s, _ in scalars["loss/total"]] == [2, 4, 6]
  assert [s for s, _ in scalars["quality/student_accuracy"]] == [0, 3, 6]
  rows = metrics_writer.read_jsonl(workdir)
  # TensorBoard keeps f32; the JSONL keeps full precision of the same values.
  for step, value in scalars["teacher/reverse_kl"]:
    assert value == pytest.approx(rows[step]["teacher/reverse_kl"], rel=1e-6)
  assert rows[6]["quality/student_accuracy"] == result["student_accuracy_after"]
  # Six OPD steps on the tiny models already pull the student towards the teacher.
  assert result["student_teacher_kl_after"] < result["student_teacher_kl_before"]
  from tensorboard.backend.event_processing import event_accumulator

  acc = event_accumulator.EventAccumulator(
    os.path.join(workdir, "tb"), size_guidance={"tensors": 0}
  )
  acc.Reload()
  assert "loss/advantage" in acc.Tags()["tensors"]  # the per-token advantage histogram
  assert "quality/student_samples" in acc.Tags()["tensors"]


def test_checkpoint_holds_state_and_data_position(tiny_run, teacher_cache):
  workdir, _ = tiny_run
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"))
  assert ckpt.latest_step() == 6
  assert sorted(int(d) for d in os.listdir(ckpt.directory) if d.isdigit()) == [3, 6]
  restored = _restore(ckpt, 6)
  assert int(restored["state"]["step"]) == 6
  # The saved iterator position continues exactly where six batches of 8 left off.
  config = tiny_config(teacher_cache)
  source = setup_lib.prompt_source(run_spec(config), setup_lib.task_config(run_spec(config)))
  straight = iter(data.prompt_batches(source, 8, config.seed))
  for _ in range(6):
    next(straight)
  resumed = iter(data.prompt_batches(source, 8, config.seed))
  resumed.set_state(data.state_from_json(restored["extra"]["data_state"]))
  assert next(resumed)["prompt"] == next(straight)["prompt"]


def test_resume_with_a_different_config_is_refused(tiny_run, teacher_cache, tmp_path):
  workdir, _ = tiny_run
  copy = tmp_path / "copy"
  shutil.copytree(workdir, copy)
  config = tiny_config(teacher_cache, **{"train.lr": 5e-4, "train.steps": 9})
  with pytest.raises(
    ValueError, match=r"come from a different config \(train.lr: 0.001 -> 0.0005\)"
  ):
    trainer.run(config, str(copy), log=lambda *a: None)


def test_the_result_records_the_teacher_and_warm_start_a_resumed_run_keeps(
  tiny_run, teacher_cache, tmp_path
):
  workdir, result = tiny_run
  config = tiny_config(teacher_cache)
  spec = run_spec(config)
  setup = setup_lib.prepare_models(spec, str(tmp_path / "setup"), log=lambda *a: None)
  warm = setup_lib.warm_started_student(spec, setup, lambda *a: None, teacher_cache)
  digests = result[run_history.START_DIGESTS]
  assert digests == {
    "teacher": params_digest.digest(setup.models.teacher_params),
    "student": params_digest.digest(warm),
  }
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"))
  assert _restore(ckpt, 6)["extra"][run_history.START_DIGESTS] == digests
  # Resumed for two more steps, the run keeps the digest of the student it started from.
  copy = tmp_path / "copy"
  shutil.copytree(workdir, copy)
  resumed = trainer.run(
    tiny_config(teacher_cache, **{"train.steps": 8}), str(copy), log=lambda *a: None
  )
  assert resumed["start_step"] == 6
  assert resumed[run_history.START_DIGESTS] == digests
  # Every checkpoint names the code of the run's stretches; one version: no mixed key.
  code = provenance.code_key(result[provenance.KEY])
  assert _restore(ckpt, 6)["extra"][provenance.SEGMENTS] == [code]
  assert provenance.SEGMENTS not in resumed[provenance.KEY]
  # Resumed from a checkpoint another version wrote, the result says both.
  again = tmp_path / "again"
  shutil.copytree(workdir, again)
  (extra_file,) = [  # the checkpoint's JSON extra, as another version would have written it
    p
    for p in (again / "checkpoints" / "6" / "extra").rglob("*")
    if p.is_file() and p.suffix != ".tmp" and provenance.SEGMENTS in p.read_text(errors="ignore")
  ]
  extra = json.loads(extra_file.read_text())
  extra[provenance.SEGMENTS] = ["0" * 40]
  extra_file.write_text(json.dumps(extra))
  mixed = trainer.run(
    tiny_config(teacher_cache, **{"train.steps": 8}), str(again), log=lambda *a: None
  )
  assert mixed[provenance.KEY][provenance.SEGMENTS] == ["0" * 40, code]


def test_empty_prompt_file_is_refused(teacher_cache, tmp_path):
  empty = tmp_path / "prompts.jsonl"
  empty.write_text("")
  config = tiny_config(teacher_cache, **{"data.prompt_file": str(empty)})
  with pytest.raises(ValueError, match=f"prompt file {empty} is empty"):
    trainer.run(config, str(tmp_path / "w"), log=lambda *a: None)


def test_malformed_prompt_file_names_the_line(teacher_cache, tmp_path):
  bad = tmp_path / "prompts.jsonl"
  bad.write_text('{"prompt": "12+34+56="}\n{"prompt": 12+\n')
  config = tiny_config(teacher_cache, **{"data.prompt_file": str(bad)})
  with pytest.raises(ValueError, match="line 2 is not valid JSON"):
    trainer.run(config, str(tmp_path / "w"), log=lambda *a: None)


def test_prompt_with_unknown_characters_is_refused(teacher_cache, tmp_path):
  bad = tmp_path / "prompts.jsonl"
  bad.write_text('{"prompt": "12+34+56="}\n{"prompt": "what is 2+2?"}\n')
  config = tiny_config(teacher_cache, **{"data.prompt_file": str(bad)})
  with pytest.raises(ValueError, match=r"prompt 1 of .*prompts.jsonl: character 'w' at position 0"):
    trainer.run(config, str(tmp_path / "w"), log=lambda *a: None)


def test_student_teacher_vocab_mismatch_is_refused(teacher_cache, tmp_path, make_hf_checkpoint):
  student = make_hf_checkpoint("qwen3", vocab_size=128)
  teacher = make_hf_checkpoint("qwen3", vocab_size=96)
  config = tiny_config(
    teacher_cache,
    **{"student.checkpoint": str(student.path), "teacher.checkpoint": str(teacher.path)},
  )
  expected = (
    "student and teacher vocabularies differ: student vocab_size=128, teacher vocab_size=96"
  )
  with pytest.raises(ValueError, match=expected):
    trainer.run(config, str(tmp_path / "w"), log=lambda *a: None)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(teacher_cache, tmp_path):
  # A learning rate of 1e30 sends the weights to ~1e30 after one update; the next
  # forward pass overflows and the loss becomes NaN.
  config = tiny_config(
    teacher_cache,
    **{
      "train.lr": 1e30,
      "train.warmup_steps": 0,
      "train.checkpoint_every": 1,
      "train.eval_every": 100,
      "train.steps": 6,
    },
  )
  workdir = tmp_path / "w"
  # Either the loss or (one step earlier) the weights overflow first; both stop the run.
  stopped = (
    r"(non-finite loss .* at step \d+; stopping. The last good checkpoint \(\d+\)"
    r"|refusing to checkpoint step \d+: the state has non-finite values; the last good)"
  )
  with pytest.raises(ValueError, match=stopped):
    trainer.run(config, str(workdir), log=lambda *a: None)
  ckpt = checkpointing.Checkpointer(str(workdir / "checkpoints"))
  last = ckpt.latest_step()
  assert last is not None and last >= 1
  assert all(
    np.all(np.isfinite(np.asarray(x)))
    for x in jax.tree.leaves(_restore(ckpt, last)["state"]["params"])
  )


def test_a_reader_restores_the_params_alone(tiny_run):
  """`restore_params` gives the saved student params exactly, and the extra, without the
  optimizer state."""
  workdir, _ = tiny_run
  directory = os.path.join(workdir, "checkpoints")
  saved = _restore(checkpointing.Checkpointer(directory, read_only=True), 6)
  ckpt = checkpointing.Checkpointer(directory, read_only=True)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), saved["state"]["params"]
  )
  params, extra = ckpt.restore_params(6, abstract)
  assert jax.tree.structure(params) == jax.tree.structure(saved["state"]["params"])
  jax.tree.map(np.testing.assert_array_equal, params, saved["state"]["params"])
  assert all(x.sharding == device for x in jax.tree.leaves(params))
  assert extra == saved["extra"]
  # orbax binds an item to the handler it first used: one kind of restore per Checkpointer
  with pytest.raises(ValueError, match="has restored params alone; save or restore whole"):
    ckpt.restore(6, saved["state"])


def _restore(ckpt, step):
  """The raw saved items, without an abstract target."""
  import orbax.checkpoint as ocp

  args = ocp.args.Composite(state=ocp.args.StandardRestore(), extra=ocp.args.JsonRestore())
  return ckpt._manager.restore(step, args=args)


def _sharded_step1(workdir, teacher_cache, mesh):
  devices = int(np.prod(mesh))
  flags = xla_flags_with(f"--xla_force_host_platform_device_count={devices}")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
  script = Path(__file__).with_name("_sharded_trainer_check.py")
  proc = subprocess.run(
    [sys.executable, str(script), str(workdir), teacher_cache, *map(str, mesh)],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result["devices"] == devices
  return result["step1"]


@pytest.mark.slow
def test_opd_step_on_a_2x2x2_mesh_matches_one_device(teacher_cache, tmp_path):
  """Same first OPD step whether the batch and weights are split 8 ways or not."""
  one = _sharded_step1(tmp_path / "one", teacher_cache, (1, 1, 1))
  split = _sharded_step1(tmp_path / "split", teacher_cache, (2, 2, 2))
  for name in ("loss/total", "teacher/reverse_kl", "teacher/logprob", "perf/grad_norm"):
    assert split[name] == pytest.approx(one[name], rel=1e-4), name


def _main_cmd(workdir, teacher_cache):
  return [
    sys.executable,
    "-m",
    "opd_jax.main",
    "--config=bf16_sync.py:tiny",
    f"--workdir={workdir}",
    f"--config.teacher.cache_dir={teacher_cache}",
    "--config.train.steps=8",
    "--config.train.checkpoint_every=2",
    "--config.train.eval_every=4",
    "--config.train.log_every=1",
  ]


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted_run(teacher_cache, tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  straight, killed = tmp_path / "straight", tmp_path / "killed"
  subprocess.run(
    _main_cmd(straight, teacher_cache),
    cwd=ROOT,
    env=env,
    check=True,
    capture_output=True,
    timeout=600,
  )

  proc = subprocess.Popen(
    _main_cmd(killed, teacher_cache),
    cwd=ROOT,
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  ckpt_dir = killed / "checkpoints"
  deadline = time.time() + 600
  while time.time() < deadline and proc.poll() is None:
    done = [int(d) for d in os.listdir(ckpt_dir) if d.isdigit()] if ckpt_dir.exists() else []
    if any(s >= 4 for s in done):
      break
    time.sleep(0.05)
  assert proc.poll() is None, "the run finished before it could be killed"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  before = metrics_writer.read_jsonl(killed)
  assert max(before) < 8, "the killed run must not have reached the last step"

  subprocess.run(
    _main_cmd(killed, teacher_cache),
    cwd=ROOT,
    env=env,
    check=True,
    capture_output=True,
    timeout=600,
  )
  a, b = metrics_writer.read_jsonl(straight), metrics_writer.read_jsonl(killed)
  for name in (
    "loss/total",
    "teacher/reverse_kl",
    "teacher/logprob",
    "quality/student_accuracy",
    "quality/student_teacher_kl",
  ):
    assert b[8][name] == a[8][name], name
  assert json.loads((killed / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 8


# -- async rollouts ---------------------------------------------------------------

COMPARED = ("loss/total", "teacher/reverse_kl", "teacher/logprob", "quality/student_accuracy")


def test_async_with_max_lag_0_reproduces_the_sync_run(tiny_run, teacher_cache, tmp_path):
  """Bit for bit, also when the producer scores the teacher instead of the train step."""
  sync_dir, _ = tiny_run
  overrides = {"rollout.mode": "async", "rollout.max_lag": 0, "rollout.score_teacher": True}
  config = tiny_config(teacher_cache, **overrides)
  trainer.run(config, str(tmp_path), log=lambda *a: None)
  sync, asynchronous = metrics_writer.read_jsonl(sync_dir), metrics_writer.read_jsonl(tmp_path)
  for step, row in sync.items():
    for name in COMPARED:
      if name in row:
        assert asynchronous[step][name] == row[name], (step, name)
  assert asynchronous[6]["rollout/version_lag_max"] == 0


def test_async_run_logs_versions_and_resumes_from_its_checkpoint(teacher_cache, tmp_path):
  config = tiny_config(teacher_cache, **{"rollout.mode": "async", "rollout.max_lag": 1})
  first = trainer.run(config, str(tmp_path), log=lambda *a: None)
  rows = metrics_writer.read_jsonl(tmp_path)
  logged = [rows[s] for s in (2, 4, 6)]
  assert all(0 <= r["rollout/version_lag_max"] <= 1 for r in logged)
  assert any(r["rollout/version_lag_mean"] > 0 for r in logged)  # sampling did overlap
  for name in ("rollout/queue_wait_seconds", "rollout/publish_seconds", "rollout/dropped"):
    assert name in rows[6], name
  assert rows[6]["rollout/dropped"] == 0  # max_ahead = max_lag: nothing goes stale
  extra = _restore(checkpointing.Checkpointer(str(tmp_path / "checkpoints")), 6)["extra"]
  assert extra["next_batch"] == 6 and extra["weight_version"] == 6
  # The same config with more steps continues from step 6 (train.steps may change).
  config = tiny_config(
    teacher_cache, **{"rollout.mode": "async", "rollout.max_lag": 1, "train.steps": 9}
  )
  resumed = trainer.run(config, str(tmp_path), log=lambda *a: None)
  assert first["end_step"] == 6 and resumed["start_step"] == 6 and resumed["end_step"] == 9
  assert np.isfinite(metrics_writer.read_jsonl(tmp_path)[9]["loss/total"])


@pytest.mark.parametrize(
  "overrides,message",
  [
    (
      {"rollout.mode": "async", "rollout.stale_policy": "correct"},
      "stale_policy='correct' trains stale batches with the truncated importance ratio",
    ),
    (
      {"rollout.mode": "async", "rollout.stale_k": 2},
      "rollout.stale_k=2 is the synchronous stale-k setting",
    ),
    ({"rollout.mode": "asynchronous"}, "config.rollout.mode must be one of sync, async"),
  ],
)
def test_bad_rollout_combinations_are_refused_before_anything_builds(
  teacher_cache, tmp_path, overrides, message
):
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    trainer.run(tiny_config(teacher_cache, **overrides), str(tmp_path), log=lambda *a: None)


def test_stop_on_signal_turns_the_first_sigint_into_a_flag_and_the_second_into_an_interrupt():
  before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a background job
  with trainer.StopOnSignal() as stop:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    assert stop.received == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.05)
  assert signal.getsignal(signal.SIGINT) is before  # the handler it replaced is restored


@pytest.mark.slow
def test_sigterm_stops_an_async_run_with_a_checkpoint_that_resumes(teacher_cache, tmp_path):
  workdir = tmp_path / "w"
  cmd = [
    *_main_cmd(workdir, teacher_cache)[:-4],
    "--config.rollout.mode=async",
    "--config.train.steps=60",
    "--config.train.checkpoint_every=1000",
    "--config.train.eval_every=1000",
    "--config.train.log_every=1",
  ]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen(
    cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  deadline = time.time() + 600
  log = workdir / "metrics.jsonl"
  while time.time() < deadline and proc.poll() is None:
    if log.exists() and len(log.read_text().splitlines()) >= 4:
      break
    time.sleep(0.05)
  assert proc.poll() is None, "the run ended before the signal"
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0, out[-3000:]
  stopped = int(re.search(r"SIGTERM received: stopped at step (\d+); checkpoint saved", out)[1])
  assert 3 <= stopped < 60
  assert checkpointing.Checkpointer(str(workdir / "checkpoints")).latest_step() == stopped
  resumed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"resumed from step {stopped}" in resumed.stdout
  assert max(metrics_writer.read_jsonl(workdir)) == 60


def test_check_raises_only_inside_a_signalled_stop_context():
  signals.check("nowhere")  # no StopOnSignal active: a no-op
  with signals.StopOnSignal() as stop:
    signals.check("setup")  # not signalled
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    assert stop.received == signal.SIGTERM
    with pytest.raises(signals.Interrupted, match="SIGTERM received during the warm start"):
      signals.check("the warm start")
  signals.check("after")  # the context is gone


@pytest.mark.slow
def test_sigterm_during_the_teacher_bootstrap_exits_0_and_the_same_command_finishes(tmp_path):
  """A SIGTERM while the teacher is being trained (a fresh cache): exit 0 at the next
  supervised step, no half-written teacher cache, no checkpoint; the same command then
  bootstraps the teacher and trains to the end."""
  workdir, cache = tmp_path / "w", tmp_path / "fresh_teacher_cache"
  cmd = [*_main_cmd(workdir, cache)[:-4], "--config.train.steps=2", "--config.train.eval_every=0"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen(
    cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  lines = []
  for line in proc.stdout:  # wait until the bootstrap is under way
    lines.append(line)
    if "sft step" in line:
      proc.send_signal(signal.SIGTERM)
      break
  out = "".join(lines) + proc.communicate(timeout=300)[0]
  assert proc.returncode == 0, out[-3000:]
  assert re.search(r"SIGTERM received during supervised step \d+/\d+: stopped before training", out)
  assert not (workdir / "checkpoints").exists() or not os.listdir(workdir / "checkpoints")
  assert not any(p.name.startswith("teacher-") for p in cache.glob("*")), list(cache.glob("*"))
  again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "bootstrapping teacher" in again.stdout and "'end_step': 2" in again.stdout


def test_all_finite_finds_one_bad_entry_in_any_floating_leaf():
  """The checkpoint guard's check: every floating leaf (f32, bf16, fp8), integer leaves skipped."""
  import ml_dtypes

  tree = {
    "w": jnp.ones((4, 3)),
    "b": jnp.ones((3,), jnp.bfloat16),
    "q": jnp.ones((2, 2), ml_dtypes.float8_e4m3fn),
    "count": jnp.int32(7),
  }
  assert checkpointing.all_finite(tree)
  assert checkpointing.all_finite({"count": jnp.int32(7)})
  assert not checkpointing.all_finite({**tree, "w": tree["w"].at[2, 1].set(jnp.nan)})
  assert not checkpointing.all_finite({**tree, "b": tree["b"].at[0].set(-jnp.inf)})
  assert not checkpointing.all_finite({**tree, "q": tree["q"].at[1, 0].set(jnp.nan)})
