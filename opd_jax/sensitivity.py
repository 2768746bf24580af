"""Entry point: the layer-sensitivity scan.

    python -m opd_jax.sensitivity --config=configs/<name>.py[:variant] [--config.key=value ...]
        [--workdir=DIR] [--params-from=RUN] [--prompts=N] [--target-kl=X] [--json=OUT]
        [--png=OUT] [--noise-sigma=S] [--sources=fp8_weights,fp8_kv,noise] [--layers=0,3]
        [--modules=attention,mlp|none] [--kv-granularity=tensor] [--seq-len=4096]

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
import sys

from absl import app, flags, logging

from opd_jax.cli import flags as cli_flags
from opd_jax.mismatch import admission, sensitivity

_PROMPTS = flags.DEFINE_integer("prompts", admission.DEFAULT_NUM_PROMPTS, "Calibration prompts.")
_TARGET = flags.DEFINE_float(
  "target-kl",
  None,
  "The suggested recipe's largest mismatch/kl (nats/token); default half the all-layers FP8 "
  "mismatch.",
)
_JSON = flags.DEFINE_string("json", None, "Result JSON; default <workdir>/sensitivity.json.")
_PNG = flags.DEFINE_string("png", None, "Bar chart; default the JSON path with .png.")
_PARAMS_FROM = flags.DEFINE_string(
  "params-from", None, "A trainer workdir: scan the student of its latest checkpoint."
)
_SIGMA = flags.DEFINE_float("noise-sigma", sensitivity.DEFAULT_NOISE_SIGMA, "Noise rows' sigma.")
_SOURCES = flags.DEFINE_list("sources", list(sensitivity.SOURCES), "Sources to scan.")
_LAYERS = flags.DEFINE_list("layers", [], "Decoder layers to scan; default all.")
_MODULES = flags.DEFINE_list(
  "modules", [], "Module types or groups for the noise-by-module rows; default all; none = off."
)
_KV_GRANULARITY = flags.DEFINE_string(
  "kv-granularity", None, "FP8 KV scales (token_head | tensor); default the config's."
)
_BLOCK = flags.DEFINE_integer("weight-block-size", 0, "FP8 weight scales: 0 per channel, b blocks.")
_SEQ_LEN = flags.DEFINE_integer(
  "seq-len", sensitivity.DEFAULT_SEQ_LEN, "Sequence slots for the KV capacity accounting."
)


def _layers(values: list[str]) -> tuple[int, ...]:
  try:
    return tuple(int(v) for v in values)
  except ValueError as e:
    raise ValueError(f"--layers takes layer indices, got {values}") from e


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  config = flags.FLAGS.config
  json_path = _JSON.value or os.path.join(flags.FLAGS.workdir, "sensitivity.json")
  png_path = _PNG.value or os.path.splitext(json_path)[0] + ".png"
  try:
    settings = sensitivity.ScanSettings(
      sources=tuple(_SOURCES.value),
      layers=_layers(_LAYERS.value),
      modules=None if _MODULES.value == ["none"] else tuple(_MODULES.value),
      noise_sigma=_SIGMA.value,
      weight_block_size=_BLOCK.value or None,
      kv_granularity=_KV_GRANULARITY.value or config.rollout.kv_granularity,
    )
    sensitivity.run_sensitivity(
      config,
      params_from=_PARAMS_FROM.value,
      num_prompts=_PROMPTS.value,
      target_kl=_TARGET.value,
      settings=settings,
      seq_len=_SEQ_LEN.value,
      json_path=json_path,
      png_path=png_path,
      log=lambda *a: print(*a, flush=True),
    )
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main, argv=cli_flags.resolve_config_arg(sys.argv), flags_parser=cli_flags.parse_flags)
