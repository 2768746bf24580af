"""Entry point: tiny random Qwen3-shaped student and teacher checkpoints, with prompt and eval
files, for trying the "Distill your own checkpoints" path without a download.

    python -m opd_jax.toy_checkpoints --out=DIR [--num-prompts=N] [--num-eval=N]
        [--chat-every=N] [--student-vocab-rows=N] [--teacher-vocab-rows=N] [--seed=N]

Writes DIR/student/, DIR/teacher/, DIR/prompts.jsonl and DIR/eval.jsonl and prints their paths.
The logic is `opd_jax.data.toy_checkpoints.write_toy_files`, whose defaults the flags keep.
"""

from __future__ import annotations

from absl import flags

from opd_jax.cli import runner

_OUT = flags.DEFINE_string("out", None, "Output directory.")
# Each flag -> write_toy_files's keyword; None (not given) keeps the function's default.
_SIZES = {
  "num_prompts": flags.DEFINE_integer("num-prompts", None, "Training prompts (default 512)."),
  "num_eval": flags.DEFINE_integer("num-eval", None, "Held-out eval prompts (default 64)."),
  "chat_every": flags.DEFINE_integer(
    "chat-every", None, "Every n-th training prompt as a chat record; 0 = none (default 4)."
  ),
  "student_vocab_rows": flags.DEFINE_integer(
    "student-vocab-rows", None, "The student's embedding rows, >= the 99 tokens (default 128)."
  ),
  "teacher_vocab_rows": flags.DEFINE_integer(
    "teacher-vocab-rows", None, "The teacher's embedding rows; 0 = the student's (default 0)."
  ),
  "seed": flags.DEFINE_integer("seed", None, "PRNG seed of the weights and prompts (default 0)."),
}


def main() -> None:
  from opd_jax.data import toy_checkpoints

  sizes = {name: flag.value for name, flag in _SIZES.items() if flag.value is not None}
  paths = toy_checkpoints.write_toy_files(_OUT.value, **sizes)
  for name, path in paths.items():
    print(f"{name:8s} {path}")


if __name__ == "__main__":
  runner.run_command(main, required=("out",), shared=())
