"""Small random Hugging Face checkpoints and JSONL files to try a distillation run on.

`write_toy_files(out)` (the command: `python -m opd_jax.toy_checkpoints --out=/tmp/mine`)
writes, with no download and no PyTorch:

    /tmp/mine/student/         a random Qwen3 decoder (2 layers, D=32) with its tokenizer
    /tmp/mine/teacher/         a wider random Qwen3 (2 layers, D=64), the same tokenizer,
                               and `--teacher-vocab-rows` embedding rows (default: the
                               student's, so that any version of the trainer accepts it)
    /tmp/mine/prompts.jsonl    training prompts: arithmetic problems as plain "prompt"
                               records with a reference "completion", and one in
                               `--chat-every` as a chat "messages" record
    /tmp/mine/eval.jsonl       held-out prompts with their "answer"

They are the README's "Distill your own checkpoints" walkthrough and its test: real HF
directories (`config.json`, `model.safetensors`, `generation_config.json`, tokenizer files
with a chat template) that `transformers` loads, at a size a laptop trains in seconds.
The weights are random, so the teacher solves nothing: a run on them shows the mechanics
(loading, the chat template, the eval file, the export), and the per-token KL falling, not
accuracy.

The tokenizer is character level over printable ASCII plus Qwen-style specials
(`<|endoftext|>` pad, `<|im_start|>`, `<|im_end|>` eos, no bos), 99 tokens, in
`tokenizer.json` with a ChatML template; the models have `vocab_rows` ≥ 99 embedding rows,
as real checkpoints pad their tables beyond the tokenizer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from opd_jax.data import task
from opd_jax.io import hf, hf_export
from opd_jax.model import tokenizer as tokenizer_lib
from opd_jax.model import transformer as model
from opd_jax.model.config import ModelConfig

CHARS = [chr(c) for c in range(32, 127)] + ["\n"]  # 96 printable characters, ids 0..95
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # pad, turn start, eos
CHAT_TEMPLATE = (
  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SYSTEM = "Add the numbers step by step."


def save_chat_tokenizer(
  directory: str | os.PathLike, bos: bool = False, template: str | None = CHAT_TEMPLATE
) -> object:
  """Writes the character-level chat tokenizer (module docstring) into `directory` and
  returns it loaded as the trainer loads it (`tokenizer.load_tokenizer`).

  Qwen-like by default: 99 tokens, eos and pad, no bos. `bos=True` adds a `<s>` bos (100
  tokens, Llama-like); `template` is the chat template (None: none, so `messages` records
  cannot be rendered)."""
  import tokenizers
  import transformers
  from tokenizers import decoders, models, pre_tokenizers

  specials = SPECIALS + (["<s>"] if bos else [])
  vocab = {c: i for i, c in enumerate(CHARS)} | {s: len(CHARS) + i for i, s in enumerate(specials)}
  backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=None))
  backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
  backend.decoder = decoders.Fuse()
  fast = transformers.PreTrainedTokenizerFast(
    tokenizer_object=backend,
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    bos_token="<s>" if bos else None,
    additional_special_tokens=["<|im_start|>"],
  )
  if template is not None:
    fast.chat_template = template
  fast.save_pretrained(str(directory))
  return tokenizer_lib.load_tokenizer(str(directory))


def toy_config(hidden_size: int, vocab_rows: int) -> ModelConfig:
  """A 2-layer Qwen3 decoder of width `hidden_size` (4 heads of D/4, 2 KV heads, F = 2D)."""
  return ModelConfig(
    model_type="qwen3",
    vocab_size=vocab_rows,
    hidden_size=hidden_size,
    intermediate_size=2 * hidden_size,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=hidden_size // 4,
    qk_norm=True,
    tie_word_embeddings=False,
  )


def save_random_model(directory: str, cfg: ModelConfig, tok, seed: int) -> None:
  """Random f32 params of `cfg` (`model.init_params`) saved as an HF checkpoint with the
  tokenizer's generation ids and files."""
  params = model.init_params(jax.random.key(seed), cfg, jnp.float32)
  hf.save_checkpoint(
    directory, cfg, jax.device_get(params), generation_config=hf_export.generation_config(tok)
  )


def chat_record(example: dict) -> dict:
  """A task example as a chat record: a system turn, the problem as the user turn."""
  messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": example["prompt"]}]
  return {"messages": messages, "completion": example["completion"]}


def _write_jsonl(path: str, records: Sequence[dict]) -> None:
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)


def write_toy_files(
  out: str,
  *,
  num_prompts: int = 512,
  num_eval: int = 64,
  chat_every: int = 4,
  student_vocab_rows: int = 128,
  teacher_vocab_rows: int = 0,
  seed: int = 0,
) -> dict[str, str]:
  """Writes the student, teacher, prompt and eval files (module docstring) under `out`.

  Args:
    out: output directory (created; earlier files of the same names are replaced).
    num_prompts: training records; every `chat_every`-th one (0: none) is a chat record.
    num_eval: held-out records, each with its "answer".
    student_vocab_rows: the student's embedding rows (≥ the tokenizer's 99 tokens).
    teacher_vocab_rows: the teacher's; 0 = the student's.
    seed: seeds the weights (student `seed`, teacher `seed + 1`) and the problems.

  Returns:
    {"student": dir, "teacher": dir, "prompts": file, "eval": file}.
  """
  teacher_vocab_rows = teacher_vocab_rows or student_vocab_rows
  tokens = len(CHARS) + len(SPECIALS)
  for name, rows in (("student", student_vocab_rows), ("teacher", teacher_vocab_rows)):
    if rows < tokens:
      raise ValueError(f"{name}_vocab_rows={rows} is below the tokenizer's {tokens} tokens")
  if num_prompts < 1 or num_eval < 1 or chat_every < 0:
    raise ValueError(
      f"need num_prompts >= 1, num_eval >= 1 and chat_every >= 0; got {num_prompts}, "
      f"{num_eval}, {chat_every}"
    )
  paths = {
    "student": os.path.join(out, "student"),
    "teacher": os.path.join(out, "teacher"),
    "prompts": os.path.join(out, "prompts.jsonl"),
    "eval": os.path.join(out, "eval.jsonl"),
  }
  os.makedirs(out, exist_ok=True)
  for who, width, rows, s in (
    ("student", 32, student_vocab_rows, seed),
    ("teacher", 64, teacher_vocab_rows, seed + 1),
  ):
    tok = save_chat_tokenizer(paths[who])
    save_random_model(paths[who], toy_config(width, rows), tok, s)

  train = task.TaskSource("train", num_prompts, seed)
  records = []
  for i in range(num_prompts):
    example = train[i]
    if chat_every and i % chat_every == chat_every - 1:
      records.append(chat_record(example))
    else:
      records.append({"prompt": example["prompt"], "completion": example["completion"]})
  _write_jsonl(paths["prompts"], records)
  heldout = task.TaskSource("heldout", num_eval, seed + 1)
  _write_jsonl(
    paths["eval"],
    [{"prompt": heldout[i]["prompt"], "answer": heldout[i]["answer"]} for i in range(num_eval)],
  )
  return paths
