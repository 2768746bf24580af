"""The commands' shared flag vocabulary (`opd_jax.cli.flags`): `--help` exits 0 and shows the
shared flags, `--json=PATH` or `-`, `--params-from`, the teacher cache's config key, the candidate
syntax, the old spellings' deprecation warnings, and the ETA on progress lines."""

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from opd_jax.cli import flags as cli_flags
from opd_jax.io import json_file

REPO = Path(__file__).resolve().parents[2]


def _command(*args, timeout=300):
  return subprocess.run(
    [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
  )


@pytest.mark.parametrize("command", ["opd_jax.admit", "opd_jax.sensitivity", "opd_jax.main"])
def test_help_shows_config_and_workdir_points_to_the_reference_and_exits_0(command):
  proc = _command(command, "--help")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "  --config: " in proc.stdout and "  --workdir: " in proc.stdout
  assert cli_flags.CONFIG_REFERENCE in proc.stdout
  assert "orbax" not in proc.stdout and "--verbosity" not in proc.stdout  # only its own flags


def _load_tool(name):
  spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# Every `python -m` command (tools/gen_reference.py lists them for the reference page).
RUNNER_COMMANDS = _load_tool("gen_reference").command_modules()


@pytest.mark.parametrize("command", RUNNER_COMMANDS)
def test_help_exits_0_without_importing_jax(command):
  """`--help` exits 0 with the command's usage line and flags, and imports neither JAX nor flax
  (each is run as `python -m` runs it)."""
  code = (
    "import runpy, sys\n"
    f"sys.argv = ['python -m {command}', '--help']\n"
    "try:\n"
    f"  runpy.run_module('{command}', run_name='__main__', alter_sys=True)\n"
    "except SystemExit as e:\n"
    "  print('exit', e.code, 'jax' in sys.modules, 'flax' in sys.modules, file=sys.stderr)\n"
  )
  proc = subprocess.run(
    [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
  )
  assert proc.stderr.strip().splitlines()[-1] == "exit 0 False False", proc.stderr[-2000:]
  assert proc.stdout.startswith(f"usage: python -m {command} [flags]\n"), proc.stdout[:300]
  assert "\nflags:\n  --" in proc.stdout
  for line in proc.stdout.split("\nflags:\n")[1].splitlines():
    if line.startswith("  --"):  # every flag has help text
      assert len(line.split(": ", 1)) == 2 and line.split(": ", 1)[1].strip(), line


def test_export_help_hides_the_old_workdir_and_names_params_from():
  proc = _command("opd_jax.export", "--help")
  assert proc.returncode == 0
  assert "  --params-from: " in proc.stdout and "  --workdir" not in proc.stdout
  assert "--out: Directory to write the Hugging Face checkpoint to. (required)" in proc.stdout


@pytest.mark.parametrize("command", ["opd_jax.main", "opd_jax.study", "opd_jax.calibrate"])
def test_workdir_is_required_where_a_command_writes(command):
  proc = _command(command, "--config=configs/bf16_sync.py:tiny")
  assert proc.returncode == 1
  assert "error: --workdir is required: Where logs and checkpoints go." in proc.stderr
  assert "Traceback" not in proc.stderr


def test_prefix_shift_needs_a_workdir_only_for_its_default_json():
  proc = _command(
    "opd_jax.prefix_shift", "--config=configs/bf16_sync.py:tiny", "--candidate=rollout.weights=fp8"
  )
  assert proc.returncode == 1
  assert "error: pass --workdir=DIR (where the JSON goes)" in proc.stderr


def test_a_tuple_of_bare_words_parses_alike_in_config_overrides_and_candidates():
  """`(attention,)` is a tuple of strings in `--config.rollout.noise_modules=` (main's flags) as in
  `--candidate` (admit's), and the config main would train passes the trainer's check."""
  from opd_jax.config import values
  from opd_jax.mismatch import candidates

  text = "(attention,)"
  for override in (
    f"'--config.rollout.noise_modules={text}'",
    f"'--config.rollout.noise_modules', '{text}'",
  ):
    code = (
      "from opd_jax.cli import flags as f\n"
      "from opd_jax.config import check\n"
      "argv = ['main', '--config=configs/bf16_sync.py:tiny', '--config.rollout.noise_sigma=0.33',\n"
      f"  {override}]\n"
      "import sys; sys.argv = argv  # as under python -m\n"
      "f.parse_flags(f.resolve_config_arg(argv))\n"
      "check.validate(f.CONFIG.value)\n"
      "print(repr(f.CONFIG.value.rollout.noise_modules))\n"
    )
    proc = subprocess.run(
      [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, (override, proc.stderr[-2000:])
    assert proc.stdout.strip() == "('attention',)", override
  from conftest import tiny_config

  spec = f"rollout.noise_sigma=0.33,rollout.noise_modules={text}"
  candidate = candidates.parse_candidate(spec, tiny_config(""))
  assert candidate.overrides["rollout.noise_modules"] == ("attention",)
  assert values.parse_value("('mlp', 'o')", ()) == ("mlp", "o")  # quoted text as before


def test_bench_help_describes_the_bench_and_lists_json_path():
  proc = _command("opd_jax.bench.kv_capacity", "--help")
  assert proc.returncode == 0 and "KV-cache capacity per recipe" in proc.stdout
  assert "  --json: Write the rows to PATH; - (or a bare --json) prints only it" in proc.stdout


def test_json_to_stdout_to_a_file_and_bare(tmp_path):
  dash = _command("opd_jax.bench.kv_capacity", "--json=-")
  assert dash.returncode == 0, dash.stderr[-2000:]
  rows = json.loads(dash.stdout)["rows"]  # stdout is only the JSON
  bare = _command("opd_jax.bench.kv_capacity", "--json")
  assert json.loads(bare.stdout)["rows"] == rows  # the documented bare form still works
  path = tmp_path / "out" / "kv.json"
  to_file = _command("opd_jax.bench.kv_capacity", f"--json={path}")
  assert json.loads(path.read_text())["rows"] == rows
  assert "bytes/token" in to_file.stdout or "ratio" in to_file.stdout  # the table, readable


def test_write_json_refuses_an_empty_target(tmp_path, capsys):
  with pytest.raises(ValueError, match="--json needs a path, or - for stdout"):
    json_file.write_text("", "{}")
  json_file.write_text("-", '{"a": 1}')
  assert capsys.readouterr().out == '{"a": 1}\n'
  with cli_flags.json_output("-") as path:
    Path(path).write_text('{"b": 2}\n')
  assert capsys.readouterr().out == '{"b": 2}\n'
  with cli_flags.json_output(str(tmp_path / "x.json")) as path:
    assert path == str(tmp_path / "x.json")


def test_rewrite_deprecated_maps_old_spellings_and_warns_once(capsys):
  argv = ["prog", "--run=/r", "--teacher-cache=/c", "--run", "--other=1"]
  renames = {"--run": "--params-from", "--teacher-cache": "--config.teacher.cache_dir"}
  out = cli_flags.rewrite_deprecated(argv, renames)
  new = ["--params-from=/r", "--config.teacher.cache_dir=/c", "--params-from", "--other=1"]
  assert out == ["prog", *new]
  err = capsys.readouterr().err
  assert err.count("--run is deprecated") == 1
  assert "--teacher-cache is deprecated and will be removed in the next release; use " in err


def test_bare_json_means_stdout():
  assert cli_flags.bare_json_to_stdout(["p", "--json", "--json=x"]) == ["p", "--json=-", "--json=x"]
  assert cli_flags.bare_json_to_stdout(["p", "--json", "out.json", "--json"]) == [
    "p",
    "--json=out.json",
    "--json=-",
  ]
  assert cli_flags.bare_json_to_stdout(["p", "--json", "-"]) == ["p", "--json=-"]


def test_admission_cost_old_spellings_warn_and_still_parse(capsys):
  from opd_jax.bench import admission_cost

  with pytest.raises(SystemExit, match="--repeats must be >= 1"):
    admission_cost.main(["--run=/r", "--teacher-cache=/c", "--repeats=0"])
  err = capsys.readouterr().err
  assert "--run is deprecated" in err and "use --params-from" in err
  assert "--teacher-cache is deprecated" in err and "use --config.teacher.cache_dir" in err


def test_parallel_runs_old_teacher_cache_warns(capsys):
  from opd_jax.bench import parallel_runs

  with pytest.raises(SystemExit, match="--runs must be >= 1"):
    parallel_runs.main(["--teacher-cache=/c", "--runs=0"])
  assert "use --config.teacher.cache_dir" in capsys.readouterr().err


def test_export_old_workdir_spelling_warns_and_still_names_the_run(tmp_path):
  proc = _command("opd_jax.export", f"--workdir={tmp_path}", f"--out={tmp_path}/o")
  assert proc.returncode == 1
  assert "--workdir (the run to export) is deprecated" in proc.stderr
  assert f"error: '{tmp_path}' holds no checkpoints directory" in proc.stderr


def test_export_without_a_run_says_what_to_pass(tmp_path):
  proc = _command("opd_jax.export", f"--out={tmp_path}/o")
  assert proc.returncode == 1
  assert "error: pass --params-from=RUN, the training run to export" in proc.stderr


def test_prefix_shift_old_source_warns_and_a_bad_candidate_is_refused():
  proc = _command(
    "opd_jax.prefix_shift",
    "--config=configs/bf16_sync.py:tiny",
    "--source=fp8",
    "--candidate=rollout.weights=fp9",
  )
  assert proc.returncode == 1
  assert "--source is deprecated" in proc.stderr and "use --candidate=" in proc.stderr
  assert "error:" in proc.stderr and "fp9" in proc.stderr


def test_prefix_shift_needs_a_candidate():
  proc = _command("opd_jax.prefix_shift", "--config=configs/bf16_sync.py:tiny")
  assert proc.returncode == 1
  assert "give at least one --candidate=rollout.<key>=<value>[,...]" in proc.stderr


@pytest.mark.parametrize(
  "args, problem",
  [
    (["--candidate=rollout.kernel=bf16_attention"], "cannot perturb rollout.kernel a layer"),
    (["--candidate=rollout.weights=bf16"], "the scan takes rollout.weights=fp8, got 'bf16'"),
    (
      ["--candidate=rollout.weights=fp8,rollout.noise_sigma=0.1"],
      "name exactly one of rollout.weights=fp8",
    ),
    (["--sources=fp8_kv", "--candidate=rollout.kv_cache=fp8"], "not both"),
  ],
)
def test_sensitivity_candidates_are_checked_before_anything_loads(args, problem):
  proc = _command("opd_jax.sensitivity", "--config=configs/bf16_sync.py:tiny", *args)
  assert proc.returncode == 1
  assert problem in proc.stderr, proc.stderr[-2000:]


def test_progress_log_adds_an_eta_and_a_terminal_status_line():
  clock = [0.0]
  out = io.StringIO()
  log = cli_flags.ProgressLog(out, clock=lambda: clock[0], tty=False)
  log("4 runs, 2 at a time")
  clock[0] = 10.0
  log("[1/4] run_a: accuracy 0.5")
  clock[0] = 20.0
  log("[2/4] run_b: accuracy 0.6")
  log("setting 3/3: done")
  log("process 0/2 holding 1 device")  # item 0: no ETA
  lines = out.getvalue().splitlines()
  assert lines[0] == "4 runs, 2 at a time"
  assert lines[1] == "[1/4] run_a: accuracy 0.5 | ETA 30s"  # 10 s per run, 3 to go
  assert lines[2] == "[2/4] run_b: accuracy 0.6 | ETA 20s"
  assert lines[3] == "setting 3/3: done | ETA 0s"
  assert lines[4] == "process 0/2 holding 1 device"

  tty = io.StringIO()
  clock[0] = 0.0
  log = cli_flags.ProgressLog(tty, clock=lambda: clock[0], tty=True)
  clock[0] = 5.0
  log("[1/2] a")
  log("next line")
  assert tty.getvalue() == "[1/2] a | ETA 5s\nitem 1/2 | 5s elapsed | ETA 5s\r\x1b[Knext line\n"


def test_sensitivity_old_scan_flags_warn_and_still_parse():
  proc = _command(
    "opd_jax.sensitivity",
    "--config=configs/bf16_sync.py:tiny",
    "--sources=fp8_kv",
    "--noise-sigma=0.1",
    "--layers=x",  # refused after the flags are read, before anything loads
  )
  assert proc.returncode == 1
  assert "--sources is deprecated" in proc.stderr and "use --candidate" in proc.stderr
  assert "--noise-sigma is deprecated" in proc.stderr
  assert "--layers takes layer indices, got ['x']" in proc.stderr


def test_run_command_passes_main_s_status_and_ends_an_error_with_one_line(monkeypatch, capsys):
  """A command's `main` returns its exit status (admit: 1 for a refusal); a ValueError, or a bad
  flag, is one `error:` line and `error_status` (admit: 2)."""
  from opd_jax.cli import runner

  monkeypatch.setattr(sys, "argv", ["cmd"])
  with pytest.raises(SystemExit) as refused:
    runner.run_command(lambda argv: 1, own_flags=True, error_status=2)
  assert refused.value.code == 1

  def bad(argv):
    raise ValueError("no such candidate")

  with pytest.raises(SystemExit) as failed:
    runner.run_command(bad, own_flags=True, error_status=2)
  assert failed.value.code == 2 and capsys.readouterr().err == "error: no such candidate\n"

  def bad_flag(argv):
    return runner.parse_own_flags(cli_flags.define_json_flag, ["--nope"], "doc")

  with pytest.raises(SystemExit) as misspelt:
    runner.run_command(bad_flag, own_flags=True, error_status=2)
  assert misspelt.value.code == 2 and "Unknown command line flag 'nope'" in capsys.readouterr().err
