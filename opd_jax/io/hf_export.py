"""Export: a student as a directory that `transformers` loads as it loads a published model.

`export_student` writes the weights and config.json (with the bos/eos/pad ids) through
`hf.save_checkpoint`, generation_config.json (`generation_config`), and the tokenizer: the
Hugging Face tokenizer's files copied as they are, or for the built-in character tokenizer a
`tokenizer.json` built from its vocabulary (`save_char_tokenizer`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from opd_jax.io import hf, staged_dir
from opd_jax.model import tokenizer as tokenizer_lib
from opd_jax.model.config import ModelConfig

# The files of a Hugging Face tokenizer directory; an export copies those present.
TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "added_tokens.json",
  "vocab.json",
  "merges.txt",
  "tokenizer.model",
  "chat_template.jinja",
  "chat_template.json",
)


def token_ids(tokenizer) -> dict[str, int | None]:
  """{bos,eos,pad}_token_id of an `opd_jax.model.tokenizer` tokenizer (bos may be None)."""
  return {
    "bos_token_id": tokenizer.bos_id,
    "eos_token_id": tokenizer.eos_id,
    "pad_token_id": tokenizer.pad_id,
  }


def generation_config(tokenizer, source_dir=None) -> dict[str, Any]:
  """The generation_config.json of an export: the tokenizer's bos/eos/pad ids.

  With `source_dir` (the HF checkpoint the student started from) its own
  generation_config.json is the base, so its sampling defaults survive; the
  tokenizer's ids replace its ids, except that a source eos list holding the
  tokenizer's eos is kept (chat models stop at several tokens), and a source bos
  stays where the tokenizer has none. Ids that are None are left out.

  Args:
    tokenizer: the run's tokenizer (`eos_id`, `bos_id`, `pad_id`).
    source_dir: a Hugging Face checkpoint directory, or None.

  Returns:
    the JSON dict.
  """
  base: dict[str, Any] = {}
  if source_dir:
    file = os.path.join(os.fspath(source_dir), hf.GENERATION_CONFIG_FILE)
    if os.path.isfile(file):
      base = hf.read_json(file)
  ids = {k: v for k, v in token_ids(tokenizer).items() if v is not None}
  source_eos = base.get("eos_token_id")
  if isinstance(source_eos, list) and ids["eos_token_id"] in source_eos:
    ids["eos_token_id"] = source_eos
  return base | ids


def tokenizer_file_names(source_dir) -> list[str]:
  """The `TOKENIZER_FILES` present in `source_dir`, sorted.

  Raises:
    FileNotFoundError: `source_dir` is not a directory.
    ValueError: it holds none of `TOKENIZER_FILES`.
  """
  source = os.fspath(source_dir)
  if not os.path.isdir(source):
    raise FileNotFoundError(f"tokenizer directory {source!r} does not exist")
  names = sorted(n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(source, n)))
  if not names:
    raise ValueError(
      f"tokenizer directory {source!r} holds none of the tokenizer files "
      f"({', '.join(TOKENIZER_FILES)})"
    )
  return names


def copy_tokenizer_files(source_dir, path) -> list[str]:
  """Copies the `TOKENIZER_FILES` present in `source_dir` into `path`, byte for byte.

  Returns:
    the names copied, sorted.

  Raises:
    FileNotFoundError: `source_dir` is not a directory.
    ValueError: it holds none of `TOKENIZER_FILES`.
  """
  source = os.fspath(source_dir)
  names = tokenizer_file_names(source)
  os.makedirs(os.fspath(path), exist_ok=True)
  for name in names:
    shutil.copyfile(os.path.join(source, name), os.path.join(os.fspath(path), name))
  return names


def save_char_tokenizer(tokenizer, path, max_length: int = 4096) -> list[str]:
  """Writes the built-in character tokenizer as a `transformers` fast tokenizer.

  One id per character (a `tokenizers` WordLevel model over the tokenizer's
  vocabulary, the text split into single characters, decoded by joining them),
  with its pad/bos/eos tokens, and bos prepended when special tokens are added
  (`[bos] prompt`, as the task encodes prompts). `AutoTokenizer` then encodes
  text to the ids `tokenizer.encode` gives; a character outside the alphabet is
  an error, as it is in `CharTokenizer`.

  Args:
    tokenizer: a `CharTokenizer` (`get_vocab`, `pad_id`, `bos_id`, `eos_id`).
    path: output directory (created if needed).
    max_length: `model_max_length` of tokenizer_config.json (the model's context).

  Returns:
    the names written, sorted.
  """
  import tokenizers  # the Rust tokenizers library alone: no transformers import in a run
  from tokenizers import decoders, models, pre_tokenizers, processors

  vocab = tokenizer.get_vocab()
  by_id = {i: t for t, i in vocab.items()}
  bos, eos, pad = (by_id[i] for i in (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id))
  backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=None))
  backend.add_special_tokens([pad, bos, eos])  # ids from `vocab`; skipped when decoding
  backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
  backend.decoder = decoders.Fuse()
  backend.post_processor = processors.TemplateProcessing(
    single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.bos_id)]
  )
  directory = os.fspath(path)
  os.makedirs(directory, exist_ok=True)
  backend.save(os.path.join(directory, "tokenizer.json"))
  # PreTrainedTokenizerFast: the class name transformers 4 and 5 both load (5 aliases it).
  config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": bos,
    "eos_token": eos,
    "pad_token": pad,
    "model_max_length": max_length,
  }
  hf.write_json(os.path.join(directory, "tokenizer_config.json"), config)
  return sorted(n for n in os.listdir(path) if n in TOKENIZER_FILES)


def export_student(
  path,
  cfg: ModelConfig,
  params,
  tokenizer,
  tokenizer_dir=None,
  source_dir=None,
  finish: Callable[[str], None] | None = None,
) -> list[str]:
  """Writes a student as a directory that `transformers` loads, tokenizer included.

  `save_checkpoint` with `generation_config(tokenizer, source_dir)` (so config.json
  and generation_config.json carry the bos/eos/pad ids), then the tokenizer:
  the files of `tokenizer_dir` copied as they are, or, without one, the built-in
  character tokenizer as a fast tokenizer (`save_char_tokenizer`). The export is
  written beside `path` and then takes its place (`staged_dir.replaced_directory`):
  a failure part way leaves the old directory whole; no weight, config or tokenizer
  file of an earlier export survives; other files in `path` are kept. `path` may be
  the directory the tokenizer comes from. A `gs://` path is written to a local
  directory first and then uploaded (`staged_dir.upload`, config.json last).

  Args:
    path: output directory (created if needed).
    cfg: the student's model config.
    params: its unquantized params (fully addressable from this process).
    tokenizer: the run's `opd_jax.model.tokenizer` tokenizer.
    tokenizer_dir: the Hugging Face tokenizer directory to copy; None takes the directory an
      `HFTokenizer` was loaded from (`load_tokenizer`); a `CharTokenizer` needs none.
    source_dir: the HF checkpoint the student started from (`config.student.
      checkpoint`), whose generation_config.json sampling defaults are kept; or None.
    finish: called with the staging directory after the rest is written, to add files
      (a record) that must land with the export or not at all; or None.

  Returns:
    the names of the files in `path`, sorted.

  Raises:
    ValueError / FileNotFoundError: as `save_checkpoint`; a `tokenizer_dir` without tokenizer
      files; no `tokenizer_dir` for a tokenizer that is not a `CharTokenizer`. The tokenizer
      is checked before anything is written, the config (`hf.hf_expressible`) before
      anything is written to `path`, and nothing in `path` changes unless the whole export
      succeeds.
  """
  if not tokenizer_dir and isinstance(tokenizer, tokenizer_lib.HFTokenizer):
    tokenizer_dir = tokenizer.hf.name_or_path  # the local directory it was loaded from
  if tokenizer_dir:
    tokenizer_file_names(tokenizer_dir)
  elif not isinstance(tokenizer, tokenizer_lib.CharTokenizer):
    raise ValueError(
      f"a {type(tokenizer).__name__} needs its tokenizer directory (tokenizer_dir) to be "
      "exported; only the built-in CharTokenizer is written without one"
    )
  generation = generation_config(tokenizer, source_dir)

  def owned(name: str) -> bool:
    return hf.owned_by_checkpoint(name) or name in TOKENIZER_FILES

  if "://" in os.fspath(path):  # an object store: written here, then uploaded
    with tempfile.TemporaryDirectory(prefix="opd_export_") as local:
      export_student(local, cfg, params, tokenizer, tokenizer_dir, source_dir, finish)
      return staged_dir.upload(local, os.fspath(path), owned, last=hf.CONFIG_FILE)

  with staged_dir.replaced_directory(path, owned) as stage:
    hf.save_checkpoint(stage, cfg, params, generation_config=generation)
    if tokenizer_dir:  # read from where it is, which may be `path` itself, still whole
      copy_tokenizer_files(tokenizer_dir, stage)
    else:
      save_char_tokenizer(tokenizer, stage, cfg.max_position_embeddings)
    if finish is not None:
      finish(stage)
  return sorted(os.listdir(path))
