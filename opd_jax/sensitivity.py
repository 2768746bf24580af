"""Entry point: the layer-sensitivity scan.

    python -m opd_jax.sensitivity --config=configs/<name>.py[:variant] [--config.key=value ...]
        [--workdir=DIR] [--params-from=RUN] [--prompts=N] [--target-kl=X] [--json=PATH|-]
        [--png=OUT] [--candidate=rollout.weights=fp8,rollout.weight_block_size=0]
        [--candidate=rollout.kv_cache=fp8,rollout.kv_granularity=tensor]
        [--candidate=rollout.noise_sigma=0.05] [--layers=0,3] [--modules=attention,mlp|none]
        [--seq-len=4096]

Each --candidate names one perturbation to apply a layer at a time, in the admission check's
syntax: FP8 weights (`rollout.weights=fp8`, optionally with `rollout.weight_block_size`), an FP8
KV cache (`rollout.kv_cache=fp8`, optionally with `rollout.kv_granularity`) or weight noise
(`rollout.noise_sigma=S`); default all three. `--sources`, `--noise-sigma`, `--kv-granularity`
and `--weight-block-size`, the old spelling, still work for this release, with a warning.

Perturbs one decoder layer (FP8 weights, FP8 KV cache, weight noise) or one module type
(noise) at a time, measures `mismatch/kl` on N calibration prompts against the unperturbed
student (the admission check's procedure), prints a ranked table and a suggested FP8 recipe
(the layers to keep unquantized so that the whole FP8 engine reads at most --target-kl, with
its KV capacity ratio), and writes the result as JSON (default <workdir>/sensitivity.json)
with a PNG bar chart beside it (when matplotlib is installed). No training. The student is
the one a run starts from (the HF checkpoint, or the warm-started built-in student), or with
--params-from the student of that run's latest checkpoint. The logic is
`opd_jax.mismatch.sensitivity.run_sensitivity`.
"""

from __future__ import annotations

import os

from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.config.values import DEFAULT_NUM_PROMPTS

_PROMPTS = flags.DEFINE_integer("prompts", DEFAULT_NUM_PROMPTS, "Calibration prompts.")
_TARGET = flags.DEFINE_float(
  "target-kl",
  None,
  "The suggested recipe's largest mismatch/kl (nats/token); default half the all-layers FP8 "
  "mismatch.",
)
_JSON = flags.DEFINE_string(
  "json", None, "Result JSON to PATH (- = stdout); default <workdir>/sensitivity.json."
)
_CANDIDATES = flags.DEFINE_multi_string(
  "candidate",
  None,
  "A perturbation to scan a layer at a time: rollout.weights=fp8[,rollout.weight_block_size=B], "
  "rollout.kv_cache=fp8[,rollout.kv_granularity=G] or rollout.noise_sigma=S; repeat for "
  "several; default all three.",
)
_PNG = flags.DEFINE_string("png", None, "Bar chart; default the JSON path with .png.")
_PARAMS_FROM = flags.DEFINE_string(
  "params-from", None, "A trainer workdir: scan the student of its latest checkpoint."
)
_SIGMA = flags.DEFINE_float("noise-sigma", None, "Deprecated: --candidate=rollout.noise_sigma=S.")
_SOURCES = flags.DEFINE_list("sources", None, "Deprecated: --candidate (one per source).")
_LAYERS = flags.DEFINE_list("layers", [], "Decoder layers to scan; default all.")
_MODULES = flags.DEFINE_list(
  "modules", [], "Module types or groups for the noise-by-module rows; default all; none = off."
)
_KV_GRANULARITY = flags.DEFINE_string(
  "kv-granularity", None, "Deprecated: --candidate=rollout.kv_cache=fp8,rollout.kv_granularity=G."
)
_BLOCK = flags.DEFINE_integer(
  "weight-block-size", 0, "Deprecated: --candidate=rollout.weights=fp8,rollout.weight_block_size=B."
)
OLD_SCAN_FLAGS = {
  "sources": "--candidate (one per source)",
  "noise-sigma": "--candidate=rollout.noise_sigma=S",
  "kv-granularity": "--candidate=rollout.kv_cache=fp8,rollout.kv_granularity=G",
  "weight-block-size": "--candidate=rollout.weights=fp8,rollout.weight_block_size=B",
}
# The rollout keys a scan candidate may set: the source each names, and the setting it carries.
SCAN_KEYS = {
  "rollout.weights": ("fp8_weights", "fp8"),
  "rollout.kv_cache": ("fp8_kv", "fp8"),
  "rollout.noise_sigma": ("noise", None),
  "rollout.weight_block_size": (None, None),
  "rollout.kv_granularity": (None, None),
}


