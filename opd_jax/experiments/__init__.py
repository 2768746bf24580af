"""Experiments built from training runs: a run recorded once (`runs`), the study that
calibrates the budget (`study`, its rules `study_rules`, its report `study_report`, its cost
plan `study_plan`, its ladders under each label `ladders`) and OPD
against RL (`opd_vs_rl`, `opd_vs_rl_report`); their statistics are `stats` and their plots
`plots`.

Layers and what each may import: docs/design.md.
"""
