"""The format lookup table: a baseline that measures nothing, read off the calibration labels of
the dose ladders alone, and the held-out draw that aims at a share of settings degrading by it.

Parts and ladders (`parts`). A candidate's engine is split into its sources
(`candidates.engine_roles`); each part sits on one ladder at one rung:

  weights   ladder "<format>_weights" (INT4, FP4, FP8 E4M3, ...); rung, finest first: a group
            of g inputs (g ascending) < one scale per output channel < one per tensor. A recipe
            with b×b block scales or some layers left in BF16 is a ladder of its own
            ("<format>_weights+block=b", "+bf16_layers=(...)").
  KV cache  ladder "<format>_kv", "+bf16_layers=(0,)" when those layers stay in BF16 (and
            "+headroom=h" for a per-tensor headroom other than the default); rung: per token
            and head < per tensor.
  lag       ladder "stale"; rung the effective lag k: synchronous stale k counts as k, async
            `max_lag` L as L.
  noise     ladder "noise" (with "+noise_layers=...", "+noise_modules=..." when restricted);
            rung σ.
  other     kernel, output head: a ladder of the source's name, with no rungs.

The table (`table_from_verdicts`, `table_from_rows`). From the calibration settings of one
source each, labelled kept or degraded: per ladder, the finest rung that degraded, r*. A part
is refused iff its ladder has an r* and its rung ≥ r* ("refuse at or coarser than the finest
rung that degraded"); a part whose ladder no calibration setting covers, or none of whose
calibration rungs degraded, is admitted. A combination is refused iff one of its parts is
(`admits`). Calibration combinations are left out: their loss cannot be put on one ladder.

The draw (`draw_held_out`). The held-out settings of a pre-registered round: fixed single
rungs first (`singles`), then combinations drawn with `random.Random(seed)` (only `random()`)
from knobs (probability, values): each knob present with its probability, its value uniform.
A drawn combination is taken only while its class is not full, the class being the table's verdict
("going by the ladders": predicted degraded iff the table refuses it), so that exactly
round(share · size) settings are predicted degraded. A draw that restates a calibration
setting or an earlier one (the same set of `key=value` items) is skipped. Everything is a
function of its arguments.
"""

from __future__ import annotations

import dataclasses
import json
import random
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from opd_jax.config import values
from opd_jax.mismatch import candidates as candidates_lib

STALE_LADDER = candidates_lib.STALE
KV_RUNGS = {"token_head": 0, "tensor": 1}  # per token and head < per tensor
GROUP, CHANNEL, TENSOR = 0, 1, 2  # weight recipes, finest first
MIN_SHARE, MAX_SHARE = 0.3, 0.5  # the predicted-degraded share a draw may aim at
DEFAULT_HEADROOM = 2.0  # kvcache.KVCacheSpec.tensor_headroom's default


@dataclasses.dataclass(frozen=True, order=True)
class Part:
  """One source of a candidate on its ladder.

  Attributes:
    ladder: the ladder's name (module docstring).
    rung: its position on the ladder, compared as a tuple (larger is coarser); () on a ladder
      without rungs (every part of it alike).
    label: the rung in words ("group 32", "per tensor", "k 8").
  """

  ladder: str
  rung: tuple[float, ...]
  label: str


def _weights_part(fields: Mapping[str, Any]) -> Part:
  fmt = candidates_lib.WEIGHT_SOURCES.get(fields["weights"], f"{fields['weights']}_weights")
  extra = "".join(
    f"+{name}={fields[key]}"
    for key, name in (("weight_block_size", "block"), ("bf16_layers", "bf16_layers"))
    if fields[key]
  )
  if fields["weight_per_tensor"]:
    rung, label = (TENSOR, 0), "per tensor"
  elif fields["weight_group_size"]:
    g = int(fields["weight_group_size"])
    rung, label = (GROUP, g), f"group {g}"
  else:
    rung, label = (CHANNEL, 0), "per channel"
  return Part(fmt + extra, rung, label)


def _kv_part(fields: Mapping[str, Any]) -> Part:
  fmt = candidates_lib.KV_SOURCES.get(fields["kv.dtype"], f"{fields['kv.dtype']}_kv")
  extra = f"+bf16_layers={fields['kv.bf16_layers']}" if fields["kv.bf16_layers"] else ""
  gran = fields["kv.granularity"]
  if gran == "tensor" and float(fields["kv.tensor_headroom"]) != DEFAULT_HEADROOM:
    extra += f"+headroom={fields['kv.tensor_headroom']:g}"
  label = "per tensor" if gran == "tensor" else "per token and head"
  return Part(fmt + extra, (KV_RUNGS[gran],), label)


