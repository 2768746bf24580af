"""The bottom layer: the rules a run config must satisfy (`check.validate`), checked before
anything loads. It imports no other layer.

Layers and what each may import: docs/design.md.
"""
