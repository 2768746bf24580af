"""The docs: the README's shape and commands, the strict mkdocs build, the generated reference
pages against a fresh generation, the metrics glossary against the code, and the README's three
quickstarts run in their `:tiny` form."""

import ast
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def _load_tool(name):
  spec = importlib.util.spec_from_file_location(f"_tools_{name}", REPO / "tools" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


gen = _load_tool("gen_reference")


# --- the README --------------------------------------------------------------------------------


def test_readme_is_an_entry_point_under_200_lines_without_history():
  lines = README.splitlines()
  assert len(lines) < 200, len(lines)
  assert not re.search(r"\b[0-9a-f]{7,40}\b", README.replace("arXiv:2611.11450", ""))  # no hashes
  assert not re.search(r"\bround \d", README, re.IGNORECASE)  # no study history
  for words in ("Limitations", "emulated on the CPU", "dispatch inline", "measured on CPUs"):
    assert words in README, words


def test_readme_keeps_the_run_and_test_commands_that_ci_runs():
  ci = (REPO / ".ci" / "run").read_text()
  test_line = (
    'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && pytest -q'
  )
  assert test_line in ci and test_line in README
  run_line = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && "
    "python -m opd_jax.main --config=configs/fp8_async.py --workdir=runs/fp8_async"
  )
  assert run_line in README
  assert README.index(run_line) < README.index("## Install")  # the two commands at the top


def test_every_install_command_makes_its_venv_with_the_python_ci_uses():
  """The README's two commands, CI and the docs create the venv with one interpreter name, and
  the README states the version pyproject.toml requires."""
  ci = (REPO / ".ci" / "run").read_text()
  pages = [README, *(path.read_text() for path in (REPO / "docs").rglob("*.md"))]
  pythons = {m for text in pages for m in re.findall(r"(\S+) -m venv \.venv", text)}
  assert pythons == set(re.findall(r"(\S+) -m venv \.venv", ci)) == {"python3"}, pythons
  two_commands = README[README.index("## Two commands") : README.index("## Install")]
  assert len(re.findall(r"python3 -m venv \.venv", two_commands)) == 2
  required = re.search(r'requires-python = ">=(\d+\.\d+)"', (REPO / "pyproject.toml").read_text())
  assert f"Python {required.group(1)} or newer" in two_commands


def test_readme_links_point_at_files_that_exist():
  links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
  assert links
  missing = [link for link in links if "://" not in link and not (REPO / link).exists()]
  assert not missing, missing


# --- the site ------------------------------------------------------------------------------


