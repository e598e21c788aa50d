"""Export the policy as an HF checkpoint (hub per-expert keys); check that transformers loads it."""

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from backend.distributed import ProcessGroups
from backend.forward import forward_logits
from converters.qwen3_moe import mcore_to_hf
from converters.sharding import gather_full
from recipes.local.rollout import full_vocab_logits


def export_hf(model, groups: ProcessGroups, spec, config_dir: Path, out: Path) -> Path | None:
    """Collective: gather the full weights; rank 0 writes safetensors + config.json to `out`."""
    from safetensors.torch import save_file

    hf = mcore_to_hf(gather_full(model, groups, spec), spec)  # hub layout: one key per expert
    if dist.get_rank(groups.world) != 0:
        return None
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in hf.items()},
        tmp / "model.safetensors",
        metadata={"format": "pt"},
    )
    shutil.copy(config_dir / "config.json", tmp / "config.json")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def check_export(
    model, groups: ProcessGroups, export_dir: Path | None, probe_BS: torch.Tensor
) -> float | None:
    """Collective: max |logits| difference between the mcore model and the reloaded export."""
    with torch.no_grad():
        logits_BSV = full_vocab_logits(forward_logits(model, probe_BS), groups)
    if dist.get_rank(groups.world) != 0:
        return None
    from transformers import Qwen3MoeForCausalLM

    reloaded = Qwen3MoeForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return (logits_BSV - reloaded(probe_BS).logits).abs().max().item()
