"""Names shared by backend/, parallel/, recipes/ and scripts/ (no imports: any layer may use it)."""

# the accelerators by the name a person reads (plans, launcher summaries) and as a run-name tag
DEVICE_LABELS = {"npu": "Ascend A2", "cuda": "H100", "cpu": "CPU"}
DEVICE_TAGS = {"npu": "a2", "cuda": "h100", "cpu": "cpu"}

# the router aux loss's flat metrics (backend.aux_loss) and where the monitor picks them up
AUX_LOSS_PREFIX = "moe/aux_loss"

# the EP skew (busiest EP rank's tokens / the mean) a fresh run's memory plan assumes and the
# monitor's SkewGuard then holds the run to (parallel.skew says why 2)
DEFAULT_EP_SKEW = 2.0
