"""Checkpoint pickles are data, never code: exact allow-lists before anything unpickles them (megatron-core metadata, verl's TransferQueue and FSDP state)."""
