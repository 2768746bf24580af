"""Compares two training runs' logged metrics, value for value: were they the same run?

    python tools/same_metrics.py RUN_A RUN_B [--files=teacher_cache]

Reads `<run>/metrics.jsonl` of both workdirs and compares every logged row (the same steps,
the same keys, the same values bit for bit: floats as their exact repr). Keys that measure
time or throughput (`*seconds*`, `*_per_s`) and the async queue's depth at logging time differ
between any two runs and are left out; every other key (losses, mismatch/*, quality/*,
teacher/*, perf/grad_norm, rollout counts) must match. `--files`
also compares the named sub-directories file by file (sha256), e.g. the bootstrapped teacher
cache. Exits 0 when everything compared is identical, 1 otherwise, printing the first
differences.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys

TIMING = re.compile(r"seconds|_per_s$|^rollout/queue_depth$")


def read_rows(run: str) -> dict[tuple[int, int], dict]:
  """(step, line index among that step's lines) -> row, from `run/metrics.jsonl`."""
  rows, seen = {}, {}
  with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
    for line in f:
      row = json.loads(line)
      step = int(row.get("step", -1))
      seen[step] = seen.get(step, 0) + 1
      rows[(step, seen[step])] = row
  return rows


def compare_metrics(run_a: str, run_b: str) -> tuple[int, int, list[str]]:
  """(rows compared, values compared, differences) of the two runs' metrics."""
  a, b = read_rows(run_a), read_rows(run_b)
  diffs = [f"row {k} only in {run_a}" for k in sorted(a.keys() - b.keys())]
  diffs += [f"row {k} only in {run_b}" for k in sorted(b.keys() - a.keys())]
  values = 0
  for key in sorted(a.keys() & b.keys()):
    ra, rb = a[key], b[key]
    names = {n for n in ra.keys() | rb.keys() if not TIMING.search(n)}
    for name in sorted(names):
      values += 1
      if repr(ra.get(name)) != repr(rb.get(name)):
        diffs.append(f"step {key[0]} {name}: {ra.get(name)!r} != {rb.get(name)!r}")
  return len(a.keys() & b.keys()), values, diffs


def tree_hashes(root: str) -> dict[str, str]:
  out = {}
  for directory, _, files in os.walk(root):
    for name in files:
      path = os.path.join(directory, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
  return out


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("run_a")
  parser.add_argument("run_b")
  parser.add_argument("--files", action="append", default=[], help="sub-directory to hash")
  args = parser.parse_args(argv)
  rows, values, diffs = compare_metrics(args.run_a, args.run_b)
  for sub in args.files:
    ha = tree_hashes(os.path.join(args.run_a, sub))
    hb = tree_hashes(os.path.join(args.run_b, sub))
    diffs += [
      f"{sub}/{n}: differs or missing"
      for n in sorted(ha.keys() | hb.keys())
      if ha.get(n) != hb.get(n)
    ]
    print(f"{sub}: {len(ha)} files hashed")
  print(f"{rows} rows, {values} values compared (timing keys left out): {len(diffs)} differ")
  for d in diffs[:20]:
    print("  " + d)
  return 1 if diffs or not rows else 0


if __name__ == "__main__":
  sys.exit(main())
