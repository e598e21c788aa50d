"""Device support: cuda / npu / cpu, accelerator-only packages imported lazily, megatron-core release differences and its named shims."""
