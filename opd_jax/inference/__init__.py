"""Generation: the rollout engine's weight transform T(θ) (`transform`), the jitted KV-cache
decode loop that returns the log-probs of the distribution it sampled from (`sampler`), and
teacher-forced logits of a rollout (`teacher_forcing`).

Layers and what each may import: docs/design.md.
"""
