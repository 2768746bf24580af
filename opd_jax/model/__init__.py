"""The model layer: the decoder as a pure function over a params pytree (`transformer`), its
shape (`config.ModelConfig`), FP8 quantization (`quant`), the KV cache (`kvcache`), the
named-mesh sharding rules (`sharding`), tokenizers and the sparse top-k view of a
distribution (`teacher_topk`).

Layers and what each may import: docs/design.md.
"""
