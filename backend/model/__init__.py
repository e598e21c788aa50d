"""The megatron-core model: built from an HF config through its family, attention and experts without TransformerEngine, heads, packing, recompute, routing replay."""
