"""Benches that launch the whole main job (scripts/train_mcore.sh) and read its metrics: the
engines side by side, the trainer modes, routing replay's modes, the mission's plan."""
