"""Lean vs full log-prob heads on one tiny model: shared by the world-1 and tp2 tests
(module level: spawn imports the rank function by name)."""

import torch

from tests.support.multiproc import loaded_model

BATCH, SEQ = 3, 12  # SEQ a multiple of tp (sequence parallel)
CHUNK_TOKENS = 7  # several chunks, one of them partial, over BATCH * SEQ = 36 tokens


def batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))


def temperatures(kind: str):
    return {"one": 1.0, "scalar": 0.7, "rows": torch.tensor([0.6, 1.0, 1.3])}[kind]


def compare_heads(model, vocab: int, temperature, entropy: bool) -> dict:
    """Outputs and grads (output weight, final norm, all params) of both heads, same loss."""
    import backend.model.lean_head as lean_head
    from recipes.dapo.engine.logprobs import head_outputs

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
    from backend.platform.device import prepare_device

    prepare_device("cpu")
    model, spec, _ = loaded_model(hf_dir, tp=tp, etp=tp)
    return compare_heads(model, spec.vocab_size, temperatures(temperature_kind), entropy)
