"""The run's last checkpoint as an HF model, and a check that transformers reloads it exactly.

Ours (mcore_ep): converters' mcore-to-hf of the torch_dist checkpoint, checked against that
checkpoint in megatron-core. verl's FSDP engine (`--engine fsdp`): the HF model verl saved with
the checkpoint (`<actor>/huggingface/`, recipes.dapo.job.actors.SAVE_WITH_HF), copied whole,
checked in both stacks: transformers and megatron-core (our engine's loader) read it to the
same logits, so either actor trains on from it.
"""

from pathlib import Path

import torch


def export_hf(actor: Path, template: Path, out: Path) -> Path:
    """converters' mcore-to-hf of `actor` into `out` (replaced; written whole or not at all),
    config and tokenizer from `template`."""
    from converters.cli import main as converters_main

    args = ["mcore-to-hf", str(actor), str(out), "--template", str(template), "--force",
            "--no-progress"]  # fmt: skip
    code = converters_main(args)
    if code != 0:
        raise RuntimeError(f"export of {actor} failed (converters exit {code})")
    return out


def check_export(actor: Path, template: Path, out: Path) -> tuple[Path, float]:
    """export_hf of `actor` into `out`; max |logits| between the checkpoint in megatron-core
    (world size 1) and the export in transformers, on task-like sequences."""
    return export_hf(actor, template, out), _logits_diff(actor, out)


def check_fsdp_export(actor: Path, out: Path) -> tuple[Path, float]:
    """<actor>/huggingface (verl's FSDP checkpoint's HF model) copied into `out` (replaced,
    whole or not at all); max |logits| between megatron-core and transformers on it."""
    import shutil

    from converters.atomic import atomic_dir
    from recipes.dapo.job.actors import HF_DIR

    source = actor / HF_DIR
    if not any(source.glob("*.safetensors")):
        raise RuntimeError(f"{actor} has no HF model in {HF_DIR}/: verl saved it without hf_model")
    with atomic_dir(out, force=True) as tmp:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
    return out, _logits_diff(None, out)


def _probe_BS(tokenizer) -> torch.Tensor:
    texts = ["3+4=7", "9-5=4", "0+0=0"]
    rows = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t[:-1]}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        + tokenizer.encode(t[-1], add_special_tokens=False)
        for t in texts
    ]
    width = max(map(len, rows))
    return torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])


@torch.no_grad()
def _logits_diff(actor: Path | None, export: Path) -> float:
    """megatron-core on `actor` (our checkpoint; None: on the export itself, through the
    engine's HF loader) against transformers on the export."""
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    from backend.model.build import build_model
    from backend.model.forward import forward_logits
    from backend.platform.device import prepare_device
    from backend.qwen3_moe import load_qwen3_moe_spec
    from backend.training.distributed import destroy_parallel, init_parallel
    from recipes.dapo.checkpoints.files import MODEL_DIR
    from recipes.dapo.engine import weights

    probe_BS = _probe_BS(AutoTokenizer.from_pretrained(export))
    groups = init_parallel(prepare_device("cpu"))
    try:
        spec = load_qwen3_moe_spec(export)
        model = build_model(spec, groups).eval()
        if actor is None:
            weights.load_hf(model, export, spec, groups)
        else:
            weights.load_model(model, actor / MODEL_DIR)
        mcore_BSV = forward_logits(model, probe_BS)
    finally:
        destroy_parallel()
    reloaded = Qwen3MoeForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    return (mcore_BSV - reloaded(probe_BS).logits).abs().max().item()


def preload() -> None:
    """What check_export imports (~5 s of a core), ahead of it (recipes.local.export_ahead)."""
    from transformers import Qwen3MoeForCausalLM  # noqa: F401
    from transformers.utils.logging import disable_progress_bar

    import backend.model.build  # noqa: F401
    import backend.training.distributed  # noqa: F401
    import converters.cli  # noqa: F401
    import recipes.dapo.engine.weights  # noqa: F401

    disable_progress_bar()  # the export's output goes to the run's log
