"""DAPO recipes (A2, H100) and the local CPU mode."""
