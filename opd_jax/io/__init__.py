"""Reading and writing: Hugging Face checkpoints (`hf`), orbax train checkpoints
(`checkpointing`), metrics (`metrics_writer`), building a run's models from its config
(`build`), a run directory as other commands read it (`run_history`), the XLA compilation
cache (`compile_cache`) and JSON result files (`json_file`).

Layers and what each may import: docs/design.md.
"""