def _noise_part(fields: Mapping[str, Any]) -> Part:
  extra = "".join(
    f"+{key}={fields[key]}" for key in ("noise_layers", "noise_modules") if fields[key]
  )
  sigma = float(fields["noise_sigma"])
  return Part(candidates_lib.NOISE + extra, (sigma,), f"σ {sigma:g}")


def parts(spec: str, run_cfg) -> list[Part]:
  """The parts of candidate `spec` (module docstring), in `candidates.SOURCE_ORDER`; [] for the
  trainer's own engine.

  Raises:
    ValueError: a spec the admission check refuses (`candidates.parse_candidate`).
  """
  c = candidates_lib.parse_candidate(spec, run_cfg)
  dtype = candidates_lib.compute_dtype(c.config)
  reference = candidates_lib.reference_engine(c.config)
  fields = candidates_lib.effective_fields(c.engine_cfg, dtype)
  out = []
  for role in candidates_lib.engine_roles(c.engine_cfg, c.lag, reference, dtype):
    if role == candidates_lib.WEIGHTS:
      out.append(_weights_part(fields))
    elif role == candidates_lib.KV:
      out.append(_kv_part(fields))
    elif role == candidates_lib.STALE:
      out.append(Part(STALE_LADDER, (int(c.lag),), f"k {c.lag}"))
    elif role == candidates_lib.NOISE:
      out.append(_noise_part(fields))
    else:
      out.append(Part(role, (), role))
  return out


def table_from_verdicts(verdicts: Mapping[str, bool], run_cfg) -> dict[str, dict[str, Any]]:
  """The lookup table from calibration labels, spec -> kept quality (module docstring).

  Returns:
    ladder -> {"rungs": how many single-source calibration settings sit on it, "degraded": how
    many of them degraded, "refuse_from": the finest degraded rung's label or None,
    "refuse_rung": its rung as a list or None}, ladders sorted by name.
  """
  table: dict[str, dict[str, Any]] = {}
  for spec, kept in verdicts.items():
    own = parts(spec, run_cfg)
    if len(own) != 1:  # a combination, or the reference: on no one ladder
      continue
    (part,) = own
    entry = table.setdefault(
      part.ladder, {"rungs": 0, "degraded": 0, "refuse_from": None, "refuse_rung": None}
    )
    entry["rungs"] += 1
    if kept:
      continue
    entry["degraded"] += 1
    if entry["refuse_rung"] is None or list(part.rung) < entry["refuse_rung"]:
      entry.update(refuse_from=part.label, refuse_rung=list(part.rung))
  return dict(sorted(table.items()))


def calibration_verdicts(rows: Sequence[Mapping], tolerance: float, drop_key: str):
  """spec -> kept quality (the mean drop over its runs `drop_key` ≤ τ) of a study's
  calibration rows."""
  return {r["spec"]: bool(r[drop_key] <= tolerance) for r in rows if r["role"] == "calibration"}


def table_from_rows(rows: Sequence[Mapping], tolerance: float, run_cfg, drop_key: str):
  """`table_from_verdicts` on a study's calibration rows (`calibration_verdicts`)."""
  return table_from_verdicts(calibration_verdicts(rows, tolerance, drop_key), run_cfg)


def refused_parts(spec: str, table: Mapping[str, Mapping], run_cfg) -> list[Part]:
  """The parts of `spec` the table refuses: on a ladder with a finest degraded rung r*, at a
  rung ≥ r*."""
  out = []
  for part in parts(spec, run_cfg):
    entry = table.get(part.ladder)
    if entry and entry["refuse_rung"] is not None and list(part.rung) >= entry["refuse_rung"]:
      out.append(part)
  return out


def admits(spec: str, table: Mapping[str, Mapping], run_cfg) -> bool:
  """The lookup table's verdict: admitted iff it refuses none of the parts."""
  return not refused_parts(spec, table, run_cfg)


def _canonical(spec: str) -> frozenset[str]:
  return frozenset(item.strip() for item in values.split_spec(spec) if item.strip())


def _uniform(rng: random.Random, values: Sequence[str]) -> str:
  return values[min(int(rng.random() * len(values)), len(values) - 1)]


