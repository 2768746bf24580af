"""The budget file: a fitted `Budget` as JSON, with the fingerprint of the setup it was fitted on.

The I/O half of the budget (the fit is pure, in `budget_fit.py`): writing and reading the file,
fingerprinting a student/teacher/engine setup, and saying what changed when a saved fingerprint
no longer matches (a stale budget must be recalibrated). The schema, what a file without "rule",
"sources" or "min_crossing_records" loads as, and the two students a fingerprint names are in
docs/budget_rules.md ("The file's schema"). The name "uncalibrated" (`budget.UNCALIBRATED`)
stands for the uncalibrated default where a budget file is asked for: no file is read (a file
of that name is reachable as `./uncalibrated`). Numbers are written with Python's shortest
round-trip repr, so a saved and reloaded Budget compares equal to the original.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
from etils import epath

from opd_jax.mismatch import budget as budget_lib
from opd_jax.mismatch import budget_fit
from opd_jax.model.config import ModelConfig

SCHEMA = "opd_jax.budget"
VERSION = 1
_HASH_SHOWN = 12  # hex digits of a weights hash shown in a stale reason
RUN_START_KEY = "run_start_weights_sha256"  # fingerprint["student"]: the runs' start student


def weights_sha256(params) -> str:
  """sha256 over a params pytree, in jax's fixed flattening order (dict keys sorted).

  For each leaf, in order: its key path, dtype name and shape as one text line, then its bytes in
  C order and native byte order (little-endian on every platform jax supports). Key paths and
  shapes are hashed so that the same bytes under a different structure hash differently; QArray
  leaves contribute their fp8 values and their scales.

  Args:
    params: a pytree of arrays; every jax.Array must be fully addressable from this process.

  Returns:
    The hex digest (64 characters).
  """
  import jax  # here, not at the top: reading and writing a budget file needs no JAX

  digest = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      raise ValueError(
        f"weights_sha256: leaf {jax.tree_util.keystr(path)} spans several processes; gather it "
        "to every process first (jax.experimental.multihost_utils.process_allgather)"
      )
    arr = np.ascontiguousarray(np.asarray(jax.device_get(leaf)))
    digest.update(f"{jax.tree_util.keystr(path)}|{arr.dtype.name}|{arr.shape}\n".encode())
    digest.update(arr.reshape(-1).view(np.uint8))
  return digest.hexdigest()


def _architecture(cfg, who: str) -> dict[str, Any]:
  if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
    return dataclasses.asdict(cfg)
  if isinstance(cfg, Mapping):
    return dict(cfg)
  raise ValueError(f"fingerprint: {who}_cfg must be a dataclass or a mapping, got {type(cfg)}")


def fingerprint(
  student_cfg, student_params, teacher_cfg, teacher_params, quant_format: str
) -> dict:
  """The identity of the setup a budget is calibrated on.

  Args:
    student_cfg: the student's ModelConfig (any dataclass or mapping describing the architecture).
    student_params: the student's params pytree (the trainer's weights, before any engine
      transform).
    teacher_cfg: the teacher's ModelConfig.
    teacher_params: the teacher's params pytree.
    quant_format: the quantization format the budget is for, e.g. "fp8_e4m3/channel".

  Returns:
    A JSON-native dict: {"student": {"architecture", "weights_sha256"}, "teacher": {…},
    "quant_format", "backend" (jax.default_backend()), "device_kind" (of jax.devices()[0]),
    "jax_version", "jaxlib_version"}.
  """
  import jax
  import jaxlib

  if not isinstance(quant_format, str):
    raise ValueError(f"fingerprint: quant_format must be a str, got {quant_format!r}")
  fp = {
    "student": {
      "architecture": _architecture(student_cfg, "student"),
      "weights_sha256": weights_sha256(student_params),
    },
    "teacher": {
      "architecture": _architecture(teacher_cfg, "teacher"),
      "weights_sha256": weights_sha256(teacher_params),
    },
    "quant_format": quant_format,
    "backend": jax.default_backend(),
    "device_kind": jax.devices()[0].device_kind,
    "jax_version": jax.__version__,
    "jaxlib_version": jaxlib.__version__,
  }
  # Tuples become lists, as in a loaded file, so that a saved and a fresh fingerprint compare.
  return json.loads(json.dumps(fp))


def with_run_start(fp: Mapping, run_start_params) -> dict:
  """`fp` with the hash of the student the calibration runs started from, as
  fingerprint["student"][RUN_START_KEY] (docs/budget_rules.md, "The file's schema")."""
  out = json.loads(json.dumps(fp))
  out["student"][RUN_START_KEY] = weights_sha256(run_start_params)
  return out


_LABELS = {
  "quant_format": "quantization format",
  "backend": "backend",
  "device_kind": "device kind",
  "jax_version": "jax version",
  "jaxlib_version": "jaxlib version",
}


def _label(path: tuple[str, ...]) -> str:
  if len(path) == 1 and path[0] in _LABELS:
    return _LABELS[path[0]]
  if len(path) >= 2 and path[1] == "architecture":
    return " ".join([path[0], "architecture", *path[2:]])
  return ".".join(path)


def _added_at_default(path: tuple[str, ...], key: str, value) -> bool:
  """Whether `key` is a ModelConfig field that a budget saved before the field existed lacks,
  at its default value: the same architecture, so not a reason to recalibrate."""
  if len(path) != 2 or path[1] != "architecture":
    return False
  field = ModelConfig.__dataclass_fields__.get(key)
  return field is not None and field.default is not dataclasses.MISSING and value == field.default


def _diff(saved, current, path: tuple[str, ...], out: list[str]):
  if isinstance(saved, Mapping) and isinstance(current, Mapping):
    keys = list(saved) + [k for k in current if k not in saved]
    for key in keys:
      sub = (*path, str(key))
      if key not in current:
        out.append(f"{_label(sub)} is in the saved fingerprint but not in the current one")
      elif key not in saved:
        if not _added_at_default(path, key, current[key]):
          out.append(f"{_label(sub)} is in the current fingerprint but not in the saved one")
      else:
        _diff(saved[key], current[key], sub, out)
    return
  if saved == current:
    return
  if path[-1] == "weights_sha256" and isinstance(saved, str) and isinstance(current, str):
    out.append(
      f"{path[0]} weights hash changed: {saved[:_HASH_SHOWN]}… -> {current[:_HASH_SHOWN]}…"
    )
  elif len(path) == 1 and path[0] in _LABELS:
    out.append(f"{_label(path)} {saved} -> {current}")
  else:
    out.append(f"{_label(path)} changed: {saved!r} -> {current!r}")


NO_FINGERPRINT = (
  "the budget file has no fingerprint: it was fitted from records imported from another "
  'stack\'s logs (python -m opd_jax.fit_budget; its "provenance" says which), not measured on '
  "this student, teacher and engine, so nothing shows that its limit holds here"
)


def stale_reasons(saved_fp: Mapping, current_fp: Mapping, *, at_run_start=False) -> list[str]:
  """What differs between a saved fingerprint and the current one; empty when the budget holds.

  An empty saved fingerprint (a budget fitted from imported records) gives the one reason
  `NO_FINGERPRINT`: the admission check and the live guard then need their force flag.

  One line per differing leaf, e.g. "student weights hash changed: 3f2a… -> 9b1c…",
  "jax version 0.10.1 -> 0.10.2", "teacher architecture num_layers changed: 4 -> 8",
  "quantization format fp8/channel -> fp8/block128". A ModelConfig field that the saved
  fingerprint predates is no change while it holds its default (a budget saved before
  `logical_vocab_size` existed still matches an unpadded model).

  `at_run_start`: `current_fp` is of a training run's starting student, so the saved student
  is the one the calibration runs started from (RUN_START_KEY) where the file records it, and
  the measured one otherwise. The saved RUN_START_KEY is never itself a difference.
  """
  if not saved_fp:
    return [NO_FINGERPRINT]
  saved = json.loads(json.dumps(saved_fp))
  student = saved.get("student")
  if isinstance(student, dict) and RUN_START_KEY in student:
    run_start = student.pop(RUN_START_KEY)
    if at_run_start:
      student["weights_sha256"] = run_start
  out: list[str] = []
  _diff(saved, current_fp, (), out)
  return out


def _threshold_dict(t: budget_lib.Threshold) -> dict[str, Any]:
  return {
    "max_kl": t.max_kl,
    "interval": list(t.interval),
    "censored": t.censored,
    "curve": {budget_lib.KL_KEY: list(t.curve_kl), budget_lib.DROP_KEY: list(t.curve_drop)},
    "num_records": t.num_records,
  }


def _json_default(value):
  if isinstance(value, np.generic | np.ndarray):
    return value.tolist()
  raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _body(budget: budget_lib.Budget) -> dict[str, Any]:
  body = {
    "tolerance": budget.tolerance,
    "level": budget.level,
    "num_bootstrap": budget.num_bootstrap,
    "seed": budget.seed,
    "min_crossing_records": budget.min_crossing_records,
    **_threshold_dict(budget.overall),
    "layers": [{"layer": i, **_threshold_dict(t)} for i, t in sorted(budget.layers.items())],
    "unfitted_layers": list(budget.unfitted_layers),
    "sources": [{"source": k, **_threshold_dict(t)} for k, t in sorted(budget.sources.items())],
    "records": [dict(r) for r in budget.records],
    # for readers: both are recomputed from the records on load
    "calibrated_range": {k: list(v) for k, v in budget.calibrated_range.items()},
    "probe_spread": dict(budget.probe_spread),
  }
  if budget.code_provenance is not None:
    body["code_provenance"] = dict(budget.code_provenance)
  if budget.training is not None:
    body["training"] = _body(budget.training)
  return body


def rule_dict(rule: budget_lib.Rule) -> dict[str, Any]:
  """A rule as the file's "rule" entry: {"name", "params", "validation"}."""
  return {"name": rule.name, "params": dict(rule.params), "validation": rule.validation}


