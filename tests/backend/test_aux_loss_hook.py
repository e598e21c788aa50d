"""The aux-loss hook on the tiny megatron-core model: values and gradients against a reference
formula, invariance to micro-batch split, DP degree and recompute, and observe == off."""

import pytest
import torch

from backend.aux_loss import AuxLossConfig, mcore_aux_loss
from backend.instruments.router_tap import RouterTap
from backend.model.forward import next_token_log_probs

pytestmark = pytest.mark.mcore_compat

BATCH, SEQ, PROMPT = 8, 16, 4
LENGTHS = (16, 9, 12, 16, 7, 14, 10, 16)  # right padding, so micro-batches carry unequal tokens
COEFF, Z_COEFF = 0.1, 0.01


def config(kind: str, mode: str = "on", scope: str = "response") -> AuxLossConfig:
    return AuxLossConfig(mode=mode, type=kind, coeff=COEFF, z_coeff=Z_COEFF, scope=scope)


def batch(vocab: int):
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    attention = torch.arange(SEQ)[None] < torch.tensor(LENGTHS)[:, None]
    response = (torch.arange(SEQ) >= PROMPT)[None].expand(BATCH, SEQ)
    return ids, attention, response


def grads_of(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def aux_only(lp_BS, loss_mask_BS):
    return lp_BS.sum() * 0  # backward reaches every router; only the aux gradient is nonzero


def token_mean_nll(lp_BS, loss_mask_BS):
    return -(lp_BS * loss_mask_BS[:, 1:]).sum() / loss_mask_BS[:, 1:].sum()


def aux_step(model, groups, cfg, ids, attention, response, splits, main=aux_only, sync=None):
    """One optimizer step's forwards/backwards as the actor runs them; (metrics, grads)."""
    tap = RouterTap(model, groups)
    hook = mcore_aux_loss(model, tap, cfg, groups)
    try:
        chunks = [
            (x, hook.valid_tokens(a, r), a & r)
            for x, a, r in zip(
                ids.split(splits), attention.split(splits), response.split(splits), strict=True
            )
        ]
        hook.start_step([valid for _, valid, _ in chunks])
        if cfg.needs_counting_pass:
            with hook.counting():
                for x, valid, _ in chunks:
                    hook.set_tokens(valid)
                    next_token_log_probs(model, x)
        for x, valid, loss_mask in chunks:
            hook.set_tokens(valid)
            main(next_token_log_probs(model, x), loss_mask).backward()
        metrics = hook.end_step()
    finally:
        hook.remove()
        tap.remove()
    if sync:
        sync(model)
    return metrics, grads_of(model)


# ---- reference: the step loss written out directly from the routers' outputs ---------------


def ref_balance(logits_TE, map_TE, top_k):
    f_E = map_TE.float().mean(0) / top_k
    return logits_TE.shape[-1] * (f_E * torch.softmax(logits_TE, -1).mean(0)).sum()


def ref_layer_loss(call, kind, batch_size, top_k):
    """One micro-batch's loss at `kind` level (tokens in megatron's [S, B] order)."""
    valid_SB = call.valid_T.view(-1, batch_size)
    logits_SBE = call.logits_TE.view(*valid_SB.shape, -1)
    map_SBE = call.routing_map_TE.view(*valid_SB.shape, -1)
    if kind != "sequence":
        return ref_balance(logits_SBE[valid_SB], map_SBE[valid_SB], top_k)
    per_seq = [
        ref_balance(logits_SBE[:, b][valid_SB[:, b]], map_SBE[:, b][valid_SB[:, b]], top_k)
        for b in range(batch_size)
        if valid_SB[:, b].any()
    ]
    return torch.stack(per_seq).sum()  # summed here, divided by the step's sequence count


def reference_step(model, groups, kind, ids, valid, splits, top_k=2):
    """Σ_mb weight * L_mb + z over one step with separate forwards, then backward."""
    num_tokens, num_seqs = valid.sum(), valid.any(-1).sum()
    total, values = 0.0, {}
    for x, v in zip(ids.split(splits), valid.split(splits), strict=True):
        tap = RouterTap(model, groups)
        calls = []
        tap.add_listener(calls.append)
        tap.set_token_mask(v)
        total = total + aux_only(next_token_log_probs(model, x), v)
        tap.remove()
        weight = 1 / num_seqs if kind == "sequence" else v.sum() / num_tokens
        for call in calls:
            lb = weight * ref_layer_loss(call, kind, v.shape[0], top_k)
            lse_T = torch.logsumexp(call.logits_TE[call.valid_T], -1)
            z = lse_T.square().sum() / num_tokens
            total = total + COEFF * lb + Z_COEFF * z
            lb0, z0 = values.get(call.layer, (0.0, 0.0))
            values[call.layer] = (lb0 + lb.item(), z0 + z.item())
    total.backward()
    return values, grads_of(model)


def assert_matches(metrics, grads, ref_values, ref_grads):
    for layer, (lb, z) in ref_values.items():
        assert metrics[f"moe/aux_loss/load_balancing/layer_{layer}"] == pytest.approx(lb, rel=1e-5)
        assert metrics[f"moe/aux_loss/z_loss/layer_{layer}"] == pytest.approx(z, rel=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-8, msg=name)


# ---- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny ops: one thread is as fast, and immune to oversubscribed shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tiny_mcore(groups, hf_dir, recompute=False):
    from backend.model.build import BuildOptions, build_model
    from backend.qwen3_moe import load_qwen3_moe_spec
    from converters.hf_io import read_state_dict
    from converters.sharding import load_hf_into_model

    spec = load_qwen3_moe_spec(hf_dir)
    model = build_model(spec, groups, BuildOptions(recompute=recompute))
    load_hf_into_model(model, read_state_dict(hf_dir), spec)
    return model


@pytest.fixture(scope="module")
def model(world1, tiny_hf_dir):
    return _tiny_mcore(world1, tiny_hf_dir)


@pytest.fixture(scope="module")
def model_recompute(world1, tiny_hf_dir):
    return _tiny_mcore(world1, tiny_hf_dir, recompute=True)


@pytest.fixture(scope="module")
def data(model):
    return batch(model.vocab_size)


@pytest.fixture(scope="module")
def global_reference(model, world1, data):
    ids, attention, response = data
    return reference_step(model, world1, "global_batch", ids, attention & response, [BATCH])


# ---- tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("splits", [[8], [4, 4], [2, 2, 2, 2], [1, 3, 4]], ids=str)
def test_global_batch_matches_reference_for_any_split(
    model, world1, data, global_reference, splits
):
    metrics, grads = aux_step(model, world1, config("global_batch"), *data, splits)
    assert_matches(metrics, grads, *global_reference)
    assert metrics["moe/aux_loss/applied"] == 1.0
    assert metrics["moe/aux_loss/grad_scale"] == 1.0  # every router call's backward carried it


def test_global_batch_with_recompute_adds_the_loss_once(
    model_recompute, world1, data, global_reference
):
    """The replayed router call attaches its aux term; the first forward (no grad) only logs:
    one term per call reaches backward (grad_scale 2 if both attached)."""
    metrics, grads = aux_step(model_recompute, world1, config("global_batch"), *data, [3, 5])
    assert_matches(metrics, grads, *global_reference)
    assert metrics["moe/aux_loss/grad_scale"] == 1.0


@pytest.mark.parametrize(
    "kind, splits",
    [("sequence", [8]), ("sequence", [1, 3, 4]), ("micro_batch", [8]), ("micro_batch", [2, 6])],
)
def test_sequence_and_micro_batch_match_reference(model, world1, data, kind, splits):
    ids, attention, response = data
    ref = reference_step(model, world1, kind, ids, attention & response, splits)
    assert_matches(*aux_step(model, world1, config(kind), *data, splits), *ref)


def test_sequence_level_with_recompute(model_recompute, model, world1, data):
    expected = aux_step(model, world1, config("sequence"), *data, [2, 6])
    got = aux_step(model_recompute, world1, config("sequence"), *data, [2, 6])
    assert got[0] == pytest.approx(expected[0], rel=1e-6)
    for name, ref in expected[1].items():
        torch.testing.assert_close(got[1][name], ref, rtol=1e-4, atol=1e-8, msg=name)


def test_scope_all_counts_prompt_tokens(model, world1, data):
    ids, attention, _ = data
    ref = reference_step(model, world1, "global_batch", ids, attention, [BATCH])
    assert_matches(
        *aux_step(model, world1, config("global_batch", scope="all"), *data, [4, 4]), *ref
    )


def test_observe_leaves_gradients_bit_identical_to_off(model, world1, data):
    _, off = aux_step(model, world1, AuxLossConfig(), *data, [4, 4], main=token_mean_nll)
    metrics, observe = aux_step(
        model, world1, config("global_batch", mode="observe"), *data, [4, 4], main=token_mean_nll
    )
    _, on = aux_step(model, world1, config("global_batch"), *data, [4, 4], main=token_mean_nll)
    assert all(torch.equal(observe[n], off[n]) for n in off)
    assert not all(torch.equal(on[n], off[n]) for n in off)
    assert (
        metrics["moe/aux_loss/applied"] == 0.0 and metrics["moe/aux_loss/load_balancing/mean"] > 0
    )


def test_valid_tokens_follow_scope(model, world1, data):
    _, attention, response = data
    tap = RouterTap(model, world1)
    hooks = [
        mcore_aux_loss(model, tap, config("sequence", scope=scope), world1)
        for scope in ("response", "all")
    ]
    try:
        # verl's response mask is [B, R] over the last R positions
        assert torch.equal(
            hooks[0].valid_tokens(attention, response[:, PROMPT:]), attention & response
        )
        with pytest.raises(ValueError, match="needs the response mask"):
            hooks[0].valid_tokens(attention)
        assert torch.equal(hooks[1].valid_tokens(attention, response), attention)
    finally:
        for hook in hooks:
            hook.remove()
        tap.remove()


def test_global_batch_without_counting_pass_is_an_error(model, world1, data):
    ids, attention, _ = data
    tap = RouterTap(model, world1)
    hook = mcore_aux_loss(model, tap, config("global_batch", scope="all"), world1)
    try:
        hook.start_step([attention])
        hook.set_tokens(attention)
        with pytest.raises(RuntimeError, match="hook.counting"):
            next_token_log_probs(model, ids)
    finally:
        hook.remove()
        tap.remove()


def test_tokens_fed_must_match_start_step(model, world1, data):
    ids, attention, _ = data
    tap = RouterTap(model, world1)
    hook = mcore_aux_loss(model, tap, config("micro_batch", scope="all"), world1)
    try:
        hook.start_step([attention[:4]])
        for x, valid in ((ids[:4], attention[:4]), (ids[4:], attention[4:])):
            hook.set_tokens(valid)
            next_token_log_probs(model, x).sum().backward()
        with pytest.raises(ValueError, match="start_step declared"):
            hook.end_step()
        model.zero_grad(set_to_none=True)
        hook.start_step([attention])
        hook.tap.set_token_mask(attention)  # set_tokens skipped: the hook cannot know B
        with pytest.raises(ValueError, match="set_tokens"):
            next_token_log_probs(model, ids)
    finally:
        hook.remove()
        tap.remove()


# ---- two gloo ranks: DP (summed by tests/support/reference_actor.py) and TP with sequence parallel ----

PLANS = {  # tp, etp, each DP rank's micro-batch split, the same split seen from world size 1
    "dp2": (1, 1, ([1, 3], [2, 2]), [1, 3, 2, 2]),
    "tp2": (2, 2, ([3, 5],), [3, 5]),  # etp=2: megatron-core 0.12.1 refuses tp2 with etp1
}


def plan_rank(rank: int, hf_dir: str, plan: str) -> dict:
    from backend.platform.device import prepare_device
    from tests.support.multiproc import loaded_model
    from tests.support.reference_actor import sync_grads

    tp, etp, splits, _ = PLANS[plan]
    prepare_device("cpu")
    model, spec, groups = loaded_model(hf_dir, tp=tp, etp=etp)
    dp, dp_rank = groups.size("dp"), groups.rank("dp")
    data = [t.chunk(dp)[dp_rank] for t in batch(spec.vocab_size)]
    out = {}
    for kind in ("global_batch", "sequence", "micro_batch"):
        metrics, grads = aux_step(
            model,
            groups,
            config(kind),
            *data,
            splits[dp_rank],
            sync=lambda m: sync_grads(m, groups),
        )
        # TP shards most weights; the router is replicated and its gradient summed over TP
        out[kind] = (metrics, {n: g for n, g in grads.items() if tp == 1 or ".router." in n})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS)
def test_two_ranks_match_one(model, world1, data, tiny_hf_dir, plan):
    from tests.support.multiproc import run_ranks

    results = run_ranks(plan_rank, 2, str(tiny_hf_dir), plan)
    ids, attention, response = data
    valid, split = attention & response, PLANS[plan][3]
    for kind in ("global_batch", "sequence", "micro_batch"):
        # micro_batch is per micro-batch by definition: compare with the same micro-batches
        ref_values, ref_grads = reference_step(
            model, world1, kind, ids, valid, split if kind == "micro_batch" else [BATCH]
        )
        for rank_result in results:
            metrics, grads = rank_result[kind]
            assert_matches(metrics, grads, ref_values, {n: ref_grads[n] for n in grads})
