"""Entry point: tiny random Qwen3-shaped student and teacher checkpoints, with prompt and eval
files, for trying the "Distill your own checkpoints" path without a download.

    python -m opd_jax.toy_checkpoints --out=DIR [--num-prompts=N]

The logic is `opd_jax.data.toy_checkpoints`.
"""

from opd_jax.data.toy_checkpoints import main

if __name__ == "__main__":
  main()
