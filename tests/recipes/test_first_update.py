"""The main job's first update, replayed: verl's step-1 batch as the engine received it
(tests/data/first_update_batch.json, recorded from `bash scripts/train_mcore.sh --steps 2`)
through our engine and through transformers' Qwen3MoeForCausalLM, both driven by verl's own
ppo_loss in fp32, compared per parameter group.

What made step 1's grad_norm an outlier (#43): the tiny model's embedding row of the pad
token (`<|endoftext|>`, id 0) was all zeros, as transformers' init leaves the row of
`pad_token_id`. The random policy emits that token; where it is an input, the first RMSNorm
sees x = 0 and its backward scales by 1 / sqrt(eps) = 1000 (a drawn row, rms 0.02: 50), so
the recorded update's gradient norm was 70.29, 70.27 of it on that one row (1.77 without it).
After one AdamW update the row is no longer zero and the norm falls back. transformers'
nn.Embedding(padding_idx) gives that row no gradient at all, hence verl's FSDP engine's
ordinary step 1; our engine, as verl's Megatron engine, trains it.
"""

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss

from recipes.local.task.hf_checkpoints import make_tiny_checkpoint

RECORDING = Path(__file__).parents[1] / "data" / "first_update_batch.json"
GROUPS = ("router", "experts", "attention_norms", "embedding", "head")
PAD_ROW = "model.embed_tokens.weight"


def recording() -> dict:
    return json.loads(RECORDING.read_text())


def param_group(hf_name: str) -> str:
    """The parameter group of an HF-named tensor (experts unfused)."""
    if ".mlp.gate." in hf_name:
        return "router"
    if ".experts." in hf_name:
        return "experts"
    if "embed_tokens" in hf_name:
        return "embedding"
    if "lm_head" in hf_name:
        return "head"
    return "attention_norms"  # attention projections, q/k norms, layer and final norms