def budget_to_json(budget: budget_lib.Budget, fingerprint: Mapping) -> str:
  """The budget file's text (schema: docs/budget_rules.md); "rule" only when the budget
  names one, "provenance" only when it has one (a budget fitted from imported records, whose
  fingerprint is empty: `NO_FINGERPRINT`)."""
  doc: dict[str, Any] = {"schema": SCHEMA, "version": VERSION}
  if budget.rule is not None:
    doc["rule"] = rule_dict(budget.rule)
  if budget.provenance is not None:
    doc["provenance"] = dict(budget.provenance)
  doc.update(budget=_body(budget), fingerprint=dict(fingerprint))
  return json.dumps(doc, indent=1, default=_json_default) + "\n"


class _Reader:
  """Typed access to the parsed document; errors name the file and the JSON path."""

  def __init__(self, source: str):
    self.source = source

  def fail(self, where: str, problem: str):
    raise ValueError(f"budget file {self.source}: {where}: {problem}")

  def get(self, obj: Mapping, key: str, where: str):
    if key not in obj:
      self.fail(where, f"missing key {key!r}")
    return obj[key]

  def obj(self, obj: Mapping, key: str, where: str) -> Mapping:
    value = self.get(obj, key, where)
    if not isinstance(value, Mapping):
      self.fail(f"{where}.{key}", f"expected an object, got {value!r}"[:200])
    return value

  def num(self, obj: Mapping, key: str, where: str) -> float:
    value = self.get(obj, key, where)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
      self.fail(f"{where}.{key}", f"expected a finite number, got {value!r}")
    return float(value)

  def integer(self, obj: Mapping, key: str, where: str) -> int:
    value = self.get(obj, key, where)
    if isinstance(value, bool) or not isinstance(value, int):
      self.fail(f"{where}.{key}", f"expected an integer, got {value!r}")
    return value

  def nums(self, obj: Mapping, key: str, where: str, length: int | None = None) -> tuple:
    value = self.get(obj, key, where)
    if (
      not isinstance(value, list)
      or (length is not None and len(value) != length)
      or (length is None and not value)
      or any(
        isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) for v in value
      )
    ):
      size = f"{length} " if length is not None else "a non-empty list of "
      self.fail(f"{where}.{key}", f"expected {size}finite numbers, got {value!r}"[:300])
    return tuple(float(v) for v in value)

  def name(self, obj: Mapping, key: str, where: str) -> str:
    value = self.get(obj, key, where)
    if not isinstance(value, str) or not value:
      self.fail(f"{where}.{key}", f"expected a non-empty string, got {value!r}"[:200])
    return value

  def thresholds(self, entries, key: str, read_id, at: str) -> dict:
    """<at>.<key>: a list of thresholds, each keyed by its "layer" (read_id = self.integer)
    or its "source" (read_id = self.name)."""
    if not isinstance(entries, list):
      self.fail(f"{at}.{key}", f"expected a list, got {entries!r}"[:200])
    out = {}
    for j, entry in enumerate(entries):
      where = f"{at}.{key}[{j}]"
      if not isinstance(entry, Mapping):
        self.fail(where, f"expected an object, got {entry!r}"[:200])
      out[read_id(entry, key.removesuffix("s"), where)] = self.threshold(entry, where)
    return out

  def threshold(self, obj: Mapping, where: str) -> budget_lib.Threshold:
    censored = self.get(obj, "censored", where)
    if censored not in budget_lib.CENSORED:
      self.fail(f"{where}.censored", f"expected one of {budget_lib.CENSORED}, got {censored!r}")
    curve = self.obj(obj, "curve", where)
    curve_kl = self.nums(curve, budget_lib.KL_KEY, f"{where}.curve")
    curve_drop = self.nums(curve, budget_lib.DROP_KEY, f"{where}.curve", len(curve_kl))
    return budget_lib.Threshold(
      max_kl=self.num(obj, "max_kl", where),
      interval=self.nums(obj, "interval", where, 2),
      censored=censored,
      curve_kl=curve_kl,
      curve_drop=curve_drop,
      num_records=self.integer(obj, "num_records", where),
    )

  def rule(self, doc: Mapping) -> budget_lib.Rule | None:
    """The document's "rule"; None (which `budget_rules.apply_rule` reads as the pooled rule),
    with a warning, when it names none."""
    if "rule" not in doc:
      warnings.warn(
        f"budget file {self.source} names no admission rule, so it is read with the pooled "
        "limit (one max_kl for every source); add the rule its study validated "
        '("rule": {"name": ..., "params": ..., "validation": ...}, docs/budget_rules.md) or '
        "refit it with python -m opd_jax.study, which records it",
        UserWarning,
        stacklevel=4,
      )
      return None
    entry = self.obj(doc, "rule", "top level")
    name = self.name(entry, "name", "rule")
    params = entry.get("params", {})
    validation = entry.get("validation")
    try:
      return budget_lib.Rule(
        name, dict(params) if isinstance(params, Mapping) else params, validation
      )
    except ValueError as e:
      self.fail("rule", str(e))

  def provenance(self, doc: Mapping) -> dict | None:
    """The document's "provenance" (absent in files fitted from this project's own
    measurements: None)."""
    if "provenance" not in doc:
      return None
    return dict(self.obj(doc, "provenance", "top level"))

  def min_crossing_records(self, body: Mapping, where: str) -> int:
    """The body's "min_crossing_records", 1 when absent (files written before it)."""
    if "min_crossing_records" not in body:
      return 1
    value = self.integer(body, "min_crossing_records", where)
    if value < 1:
      self.fail(f"{where}.min_crossing_records", f"expected an integer >= 1, got {value}")
    return value

  def budget(self, body: Mapping, where: str) -> budget_lib.Budget:
    """One budget body (the top one at "budget", its training-axis fit at "budget.training")."""
    layers = self.thresholds(self.get(body, "layers", where), "layers", self.integer, where)
    unfitted = self.get(body, "unfitted_layers", where)
    if not isinstance(unfitted, list) or any(
      isinstance(i, bool) or not isinstance(i, int) for i in unfitted
    ):
      self.fail(f"{where}.unfitted_layers", f"expected a list of integers, got {unfitted!r}"[:200])
    # "sources" is absent in files written before per-source limits
    sources = self.thresholds(body.get("sources", []), "sources", self.name, where)
    records = self.get(body, "records", where)
    if not isinstance(records, list):
      self.fail(f"{where}.records", f"expected a list, got {records!r}"[:200])
    try:
      budget_fit.validate_records(records)
    except ValueError as e:
      self.fail(f"{where}.records", str(e).removeprefix("fit_budget: "))
    training = body.get("training")
    if training is not None:
      if not isinstance(training, Mapping) or "training" in training:
        self.fail(f"{where}.training", "expected a budget object without its own training fit")
      training = self.budget(training, f"{where}.training")
    return budget_lib.Budget(
      tolerance=self.num(body, "tolerance", where),
      overall=self.threshold(body, where),
      layers=layers,
      unfitted_layers=tuple(unfitted),
      records=tuple(dict(rec) for rec in records),
      sources=sources,
      level=self.num(body, "level", where),
      num_bootstrap=self.integer(body, "num_bootstrap", where),
      seed=self.integer(body, "seed", where),
      training=training,
      min_crossing_records=self.min_crossing_records(body, where),
      code_provenance=self.code_provenance(body, where),
    )

  def code_provenance(self, body: Mapping, where: str) -> dict | None:
    """The body's "code_provenance" (`io.provenance`), None when absent (files before it)."""
    value = body.get("code_provenance")
    if value is not None and not isinstance(value, Mapping):
      self.fail(f"{where}.code_provenance", f"expected an object, got {value!r}"[:200])
    return None if value is None else dict(value)


