"""Lean vs full log-prob heads on one tiny model: shared by the world-1 and tp2 tests
(module level: spawn imports the rank function by name)."""

import torch

from tests.multiproc import job_plan

BATCH, SEQ = 3, 12  # SEQ a multiple of tp (sequence parallel)
CHUNK_TOKENS = 7  # several chunks, one of them partial, over BATCH * SEQ = 36 tokens


def batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))


def temperatures(kind: str):
    return {"one": 1.0, "scalar": 0.7, "rows": torch.tensor([0.6, 1.0, 1.3])}[kind]


def compare_heads(model, vocab: int, temperature, entropy: bool) -> dict:
    """Outputs and grads (output weight, final norm, all params) of both heads, same loss."""
    import backend.lean_head as lean_head
    from recipes.dapo.heads import head_outputs

    lean_head.CHUNK_BYTES = (
        4 * CHUNK_TOKENS * lean_head.output_weight_VH(lean_head.gpt_of(model)).shape[0]
    )
    ids = batch(vocab)
    coef = torch.randn(2, BATCH, SEQ, generator=torch.Generator().manual_seed(6))
    result = {}
    for lean in (False, True):
        model.zero_grad(set_to_none=True)
        out = head_outputs(model, ids, temperature, entropy, lean=lean)
        loss = (out["log_probs"] * coef[0]).sum()
        if entropy:
            loss = loss + (out["entropy"] * coef[1]).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        result["lean" if lean else "full"] = {
            "out": {k: v.detach() for k, v in out.items()},
            "grads": grads,
        }
    return result


def run_tp(rank: int, hf_dir: str, tp: int, temperature_kind: str, entropy: bool) -> dict:
    from backend.device import prepare_device

    device = prepare_device("cpu")
    from backend.distributed import init_parallel
    from backend.model import build_model
    from backend.qwen3_moe import load_qwen3_moe_spec
    from converters.hf_io import read_state_dict
    from converters.sharding import load_hf_sharded

    groups = init_parallel(device, job_plan(tp=tp, etp=tp))
    spec = load_qwen3_moe_spec(hf_dir)
    model = build_model(spec, groups)
    load_hf_sharded(model, read_state_dict(hf_dir), spec, groups)
    return compare_heads(model, spec.vocab_size, temperatures(temperature_kind), entropy)