def group_norms(grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """L2 norm of the gradient per group, and `total` over all of them."""
    squares = dict.fromkeys(GROUPS, 0.0)
    for name, grad in grads.items():
        squares[param_group(name)] += float(grad.double().pow(2).sum())
    norms = {group: value**0.5 for group, value in squares.items()}
    norms["total"] = sum(squares.values()) ** 0.5
    return norms


def without_pad_row(grads: dict[str, torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    """The gradients with the pad token's embedding row zeroed (nn.Embedding's padding_idx)."""
    embedding = grads[PAD_ROW].clone()
    embedding[pad_id] = 0
    return {**grads, PAD_ROW: embedding}


def recorded_batch(rec: dict):
    """verl's TensorDict of the recorded rows: nested per-token fields, its non-tensor info."""
    rows = []
    for row in rec["rows"]:
        ids, n = torch.tensor(row["input_ids"]), row["response_length"]
        ones = torch.ones(n, dtype=torch.long)
        rows.append(dict(prompts=ids[:-n], responses=ids[-n:], input_ids=ids,
                         position_ids=torch.arange(len(ids)), response_mask=ones, loss_mask=ones,
                         advantages=torch.tensor(row["advantages"]),
                         old_log_probs=torch.tensor(row["old_log_probs"])))  # fmt: skip
    data = tu.list_of_dict_to_tensordict(rows)
    for key in rows[0]:  # nested even where every row has the same length, as verl's are
        data[key] = torch.nested.as_nested_tensor([r[key] for r in rows], layout=torch.jagged)
    info = rec["non_tensor"]
    tu.assign_non_tensor(data, calculate_entropy=False, global_batch_size=info["global_batch_size"],
                         use_dynamic_bsz=info["use_dynamic_bsz"], temperature=info["temperature"],
                         max_token_len_per_gpu=info["max_token_len_per_gpu"])  # fmt: skip
    return data


def loss_function(rec: dict):
    """verl's ppo_loss with the recorded actor settings (DAPO's clip-higher, token-mean)."""
    from recipes.dapo.engine.config import McoreEpActorConfig

    s = rec["loss"]
    config = McoreEpActorConfig(
        rollout_n=s["rollout_n"], use_dynamic_bsz=True, loss_agg_mode=s["loss_agg_mode"],
        clip_ratio_low=s["clip_ratio_low"], clip_ratio_high=s["clip_ratio_high"],
        clip_ratio_c=s["clip_ratio_c"], entropy_coeff=s["entropy_coeff"],
    )  # fmt: skip
    return partial(ppo_loss, config=config)


def hf_log_probs(model, data) -> torch.Tensor:
    """Per row, log p(x_{t+1}) at each position t and 0 at the last (nested, as the engine
    returns them): one right-padded forward (causal: padding after a row changes none of
    its positions, and the MoE has no capacity limit)."""
    rows = data["input_ids"].unbind()
    ids_BS = torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True)
    log_probs_BSV = torch.log_softmax(model(ids_BS).logits.float(), dim=-1)
    picked_BS = log_probs_BSV[:, :-1].gather(-1, ids_BS[:, 1:, None])[..., 0]
    per_row = [torch.cat([picked_BS[b, : len(r) - 1], picked_BS.new_zeros(1)])
               for b, r in enumerate(rows)]  # fmt: skip
    return torch.nested.as_nested_tensor(per_row, layout=torch.jagged)


@pytest.fixture(scope="module")
def replay(tmp_path_factory, world1):
    """HF-named gradients of the recorded update: ours with aux off and on (the main job's
    global_batch setting, counts from a counting pass: the same batch, the same weights),
    transformers' with the pad row trained (as ours) and as loaded (padding_idx)."""
    from transformers import Qwen3MoeForCausalLM

    from backend.qwen3_moe import load_qwen3_moe_spec, unfuse_experts
    from converters.table import mcore_to_hf
    from tests.recipes.test_verl_engine import build_engine
    from tests.support.oracles import gather_full

    rec = recording()
    hf_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("first_update"), **rec["model"])
    spec, loss_fn = load_qwen3_moe_spec(hf_dir), loss_function(rec)
    grads = {}
    aux_on = {**rec["aux_loss"], "global_counts": "counting_pass"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VERL_ENGINE_DEVICE", "cpu")
        for name, aux in (("aux_off", None), ("aux_on", aux_on)):
            engine = build_engine(hf_dir, aux_loss=aux)
            with engine.train_mode(zero_grad_on_exit=False):
                engine.optimizer_zero_grad()
                out = engine.forward_backward_batch(recorded_batch(rec), loss_fn)
                full = gather_full(engine.module, engine.groups, spec, grads=True)
                grads[name] = mcore_to_hf(full, spec)
            assert out["metrics"].get("moe/aux_loss/applied") == ([1.0] if aux else None)
    for name, trained in (("hf", True), ("hf_padding_idx", False)):
        model = Qwen3MoeForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                    attn_implementation="eager")  # fmt: skip
        if trained:
            model.model.embed_tokens.padding_idx = None
        data = recorded_batch(rec)
        tu.assign_non_tensor(
            data, dp_size=1, batch_num_tokens=rec["non_tensor"]["batch_num_tokens"]
        )
        log_probs = hf_log_probs(model, data)
        loss_fn(model_output={"log_probs": log_probs}, data=data)[0].backward()
        grads[name] = unfuse_experts({n: p.grad for n, p in model.named_parameters()})
    return rec, grads


def test_tiny_checkpoint_draws_the_pad_tokens_embedding_row(tmp_path):
    """Catches the zero pad row (transformers' padding_idx init) that made step 1's gradient
    an outlier; the config keeps its pad id, every other weight its draw."""
    from converters.hf_io import read_state_dict

    model = recording()["model"]
    hf_dir = make_tiny_checkpoint(tmp_path / "pad", **model)
    rows = read_state_dict(hf_dir)[PAD_ROW]
    assert rows.norm(dim=1).min() > 0.1  # a drawn row of 64 at std 0.02: ~0.16
    assert json.loads((hf_dir / "config.json").read_text())["pad_token_id"] == model["pad_token_id"]
    assert json.loads((hf_dir / "generation_config.json").read_text())["pad_token_id"] == 0
    no_pad = read_state_dict(make_tiny_checkpoint(tmp_path / "no_pad", **{**model,
                                                  "pad_token_id": None}))  # fmt: skip
    assert all(torch.equal(no_pad[n], t) for n, t in read_state_dict(hf_dir).items())


def test_first_update_gradient_matches_transformers_per_group(replay):
    """Aux off: every gradient of the recorded update is transformers' through verl's loss
    (a stale buffer, a wrong token count or dp scale would differ). Aux on: the aux term
    adds to the router's gradient and moves no other group's norm, nor the total, by more
    than 1%: it is not where an outlier comes from."""
    _, grads = replay
    ours, ref = grads["aux_off"], grads["hf"]
    assert ours.keys() == ref.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)
    norms_off, norms_on = group_norms(ours), group_norms(grads["aux_on"])
    aux_term = group_norms({n: grads["aux_on"][n] - ours[n] for n in ours})
    assert aux_term["router"] > 0  # the aux gradient is applied
    assert aux_term["total"] < 0.01 * norms_off["total"], (aux_term, norms_off)
    assert norms_on["total"] == pytest.approx(norms_off["total"], rel=0.01)
    for group in GROUPS[1:]:  # all but the router, where the aux loss applies
        assert norms_on[group] == pytest.approx(norms_off[group], rel=0.01), group


def test_first_update_gradient_norm_is_no_outlier(replay):
    """The step-1 outlier (#43): with the pad row all zeros the recorded update's norm was
    70.29, all but 1.77 of it on that row. Its norm must be the one without the pad row
    within 5% (verl's FSDP engine's gradient: transformers' padding_idx gives that row none),
    and the pad row's gradient no larger than the largest other row's."""
    rec, grads = replay
    pad_id, ours = rec["model"]["pad_token_id"], grads["aux_off"]
    fsdp_like = without_pad_row(ours, pad_id)
    for name, grad in grads["hf_padding_idx"].items():
        torch.testing.assert_close(fsdp_like[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    total, without = group_norms(ours)["total"], group_norms(fsdp_like)["total"]
    assert total == pytest.approx(without, rel=0.05), (
        f"step-1 gradient norm {total:.4g}, {without:.4g} without the pad token's embedding row "
        "(a zero row meets the first RMSNorm at x = 0: gradient x 1/sqrt(eps))"
    )
    rows = ours[PAD_ROW].norm(dim=1)
    others = torch.cat([rows[:pad_id], rows[pad_id + 1 :]])
    assert rows[pad_id] <= others.max(), (float(rows[pad_id]), float(others.max()))
