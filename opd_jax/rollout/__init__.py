"""Where the trainer's rollouts come from: the rollout worker that turns published weights
and prompts into a scored batch (`worker`), the `RolloutSource` protocol with its sync and
double-buffered async sources (`sources`), and the off-policy mix (`off_policy`).

Layers and what each may import: docs/design.md.
"""
