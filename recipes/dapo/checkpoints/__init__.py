"""Checkpoints on disk: where their files lie, background saves and their sealing, save strategies, resume as data."""
