# Re-export for recipes/dapo/engine.py and weights.py (edited elsewhere); new code imports
# backend.qwen3_moe (model-specific) or backend.families (generic).
from backend.qwen3_moe import ConfigError, Qwen3MoeSpec, load_qwen3_moe_spec  # noqa: F401