def scan_from_candidates(specs: list[str], config) -> dict:
  """The scan's sources and settings from --candidate specs (parsed by the admission check's
  candidate parser, `candidates.parse_candidate`).

  Returns:
    {"sources": (...), "noise_sigma", "weight_block_size", "kv_granularity"}: the values the
    candidates set, else the old flags' defaults and the config's KV granularity.
  """
  from opd_jax.mismatch import candidates, sensitivity

  out = {
    "sources": [],
    "noise_sigma": sensitivity.DEFAULT_NOISE_SIGMA,
    "weight_block_size": None,
    "kv_granularity": config.rollout.kv_granularity,
  }
  for spec in specs:
    overrides = candidates.parse_candidate(spec, config).overrides
    unknown = [k for k in overrides if k not in SCAN_KEYS]
    if unknown:
      raise ValueError(
        f"--candidate={spec}: the scan cannot perturb {', '.join(unknown)} a layer at a time; "
        f"it takes {', '.join(SCAN_KEYS)}"
      )
    named = [SCAN_KEYS[k][0] for k in overrides if SCAN_KEYS[k][0]]
    if len(named) != 1:
      raise ValueError(
        f"--candidate={spec}: name exactly one of rollout.weights=fp8, rollout.kv_cache=fp8 or "
        "rollout.noise_sigma=S per candidate"
      )
    for key, value in overrides.items():
      source, needed = SCAN_KEYS[key]
      if needed is not None and value != needed:
        raise ValueError(f"--candidate={spec}: the scan takes {key}={needed}, got {value!r}")
      if key == "rollout.noise_sigma":
        if not value > 0:
          raise ValueError(f"--candidate={spec}: rollout.noise_sigma must be > 0")
        out["noise_sigma"] = float(value)
      elif key == "rollout.weight_block_size":
        out["weight_block_size"] = int(value) or None
      elif key == "rollout.kv_granularity":
        out["kv_granularity"] = value
    if named[0] not in out["sources"]:
      out["sources"].append(named[0])
  out["sources"] = tuple(out["sources"])
  return out


_SEQ_LEN = flags.DEFINE_integer(
  "seq-len",
  None,
  "Sequence slots for the KV capacity accounting; default mismatch.sensitivity.DEFAULT_SEQ_LEN.",
)


def _layers(values: list[str]) -> tuple[int, ...]:
  try:
    return tuple(int(v) for v in values)
  except ValueError as e:
    raise ValueError(f"--layers takes layer indices, got {values}") from e


def main() -> None:
  from opd_jax.mismatch import sensitivity

  config = cli_flags.CONFIG.value
  old = [name for name in OLD_SCAN_FLAGS if flags.FLAGS[name].present]
  if old and _CANDIDATES.value:
    raise ValueError(f"give --candidate or the old --{', --'.join(old)}, not both")
  for name in old:
    cli_flags.warn_deprecated(f"--{name}", OLD_SCAN_FLAGS[name])
  if _CANDIDATES.value:
    scan = scan_from_candidates(_CANDIDATES.value, config)
  else:
    scan = {
      "sources": tuple(_SOURCES.value or sensitivity.SOURCES),
      "noise_sigma": _SIGMA.value or sensitivity.DEFAULT_NOISE_SIGMA,
      "weight_block_size": _BLOCK.value or None,
      "kv_granularity": _KV_GRANULARITY.value or config.rollout.kv_granularity,
    }
  settings = sensitivity.ScanSettings(
    layers=_layers(_LAYERS.value),
    modules=None if _MODULES.value == ["none"] else tuple(_MODULES.value),
    **scan,
  )
  if _JSON.value not in (None, "-"):
    json_target = _JSON.value
  else:
    json_target = _JSON.value or os.path.join(
      cli_flags.needed_workdir("the JSON"), "sensitivity.json"
    )
  stem = os.path.splitext(json_target)[0] if json_target != "-" else None
  png_path = (
    _PNG.value or f"{stem or os.path.join(cli_flags.needed_workdir('the PNG'), 'sensitivity')}.png"
  )
  with cli_flags.json_output(json_target) as json_path:
    sensitivity.run_sensitivity(
      config,
      params_from=_PARAMS_FROM.value,
      num_prompts=_PROMPTS.value,
      target_kl=_TARGET.value,
      settings=settings,
      seq_len=_SEQ_LEN.value or sensitivity.DEFAULT_SEQ_LEN,
      json_path=json_path,
      png_path=png_path,
      log=cli_flags.log_for_json(_JSON.value),
    )


if __name__ == "__main__":
  runner.run_command(main, required=("config",), hidden=tuple(OLD_SCAN_FLAGS))
