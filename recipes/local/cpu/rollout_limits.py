"""What vLLM's CPU backend (the local run's rollout) cannot serve, checked before Ray starts.

Each limit is one line naming it and the fix (the launcher exits 2 on it). The head sizes are
vLLM 0.29's CPU attention's (`CPUAttentionBackend.get_supported_head_sizes`; a test compares
them with the installed vLLM, which the launcher does not import).
"""

import json
from pathlib import Path

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_MOE_ALIGNMENT = 32  # CPUUnquantizedExperts: hidden divisible by it (expert slices it pads)


def problems(
    model_dir: Path, rollout_tp: int = 1, config: dict | None = None, tokens: int | None = None
) -> list[str]:
    """The CPU-backend limits this HF checkpoint (config.json + tokenizer) hits; `config` and
    `tokens` (the tokenizer's length) in memory stand in for files not written yet."""
    if config is None:
        config = json.loads((model_dir / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    found = []
    if head_dim not in CPU_HEAD_SIZES:
        sizes = ", ".join(map(str, CPU_HEAD_SIZES))
        found.append(
            f"{model_dir}: head_dim {head_dim} is not a head size vLLM's CPU attention "
            f"supports ({sizes}): give the model one of them"
        )
    if hidden % CPU_MOE_ALIGNMENT:
        found.append(
            f"{model_dir}: hidden_size {hidden} is not a multiple of {CPU_MOE_ALIGNMENT}, "
            "which vLLM's CPU MoE kernel needs: use a multiple of it"
        )
    kv_heads = config.get("num_key_value_heads") or heads
    if heads % rollout_tp or (kv_heads % rollout_tp and rollout_tp % kv_heads):
        found.append(
            f"{model_dir}: rollout TP {rollout_tp} does not divide its {heads} attention heads "
            f"or is no multiple or divisor of its {kv_heads} KV heads, as vLLM needs: set "
            "actor_rollout_ref.rollout.tensor_model_parallel_size to one that is"
        )
    tokens = _tokenizer_length(model_dir) if tokens is None else tokens
    if tokens < config["vocab_size"]:
        found.append(
            f"{model_dir}: the tokenizer has {tokens} tokens for vocab_size "
            f"{config['vocab_size']}; verl's vLLM rollout never samples ids past the "
            "tokenizer, so its log-probs would not be the actor's: add tokens up to the "
            "vocabulary size (as recipes/local/task/doubles.py's RESERVED)"
        )
    return found


def _tokenizer_length(model_dir: Path) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(model_dir))