def budget_from_json(text: str, source: str = "<string>") -> tuple[budget_lib.Budget, dict]:
  """Parses a budget file's text; `source` names it in errors.

  Returns:
    (Budget, fingerprint dict); the Budget's `rule` is the file's, or None (the pooled rule for
    `budget_rules.apply_rule`), with a UserWarning naming the file, when the file names none;
    its `provenance` is the file's, or None. The fingerprint is {} for a budget fitted from
    imported records (`NO_FINGERPRINT`).

  Raises:
    ValueError: text that is not JSON, an unknown rule or rule parameter, another schema or
      version, a missing or mistyped field; the message starts with "budget file <source>:"
      and gives the JSON path.
  """
  r = _Reader(source)
  try:
    doc = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"budget file {source}: not valid JSON ({e})") from e
  if not isinstance(doc, Mapping):
    r.fail("top level", f"expected an object, got {type(doc).__name__}")
  if doc.get("schema") != SCHEMA:
    r.fail("schema", f"expected {SCHEMA!r}, got {doc.get('schema')!r}")
  if doc.get("version") != VERSION:
    r.fail("version", f"expected {VERSION}, got {doc.get('version')!r} (refit the budget)")
  body = r.obj(doc, "budget", "top level")
  fp = r.obj(doc, "fingerprint", "top level")
  budget = r.budget(body, "budget")
  return dataclasses.replace(budget, rule=r.rule(doc), provenance=r.provenance(doc)), dict(fp)


