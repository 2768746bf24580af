"""Prompts and what is scored on them: the built-in task (`task`), prompt files (`prompts`),
the grain pipeline (`pipeline`), held-out scorers (`scoring`), RL rewards (`rewards`), the
`Rollout` batch type every layer above shares (`rollout_types`), and toy checkpoints to try
the HF path with (`toy_checkpoints`).

Layers and what each may import: docs/design.md.
"""
