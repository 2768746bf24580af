"""Training: the losses (`losses`), the per-step mismatch metrics (`mismatch_metrics`), the train
state and optimizer (`state`), π_θ under the rollout's sampling transform (`policy`),
micro-batching (`microbatch`), the OPD step (`train_step`), the RL baselines and GRPO's updates
(`rl`), held-out evaluation (`evaluate`), the supervised step, teacher bootstrap and student warm
start (`pretrain`), checks before weights load (`preflight`), a run's setup (`setup`), the
step-hook protocol (`hooks`), the loop (`trainer`) and the export (`export`).

Layers and what each may import: docs/design.md.
"""
