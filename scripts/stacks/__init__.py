"""Package sets per target: their pins and locks, resolve.py (resolution, CI check), metadata_wheel.py."""