def test_strict_mkdocs_build_has_no_broken_link_or_missing_page(tmp_path):
  pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")
  pytest.importorskip("material", reason="mkdocs-material is not installed")
  proc = subprocess.run(
    [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


# --- generated reference pages ----------------------------------------------------------------


@pytest.mark.parametrize("page", ["config.md", "metrics.md", "records.md", "../changelog.md"])
def test_generated_page_equals_a_fresh_generation(page):
  committed = (gen.REFERENCE / page).resolve().read_text()
  assert committed == gen.PAGES[page](), f"run python tools/gen_reference.py {page}"


@pytest.mark.slow  # runs every command's --help in a process of its own
def test_commands_page_equals_every_commands_help():
  committed = (gen.REFERENCE / "commands.md").read_text()
  assert committed == gen.commands_page(), "run python tools/gen_reference.py commands.md"


def test_config_reference_lists_every_checked_key_with_its_comment():
  from opd_jax.config import check

  page = (gen.REFERENCE / "config.md").read_text()
  for key in check.RULES:
    assert f"| `{key}` |" in page, key
  assert "| `rollout.max_lag` | `1` | int ≥ 0 | async: largest weight-version lag" in page


def test_config_reference_lists_every_configs_variants():
  """Every config file defines VARIANTS, each variant builds, and its row in config.md lists
  every one (guard_demo.py's `off|warn|fallback|adaptive[,tiny]` went missing once)."""
  page = (gen.REFERENCE / "config.md").read_text()
  for path in sorted((REPO / "configs").glob("*.py")):
    variants = gen.config_variants(path)
    assert variants, path.name
    module = gen._load_module(path, f"_test_config_{path.stem}")
    for variant in variants:
      module.get_config(variant)  # raises on a variant the file does not take
    (row,) = [line for line in page.splitlines() if line.startswith(f"| `configs/{path.name}` |")]
    assert row.endswith("| " + ", ".join(f"`:{v}`" for v in variants) + " |"), row


def _choice_rows():
  """(page, key, listed values) for every docs table row whose first cell is a config key with
  a fixed set of values (check.RULES' `Choice`) and whose second cell lists two or more
  `values`, plus every inline `key` (`a | b | c`) listing; the generated reference pages and
  the changelog are left out."""
  from opd_jax.config import check

  choices = {k: r.options for k, r in check.RULES.items() if isinstance(r, check.Choice)}
  out = []
  for path in sorted((REPO / "docs").rglob("*.md")):
    if path.parent.name == "reference" or path.name == "changelog.md":
      continue
    text = path.read_text()
    for key, cell in re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \| ([^|]*) \|", text, re.M):
      listed = re.findall(r"`([^`]+)`", cell)
      if key in choices and len(listed) >= 2:
        out.append((path.name, key, listed, choices[key]))
    for key, listed in re.findall(r"`([a-z_]+\.[a-z_]+)` \(`([^`]+\|[^`]+)`", text):
      if key in choices:
        values = [v.strip() for v in listed.split("|")]
        out.append((path.name, key, values, choices[key]))
  return out


def test_docs_listing_a_keys_allowed_values_list_all_of_them():
  """A guide that lists the values of `rollout.weights` (or any key with a fixed set) lists the
  set config/check.py's RULES allows, in full (the FP8 guide once listed 3 of 7)."""
  rows = _choice_rows()
  keys = {key for _, key, _, _ in rows}
  assert {"rollout.weights", "rollout.kv_cache", "rollout.mode"} <= keys, keys
  wrong = [
    (page, key, listed) for page, key, listed, allowed in rows if set(listed) != set(allowed)
  ]
  assert not wrong, wrong


def test_describe_rule_says_what_each_kind_allows():
  from opd_jax.config import check

  assert gen.describe_rule(check.Num(lo=1)) == "int ≥ 1"
  assert gen.describe_rule(check.Num(True, 0, lo_open=True)) == "number > 0"
  assert gen.describe_rule(check.Choice(("a", "b"))) == "`a` | `b`"
  assert gen.describe_rule(check.Kind(tuple)) == "tuple of ints ≥ 0"


def test_check_mode_names_a_stale_page(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(gen, "REFERENCE", tmp_path / "reference")
  (tmp_path / "reference").mkdir()
  (tmp_path / "reference" / "metrics.md").write_text("# stale\n")
  monkeypatch.setattr(gen, "REPO", tmp_path)
  assert gen.main(["--check", "metrics.md"]) == 1
  assert "out of date: reference/metrics.md" in capsys.readouterr().err
  assert gen.main(["metrics.md"]) == 0
  assert gen.main(["--check", "metrics.md"]) == 0


# --- the metrics glossary against the code ----------------------------------------------------


def _namespaced_strings() -> set[str]:
  """Every string constant (and f-string's constant head) in the package that looks like a
  metric name: `<namespace>/...` with a namespace of the glossary."""
  names = set()
  pattern = re.compile(rf"^(?:{'|'.join(gen.METRIC_NAMESPACES)})/[A-Za-z0-9_/.<>{{}}]*$")
  for path in (REPO / "opd_jax").rglob("*.py"):
    tree = ast.parse(path.read_text())
    in_fstrings = {
      id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values
    }
    for node in ast.walk(tree):
      if id(node) in in_fstrings:
        continue
      if isinstance(node, ast.Constant) and isinstance(node.value, str):
        if pattern.match(node.value):
          names.add(node.value)
      elif isinstance(node, ast.JoinedStr) and node.values:
        head = node.values[0]
        if isinstance(head, ast.Constant) and pattern.match(head.value):
          names.add(head.value + "<…>")
  return names


def _covered(name: str) -> bool:
  for entry, *_ in gen.METRICS:
    regex = re.escape(entry)
    regex = re.sub(r"<[a-z]+>", ".+", regex.replace(r"\<", "<").replace(r"\>", ">"))
    probe = name.replace("<…>", "x")
    if re.fullmatch(regex, probe) or (name.endswith("<…>") and entry.startswith(name[:-3])):
      return True
  return False


def test_every_metric_name_in_the_code_is_in_the_glossary():
  names = _namespaced_strings()
  assert "mismatch/kl" in names and "rollout/publish_seconds" in names  # the scan sees them
  unexplained = sorted(n for n in names if n not in gen.NOT_SCALARS and not _covered(n))
  assert not unexplained, f"add these to tools/gen_reference.py METRICS: {unexplained}"


def test_every_glossary_entry_occurs_in_the_code():
  code = "\n".join(p.read_text() for p in (REPO / "opd_jax").rglob("*.py"))
  absent = []
  for name, *_ in gen.METRICS:
    head = name.split("<")[0]
    if f'"{name}"' not in code and f'"{head}' not in code and f"'{name}'" not in code:
      absent.append(name)
  # lag_<k> names are built from the base name and "/lag_"
  absent = [n for n in absent if not (n.startswith("mismatch/<name>/lag_") and "/lag_" in code)]
  assert not absent, f"in the glossary but not in the code: {absent}"


def test_glossary_covers_every_key_a_run_logged():
  logged = [
    "loss/total",
    "mismatch/kl/lag_1",
    "mismatch/abs_logp_diff/lag_0",
    "quality/student_accuracy",
    "quality/relative_accuracy",
    "rollout/version_lag_mean",
  ]
  assert all(_covered(k) for k in logged)
  assert not _covered("rollout/made_up")


# --- the README's quickstarts, tiny ------------------------------------------------------------


def quickstart_commands(readme: str) -> dict[int, list[str]]:
  """Quickstart number -> the shell commands of its ```bash block, continuations joined."""
  out = {}
  for number, block in re.findall(r"## Quickstart (\d)[^\n]*\n+```bash\n(.*?)```", readme, re.S):
    joined = block.replace("\\\n", " ")
    out[int(number)] = [
      line.split("#")[0].strip() for line in joined.splitlines() if line.split("#")[0].strip()
    ]
  return out


def tiny(command: str, tmp: Path) -> list[str]:
  """A README command in its `:tiny` form, writing under `tmp`."""
  words = shlex.split(command.replace("/tmp/mine", str(tmp / "mine")))
  out = []
  for word in words:
    if word.startswith("--config=") and ":" not in word:
      word += ":tiny"
    word = re.sub(r"(^|=)runs/", rf"\g<1>{tmp}/runs/", word)
    out.append(word)
  return out


def test_quickstart_parser_finds_three_quickstarts():
  commands = quickstart_commands(README)
  assert sorted(commands) == [1, 2, 3]
  assert commands[1][0].startswith("python -m opd_jax.main --config=configs/fp8_async.py")
  words = tiny(commands[3][0], Path("/t"))
  assert words[:3] == ["python", "-m", "opd_jax.admit"]
  assert "--config=configs/bf16_sync.py:tiny" in words
  assert "--json=/t/runs/admit/admit.json" in words


def _run(words: list[str]) -> str:
  assert words[:2] == ["python", "-m"], words
  proc = subprocess.run(
    [sys.executable, *words[1:]], cwd=REPO, capture_output=True, text=True, timeout=1200
  )
  assert proc.returncode == 0, " ".join(words) + "\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


@pytest.mark.slow  # three quickstarts: four processes that load JAX, two of them train
def test_readme_quickstarts_run_in_their_tiny_form(tmp_path):
  commands = quickstart_commands(README)
  for number in (1, 2, 3):
    for command in commands[number]:
      words = tiny(command, tmp_path)
      if words[0] == "tensorboard":
        assert importlib.util.find_spec("tensorboard") is not None
      elif words[0] == "tail":
        rows = [json.loads(line) for line in Path(words[-1]).read_text().splitlines()]
        assert "step" in rows[-1] and any("mismatch/kl" in r for r in rows)
      else:
        out = _run(words)
        if number == 3:
          assert "admitted" in out or "refused" in out
  rows = json.loads((tmp_path / "runs" / "admit" / "admit.json").read_text())
  assert len(rows["rows"]) == 2
  assert (tmp_path / "mine" / "run" / "export" / "config.json").exists()


def test_the_async_timeline_draws_each_row_of_a_bench_result(tmp_path):
  """`tools/plot_docs.py async` reads the benchmark's JSON: a sync row (one lane) and an async
  row (two lanes) give a PNG, and a row without its split is named in the error."""
  plot = _load_tool("plot_docs")
  split = {"sampling_s": 0.04, "teacher_scoring_s": 0.03, "train_step_s": 0.15}
  rows = [
    {
      "name": "sync_bf16",
      "mode": "sync",
      "step_s_mean": 0.2,
      "waiting_s_mean": 0.0,
      "split": {**split, "teacher_on": "train step"},
    },
    {
      "name": "async_fp8",
      "mode": "async",
      "step_s_mean": 0.17,
      "waiting_s_mean": 0.01,
      "split": {**split, "teacher_on": "rollout side"},
    },
  ]
  bench = tmp_path / "bench.json"
  bench.write_text(json.dumps({"seeds": 3, "rows": rows}))
  out = plot.plot_async(bench, tmp_path / "timeline.png")
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  bench.write_text(
    json.dumps({"seeds": 3, "rows": [{k: v for k, v in rows[0].items() if k != "split"}]})
  )
  with pytest.raises(KeyError, match="split"):
    plot.plot_async(bench, tmp_path / "bad.png")
