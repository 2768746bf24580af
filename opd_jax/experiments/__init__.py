"""Experiments built from training runs: a run recorded once (`runs`), the study that
calibrates the budget (`study`, `study_report`) and OPD against RL (`opd_vs_rl`).

Layers and what each may import: docs/design.md.
"""
