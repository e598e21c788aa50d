"""HF <-> megatron-core weight conversion, for every model family (backend.model.families)."""
