"""Training: the losses (`losses`), the per-step mismatch metrics (`mismatch_metrics`), the
jitted train step (`train_step`), held-out evaluation (`evaluate`), the teacher bootstrap
and student warm start (`pretrain`), checks before weights load (`preflight`), a run's setup
(`setup`), the step-hook protocol (`hooks`), the loop (`trainer`), the export (`export`) and
the RL baseline (`rl`).

Layers and what each may import: docs/design.md.
"""