def draw_held_out(
  verdicts: Mapping[str, bool],
  run_cfg,
  *,
  seed: int,
  size: int,
  degraded_share: float,
  singles: Sequence[str],
  knobs: Sequence[tuple[float, Sequence[str]]],
  max_draws_per_setting: int = 1000,
) -> list[tuple[str, bool]]:
  """The held-out settings (module docstring) with their predicted label.

  Args:
    verdicts: calibration spec -> kept quality (the ladders' labels); every one is excluded.
    run_cfg: the run config the specs are parsed against.
    seed: `random.Random`'s seed.
    size: how many settings, singles included.
    degraded_share: the share predicted degraded, in [MIN_SHARE, MAX_SHARE];
      round(degraded_share · size) settings are.
    singles: settings taken first, in order, whatever their prediction.
    knobs: (probability, values) per knob; a drawn combination joins the chosen values.
    max_draws_per_setting: draws allowed per setting to fill before giving up.

  Returns:
    [(spec, predicted degraded)], singles first, then the combinations in draw order.

  Raises:
    ValueError: a share outside [MIN_SHARE, MAX_SHARE], a single that is a calibration setting
      or is given twice, singles alone over a class's count, a spec the admission check
      refuses, or knobs that cannot fill a class within the draws allowed (the message says
      which class and what the table refuses).
  """
  if not MIN_SHARE <= degraded_share <= MAX_SHARE:
    raise ValueError(f"degraded_share={degraded_share} is not in [{MIN_SHARE}, {MAX_SHARE}]")
  table = table_from_verdicts(verdicts, run_cfg)
  want = {True: round(degraded_share * size), False: size - round(degraded_share * size)}
  seen = {_canonical(s) for s in verdicts}
  out: list[tuple[str, bool]] = []
  for spec in singles:
    if _canonical(spec) in seen:
      raise ValueError(f"single {spec!r} is a calibration setting or is given twice")
    seen.add(_canonical(spec))
    out.append((spec, not admits(spec, table, run_cfg)))
  for degraded, n in want.items():
    have = sum(d == degraded for _, d in out)
    if have > n:
      raise ValueError(
        f"the singles alone hold {have} settings predicted {_word(degraded)}, over the {n} "
        f"of size {size} at share {degraded_share}"
      )
  rng = random.Random(seed)
  for _ in range(max_draws_per_setting * size):
    if len(out) == size:
      break
    items = [_uniform(rng, values) for p, values in knobs if rng.random() < p]
    spec = ",".join(items)
    if not spec or _canonical(spec) in seen:
      continue
    degraded = not admits(spec, table, run_cfg)
    if sum(d == degraded for _, d in out) < want[degraded]:
      seen.add(_canonical(spec))
      out.append((spec, degraded))
  if len(out) < size:
    short = [d for d in want if sum(x == d for _, x in out) < want[d]]
    raise ValueError(
      f"{max_draws_per_setting * size} draws left the class predicted {_word(short[0])} short "
      f"of {want[short[0]]}: the ladders' table refuses "
      f"{refusal_text(table) or 'nothing'}; change the knobs or the share"
    )
  return out


def _word(degraded: bool) -> str:
  return "degraded" if degraded else "kept"


def refusal_text(table: Mapping[str, Mapping]) -> str:
  """What the table refuses, in words: "int4_weights from group 32, stale from k 8"."""
  return ", ".join(
    f"{ladder} from {e['refuse_from']}" for ladder, e in table.items() if e["refuse_from"]
  )


LINE_LENGTH = 100  # the project's (pyproject.toml, ruff)


def _spec_lines(spec: str, comment: str) -> list[str]:
  """One setting of a pasted tuple: `"spec",  # comment` when it fits in LINE_LENGTH, else
  the spec split after its items' commas into strings that concatenate, within parentheses."""
  line = f"  {json.dumps(spec)},  # {comment}"
  if len(line) <= LINE_LENGTH:
    return [line]
  chunks, current = [], ""
  for item in values.split_spec(spec):
    piece = item if not current else f"{current},{item}"
    if current and len(json.dumps(piece + ",")) + 4 > LINE_LENGTH:
      chunks.append(current + ",")
      current = item
    else:
      current = piece
  chunks.append(current)
  return ["  (", *(f"    {json.dumps(c)}" for c in chunks), f"  ),  # {comment}"]


def literal_lines(drawn: Sequence[tuple[str, bool]], table: Mapping[str, Mapping]) -> list[str]:
  """The draw as Python lines to paste into a config: comments saying what the table refuses
  and the predicted share, then `HELD_OUT = (...)` with each setting's prediction (lines of
  at most LINE_LENGTH characters, as the project's formatter leaves them)."""
  degraded = sum(d for _, d in drawn)
  refuses = textwrap.wrap(
    f"The ladders' lookup table refuses {refusal_text(table) or 'nothing'}. Predicted "
    f"degraded by it: {degraded} of {len(drawn)}.",
    LINE_LENGTH - 2,
  )
  return [
    *(f"# {line}" for line in refuses),
    "HELD_OUT = (",
    *(line for spec, d in drawn for line in _spec_lines(spec, f"predicted {_word(d)}")),
    ")",
  ]