def save_budget(path, budget: budget_lib.Budget, fingerprint: Mapping) -> None:
  """Writes the budget file at `path`, a local path or a URI such as gs://bucket/budget.json
  (`etils.epath`; parents created; written to a temporary file first and renamed, so a reader
  never sees half a file)."""
  path = epath.Path(path)
  text = budget_to_json(budget, fingerprint)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(text, encoding="utf-8")
  tmp.replace(path)


def load_budget(path) -> tuple[budget_lib.Budget, dict]:
  """Reads a budget file written by `save_budget` (a local path or a URI, as there).

  Returns:
    (Budget, fingerprint dict); compare the fingerprint with `stale_reasons`.

  Raises:
    FileNotFoundError: no file at `path`.
    ValueError: a corrupt file or another schema; the message names the file.
  """
  path = epath.Path(path)
  try:
    text = path.read_text(encoding="utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"budget file {path}: not UTF-8 text ({e})") from e
  return budget_from_json(text, source=str(path))


def load_budget_or_default(path) -> tuple[budget_lib.Budget, dict | None]:
  """`load_budget(path)`, or, when `path` is `budget.UNCALIBRATED`, the uncalibrated default
  (`budget.uncalibrated_budget`) with no fingerprint (None: nothing to compare, nothing stale).

  Raises:
    as `load_budget`.
  """
  if str(path) == budget_lib.UNCALIBRATED:
    return budget_lib.uncalibrated_budget(), None
  return load_budget(path)
