"""Megatron-core actor backend for Qwen3-MoE.

Import order matters: call `backend.platform.device.prepare_device(kind)` before anything
imports megatron, so the device's shims (CPU) or adaptors (NPU) are in place.
"""
