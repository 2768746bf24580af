"""Fail fast: everything a run can check without weights, checked before any weights load.

`check(config, workdir)` runs, in order (each step raises ValueError or FileNotFoundError
naming the setting, file or record at fault):

1. the workdir (and a custom `export.dir` and the teacher cache when one is written): created
   if needed and writable, tested by writing and removing a probe file through `etils.epath`
   (so a gs:// workdir is checked on its store, never created as a local `gs:` folder); on a
   local disk the probe is 64 KiB, so a full disk fails here (ENOSPC) and not at the first
   checkpoint;
2. the schema of the prompt file, and of the eval file when the config names one
   (`data.eval_file`): every line a JSON object with a "prompt" or "messages"
   (`data.JsonlSource`);
3. the mesh, both models' config.json files and the vocabularies (`build.plan_models`: the
   mesh fits the devices, supported architectures, weight files present, the tokenizer loads,
   a teacher tokenizer identical to the run's, the tokenizer's ids fit both embedding tables,
   which may differ in size: padded rows are left out of the logits; what was compared is
   logged), and a `train.teacher_top_k` that fits the teacher's vocabulary;
4. the prompts with that tokenizer: chat rendering, tokenizability, answers that are strings or
   numbers, and lengths under `data.max_prompt_tokens` / `data.overlong` (`prompts.prepare`);
   the longest prompt plus `rollout.max_new_tokens` within both models' context
   (`check_context`);
5. with `train.on_policy_fraction` < 1, every training record's reference completion: present
   and tokenizable (`off_policy.check_references`, naming the first record without one).
6. evaluation (`evaluate.plan`): the scorer `data.eval_metric` names imports (checked after
   step 2, `scoring.resolve`); without a `data.eval_file`, the held-out slice of the prompt file
   is at most half of it (a training set smaller than a batch is drawn with repeats).

Cheapest first: the first two need neither JAX's devices nor transformers (whose import
alone takes seconds). Loading even a small checkpoint takes seconds and a large one
minutes; these checks read only JSON and tokenizer files, so a typo is reported before any
of that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket

from etils import epath

from opd_jax.config.spec import RunSpec
from opd_jax.data import pipeline as data
from opd_jax.data import prompts, scoring
from opd_jax.io import build
from opd_jax.model import teacher_topk
from opd_jax.rollout import off_policy
from opd_jax.train import evaluate


@dataclasses.dataclass
class Checked:
  """What the checks built on the way, for the run to reuse."""

  plan: build.Plan
  train_prompts: prompts.PromptSet | None  # None: the built-in task's prompts
  # What evaluation uses (`evaluate.plan`): data.eval_file's prompts, or the held-out slice of
  # the prompt file (then left out of train_prompts); None: the built-in task, or no evaluation.
  eval_prompts: prompts.PromptSet | None
  scorer: scoring.Scorer | None = None  # data.eval_metric's function; None = "none"


# A local probe's size: a full disk refuses a write this large (ENOSPC) but still creates an
# empty file, so an empty probe would pass. Object stores have no disk to fill.
PROBE_BYTES = 64 * 1024


def probe_path(directory: str | os.PathLike) -> epath.Path:
  """The probe file `check_writable` writes and removes in `directory`: named by host and
  process, so the processes of one run sharing a workdir never remove each other's probe."""
  return epath.Path(directory) / f".write_probe_{socket.gethostname()}_{os.getpid()}"


def check_writable(directory: str | os.PathLike, what: str) -> None:
  """Creates `directory` if needed (local or a URI such as gs://bucket/run, through
  `etils.epath`) and writes and removes `probe_path(directory)` in it: `PROBE_BYTES` zero
  bytes on a local disk, an empty object on an object store.

  Raises:
    ValueError: naming `what`, the directory and the OS error (e.g. "[Errno 28] No space
      left on device") when creating it or writing the probe fails.
  """
  directory = os.fspath(directory)
  probe = probe_path(directory)
  size = 0 if "://" in directory else PROBE_BYTES
  try:
    epath.Path(directory).mkdir(parents=True, exist_ok=True)
    try:
      probe.write_bytes(bytes(size))
    except OSError:
      with contextlib.suppress(OSError):  # a full disk may leave an empty probe behind
        probe.unlink(missing_ok=True)
      raise
    probe.unlink()
  except OSError as e:
    raise ValueError(f"{what} {directory!r} is not writable: {e}") from e


def check_context(prepared: prompts.PromptSet, max_new_tokens: int, plan, what: str) -> None:
  """Refuses prompts that, with `rollout.max_new_tokens` generated after them, run past the
  context either model was built for (`max_position_embeddings`, the smaller of the two).

  Raises:
    ValueError: naming the longest prompt, the context and the keys that bound it.
  """
  context = min(plan.student_cfg.max_position_embeddings, plan.teacher_cfg.max_position_embeddings)
  longest = int(prepared.lengths.max())
  if longest + max_new_tokens > context:
    raise ValueError(
      f"{what} prompts of {prepared.name} reach {longest} tokens, and with "
      f"rollout.max_new_tokens={max_new_tokens} after them a sequence would be "
      f"{longest + max_new_tokens} positions, past the models' context of {context} "
      "(max_position_embeddings); set data.max_prompt_tokens (at most "
      f"{max(context - max_new_tokens, 0)}) with data.overlong=truncate_left or drop, or "
      "lower rollout.max_new_tokens"
    )


def check(spec: RunSpec, workdir: str, log=print) -> Checked:
  """Runs every check that needs no weights (module docstring) and logs the prompts' summary.

  Args:
    spec: the run's spec (`setup.run_spec` of a config that `config_check.validate` accepted).
    workdir: the run's --workdir.
    log: where the prompt summary lines go.

  Returns:
    The `Checked` plan and prompt sets, which the run reuses instead of building them again.
  """
  check_writable(workdir, "the workdir")
  if spec.export.dir not in ("", "none"):
    check_writable(spec.export.dir, "export.dir")
  if not spec.teacher.checkpoint and spec.teacher.cache_dir:
    check_writable(spec.teacher.cache_dir, "teacher.cache_dir")
  files = {"training": spec.data.prompt_file, "eval": spec.data.eval_file}
  sources = {what: data.JsonlSource(path) for what, path in files.items() if path}
  scorer = scoring.resolve(spec.data.eval_metric)  # a bad import path, before any weights
  plan = build.plan_models(spec)
  if plan.vocab_note:
    log(plan.vocab_note)
  teacher_topk.check_top_k(spec.train.teacher_top_k, plan.teacher_cfg.real_vocab_size)
  d, prepared = spec.data, {}
  for what, source in sources.items():
    prepared[what] = prompts.prepare(source, plan.tokenizer, d.max_prompt_tokens, d.overlong)
    log(f"{what} prompts {prepared[what].describe()}")
    check_context(prepared[what], spec.rollout.max_new_tokens, plan, what)
  if spec.train.on_policy_fraction < 1 and "training" in sources:
    width = spec.rollout.max_new_tokens  # every record needs a reference (off_policy)
    log(off_policy.check_references(sources["training"], plan.tokenizer, width))
  train, held = evaluate.plan(spec, prepared.get("training"), prepared.get("eval"), log)
  return Checked(plan, train, held, scorer)
