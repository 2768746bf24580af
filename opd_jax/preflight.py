"""Fail fast: everything a run can check without weights, checked before any weights load.

`check(config, workdir)` runs, in order (each step raises ValueError or FileNotFoundError
naming the setting, file or record at fault):

1. the workdir (and a custom `export.dir` and the teacher cache when one is written): created
   if needed and writable, tested by writing and removing a probe file;
2. the schema of the prompt file, and of the eval file when the config names one
   (`data.eval_file`): every line a JSON object with a "prompt" or "messages"
   (`data.JsonlSource`);
3. the mesh, both models' config.json files and the vocabularies (`build.plan_models`: the
   mesh fits the devices, supported architectures, weight files present, student and teacher
   vocabularies equal, the tokenizer loads and fits them);
4. the prompts with that tokenizer: chat rendering, tokenizability and lengths under
   `data.max_prompt_tokens` / `data.overlong` (`prompts.prepare`).

Cheapest first: the first two need neither JAX's devices nor transformers (whose import
alone takes seconds). Loading even a small checkpoint takes seconds and a large one
minutes; these checks read only JSON and tokenizer files, so a typo is reported before any
of that.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import ml_collections

from opd_jax import build, data, prompts


@dataclasses.dataclass
class Checked:
  """What the checks built on the way, for the run to reuse."""

  plan: build.Plan
  train_prompts: prompts.PromptSet | None  # None: the built-in task's prompts
  eval_prompts: prompts.PromptSet | None  # None: no data.eval_file


def check_writable(directory: str, what: str) -> None:
  """Creates `directory` if needed and writes and removes a probe file in it.

  Raises:
    ValueError: naming `what` and the directory when either fails.
  """
  try:
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".write_probe_"):
      pass
  except OSError as e:
    raise ValueError(f"{what} {directory!r} is not writable: {e}") from e


def prompt_set(path: str, tokenizer, config: ml_collections.ConfigDict) -> prompts.PromptSet:
  """The prepared prompts of a JSONL file under the config's length policy."""
  d = config.data
  return prompts.prepare(data.JsonlSource(path), tokenizer, d.max_prompt_tokens, d.overlong)


def check(config: ml_collections.ConfigDict, workdir: str, log=print) -> Checked:
  """Runs every check that needs no weights (module docstring) and logs the prompts' summary.

  Args:
    config: a config that `config_check.validate` accepted.
    workdir: the run's --workdir.
    log: where the prompt summary lines go.

  Returns:
    The `Checked` plan and prompt sets, which the run reuses instead of building them again.
  """
  check_writable(workdir, "the workdir")
  if config.export.dir not in ("", "none"):
    check_writable(config.export.dir, "export.dir")
  if not config.teacher.checkpoint and config.teacher.cache_dir:
    check_writable(config.teacher.cache_dir, "teacher.cache_dir")
  files = {"training": config.data.prompt_file, "eval": config.data.get("eval_file", "")}
  sources = {what: data.JsonlSource(path) for what, path in files.items() if path}
  plan = build.plan_models(config)
  d, prepared = config.data, {}
  for what, source in sources.items():
    prepared[what] = prompts.prepare(source, plan.tokenizer, d.max_prompt_tokens, d.overlong)
    log(f"{what} prompts {prepared[what].describe()}")
  return Checked(plan, prepared.get("training"), prepared.get("eval"))
