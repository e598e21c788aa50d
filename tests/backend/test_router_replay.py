"""Routing replay (mcore_ep.router_replay R2 / R3) and the train-vs-rollout mismatch metrics,
through verl's engine interface on the tiny Qwen3-MoE (CPU, world size 1).

Token identity: every row starts with a token unique to the row and ends with token LAST
(found nowhere else), and a hook on GPTModel sees each forward's ids, so a router call's
tokens are known as (row, position) and by id, whatever the micro-batching, padding,
sequence-parallel slicing or recompute.
"""

from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.recipes.test_verl_engine import build_engine, make_batch

E, K, LAYERS = 8, 2, 2  # tiny model: experts, top-k, layers
LAST = 127  # id of every row's last token (the rollout never feeds it)
FIRST = 100  # row b starts with FIRST + b


def forced_experts(ids: torch.Tensor, layer: int) -> torch.Tensor:
    """The test's rollout routes: a function of the token id and layer ([..., K])."""
    ids = ids.long()
    return torch.stack(((ids + layer) % E, (ids + layer + 3) % E), dim=-1).sort(-1).values


def marked_batch(max_tokens=32, seeds=(0,)):
    """make_batch with unique first tokens, LAST last tokens, no other FIRST.. / LAST ids."""
    data = make_batch(max_tokens=max_tokens, seeds=seeds)
    rows = []
    for b, ids in enumerate(data["input_ids"].unbind()):
        ids = ids % FIRST
        ids[0], ids[-1] = FIRST + b, LAST
        rows.append(ids)
    data["input_ids"] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    return data


def rollout_routes(data, rollout: str = "cpu") -> torch.Tensor:
    """verl's nested routed_experts [B, len, L, K] with forced_experts at every fed position:
    as the CPU rollout returns them (int16, the last row a placeholder of zeros) or as vLLM
    does (uint8, [len - 1, L, K]: no row for the token it never fed)."""
    rows = []
    for ids in data["input_ids"].unbind():
        r = torch.stack([forced_experts(ids, layer) for layer in range(LAYERS)], dim=1)
        r[-1] = 0
        rows.append(r.to(torch.int16) if rollout == "cpu" else r[:-1].to(torch.uint8))
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


class Watch:
    """Tap listener: per router call, the tokens' ids and (row, position), used and own maps."""

    def __init__(self, engine):
        from megatron.core.models.gpt import GPTModel

        self.engine, self.calls, self.ids_BS = engine, [], None
        gpt = next(m for m in engine.module.modules() if isinstance(m, GPTModel))
        gpt.register_forward_pre_hook(self._ids)
        engine.routing.tap.add_listener(self)

    def _ids(self, module, args):
        self.ids_BS = args[0].detach().clone()

    def _local_SB(self, x_BS, num_tokens):
        x_SB = x_BS.t()
        groups = self.engine.groups
        if x_SB.numel() != num_tokens:
            x_SB = x_SB.chunk(groups.size("tp"), dim=0)[groups.rank("tp")]
        return x_SB.reshape(-1)

    def __call__(self, call):
        t = call.routing_map_TE.shape[0]
        b_idx = torch.arange(self.ids_BS.shape[0])[:, None].expand_as(self.ids_BS)
        s_idx = torch.arange(self.ids_BS.shape[1])[None].expand_as(self.ids_BS)
        self.calls.append(
            dict(
                layer=call.layer,
                recompute=call.recompute,
                ids_T=self._local_SB(self.ids_BS, t),
                first_T=self._local_SB(self.ids_BS[:, :1].expand_as(self.ids_BS), t),
                pos_T=self._local_SB(s_idx, t),
                row_T=self._local_SB(b_idx, t),
                valid_T=call.valid_T.clone() if call.valid_T is not None else None,
                used_TE=call.routing_map_TE.detach().clone(),
                own_TE=call.chosen_map_TE.detach().clone(),
            )
        )

    def routes_by_token(self, which="used_TE") -> dict:
        """(first token, position, layer) -> expert set, over real tokens of first forwards."""
        out = {}
        for c in self.calls:
            if c["recompute"]:
                continue
            real_T = c["ids_T"] != 0 if c["valid_T"] is None else c["valid_T"]
            for t in real_T.nonzero().flatten().tolist():
                key = (int(c["first_T"][t]), int(c["pos_T"][t]), c["layer"])
                out[key] = tuple(c[which][t].nonzero().flatten().tolist())
        return out


def forced_mismatches(watch: Watch) -> tuple[int, int, int]:
    """(tokens checked, tokens not on forced_experts, recompute calls) over real, fed tokens."""
    from backend.model.router_replay import indices_to_map_TE

    checked = wrong = recomputes = 0
    for c in watch.calls:
        recomputes += c["recompute"]
        fed_T = (c["ids_T"] != LAST) & (c["valid_T"] if c["valid_T"] is not None else True)
        want_TE = indices_to_map_TE(forced_experts(c["ids_T"], c["layer"]), E)
        same_T = (c["used_TE"] == want_TE).all(-1)
        checked += int(fed_T.sum())
        wrong += int((fed_T & ~same_T).sum())
    return checked, wrong, recomputes


def fed_router_tokens(recompute: bool = False) -> int:
    """Router-call tokens one DP replica's marked_batch feeds a pass: every row but its last
    token (LENGTHS), in each layer; with full recompute the update's replays again."""
    from tests.recipes.test_verl_engine import LENGTHS

    return LAYERS * sum(p + r - 1 for p, r in LENGTHS) * (2 if recompute else 1)


def sum_loss(model_output, data, dp_group=None):
    """A loss whose gradient reaches every router: the sum of the response log-probs."""
    return model_output["log_probs"].values().sum(), {}


def r3_update_rank(rank, hf_dir, tp, ep, recompute, pp=1, rollout="cpu"):
    """One rank: R3 old-log-prob pass and update on forced routes; mismatch counts per phase,
    and the (layers, dtype) of the routes the engine handed its routers."""
    import os

    os.environ["VERL_ENGINE_DEVICE"] = "cpu"
    from backend.platform.device import prepare_device

    prepare_device("cpu")
    engine = build_engine(hf_dir, tp=tp, ep=ep, recompute=recompute, router_replay="R3",
                          pipeline_model_parallel_size=pp)  # fmt: skip
    data = marked_batch(max_tokens=16, seeds=(engine.get_data_parallel_rank(),))
    data["routed_experts"] = rollout_routes(data, rollout)
    watch, given = Watch(engine), set()
    set_routes = engine.routing.tap.set_routes

    def seen(replay=None, reference=None):
        if replay is not None:
            given.add((replay.first_layer, replay.experts_BSLK.shape[2], replay.experts_BSLK.dtype))
        set_routes(replay=replay, reference=reference)

    engine.routing.tap.set_routes = seen
    with engine.eval_mode():
        engine.infer_batch(data)
    old = forced_mismatches(watch)
    watch.calls.clear()
    with engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward_batch(data, sum_loss)
    return {
        "old_log_prob": old,
        "update": forced_mismatches(watch),
        "given": given,
        "dp_rank": engine.get_data_parallel_rank(),
    }


@pytest.fixture
def engine_of(world1, tiny_hf_dir, monkeypatch):
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    return partial(build_engine, tiny_hf_dir)


@pytest.mark.parametrize(
    "recompute, rollout",
    [(False, "cpu"), (True, "cpu"), (False, "vllm"), (True, "vllm")],
    ids=["plain", "recompute", "vllm-uint8", "vllm-uint8-recompute"],
)
def test_r3_routes_every_fed_token_as_the_rollout(
    world1, tiny_hf_dir, monkeypatch, recompute, rollout
):
    """Every token the rollout fed, counted exactly, in both passes (and recompute's replays):
    int16 rows of every token (the earlier CPU rollout's layout) or uint8 rows of all but the
    last (vLLM's), the ids moved to the routers as uint8 (8 experts). Catches a fed token the
    router never routes as a real one (each row's first token marked as padding in the
    micro-batch's mask): no mismatch there, fewer checked than fed."""
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    result = r3_update_rank(0, str(tiny_hf_dir), 1, 1, recompute, rollout=rollout)
    for phase in ("old_log_prob", "update"):
        checked, wrong, _ = result[phase]
        fed = fed_router_tokens(recompute and phase == "update")
        assert (checked, wrong) == (fed, 0), f"{phase}: {wrong} of {checked} off, {fed} fed"
    assert (result["update"][2] > 0) == recompute  # recompute's replays were checked too
    assert result["given"] == {(0, LAYERS, torch.uint8)}


WIDER_THAN_UINT8 = (torch.int16, torch.int32, torch.int64)


class WidenedRoutes(TorchDispatchMode):
    """Records every op whose output is an integer tensor wider than uint8 shaped like routes
    ([T, L, K] or [B, S, L, K]): a copy of the routes in a wider dtype. The routers' own
    [T, K] index of one layer (int64: torch's gather and scatter take no other) and the
    meters' [2, L] counts are not route-shaped."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            wide = isinstance(t, torch.Tensor) and t.dtype in WIDER_THAN_UINT8
            if wide and t.dim() >= 3 and tuple(t.shape[-2:]) == (LAYERS, K):
                self.seen.append(f"{func} -> {t.dtype} {tuple(t.shape)}")
        return out


def test_vllms_uint8_routes_are_never_copied_wider(engine_of):
    """vLLM's routed_experts (uint8, [prompt + response - 1, L, K] a row) through the R3
    old-log-prob pass and update: from verl's batch to the routers, no copy of them in a
    wider dtype."""
    engine = engine_of(router_replay="R3")
    data = marked_batch(max_tokens=16)
    data["routed_experts"] = rollout_routes(data, "vllm")
    with WidenedRoutes() as mode:
        with engine.eval_mode():
            engine.infer_batch(data)
        with engine.train_mode():
            engine.optimizer_zero_grad()
            engine.forward_backward_batch(data, sum_loss)
    assert mode.seen == []
    with WidenedRoutes() as mode:  # the check itself sees a widening copy
        data["routed_experts"].to(torch.int32)
    assert mode.seen


def test_routes_of_another_model_are_refused_in_one_line(engine_of):
    from recipes.dapo.engine.batches import BatchError

    engine = engine_of(router_replay="R3")
    data = marked_batch(max_tokens=16)
    routes = rollout_routes(data)
    for bad, says in ((routes.values() + E, "expert ids"), (routes.values().float(), "float")):
        data["routed_experts"] = torch.nested.nested_tensor_from_jagged(bad, routes.offsets())
        with pytest.raises(BatchError, match=says) as err, engine.eval_mode():
            engine.infer_batch(data)
        assert "\n" not in str(err.value)


def test_r3_keeps_the_routers_own_choice_on_unfed_and_padding_tokens(engine_of):
    engine = engine_of(router_replay="R3")
    data = marked_batch(max_tokens=16)
    data["routed_experts"] = rollout_routes(data)
    watch = Watch(engine)
    with engine.eval_mode():
        engine.infer_batch(data)
    for c in watch.calls:
        unfed_T = c["ids_T"] == LAST
        unfed_T |= ~c["valid_T"] if c["valid_T"] is not None else False
        assert unfed_T.any()
        assert torch.equal(c["used_TE"][unfed_T], c["own_TE"][unfed_T])


def test_r2_update_reuses_the_old_log_prob_routes(engine_of):
    """R2: the old-log-prob pass returns its own routes; after the router moved, the update
    still routes every token as that pass did (and the router's own choice differs)."""
    engine = engine_of(router_replay="R2")
    data = marked_batch(max_tokens=16)
    watch = Watch(engine)
    with engine.eval_mode():
        out = engine.infer_batch(data)
    recorded = out["model_output"]["routed_experts"]
    assert recorded.dtype == torch.uint8  # one byte per expert id (8 experts)
    old = watch.routes_by_token()
    for b, (ids, rows) in enumerate(
        zip(data["input_ids"].unbind(), recorded.unbind(), strict=True)
    ):
        assert rows.shape == (len(ids), LAYERS, K)
        for pos in range(len(ids)):
            for layer in range(LAYERS):
                assert tuple(rows[pos, layer].tolist()) == old[(FIRST + b, pos, layer)]
    with torch.no_grad():  # move every router: its own choice changes
        for name, p in engine.module.named_parameters():
            if name.endswith("router.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    data["routed_experts"] = recorded
    watch.calls.clear()
    with engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward_batch(data, sum_loss)
    assert watch.routes_by_token() == old
    assert watch.routes_by_token("own_TE") != old


def _router_grads(engine) -> dict[str, torch.Tensor]:
    from backend.qwen3_moe import load_qwen3_moe_spec
    from converters.table import mcore_to_hf
    from tests.support.oracles import gather_full

    spec = load_qwen3_moe_spec(engine.model_config.local_path)
    grads = mcore_to_hf(gather_full(engine.module, engine.groups, spec, grads=True), spec)
    return {k: v for k, v in grads.items() if k.endswith("mlp.gate.weight")}


def _force_by_hand(engine, watch) -> None:
    """The reference: each router's routing replaced by probs gathered at forced_experts
    (softmax over all experts, gathered, renormalised: Qwen3's norm_topk_prob)."""
    from megatron.core.transformer.moe.router import TopKRouter

    for router in (m for m in engine.module.modules() if isinstance(m, TopKRouter)):
        original = router.routing

        def routing(logits, *args, _router=router, _original=original, **kwargs):
            probs_TE, map_TE = _original(logits, *args, **kwargs)
            logits_TE = logits.reshape(-1, E)
            ids_T = watch._local_SB(watch.ids_BS, logits_TE.shape[0])
            fed_T = ((ids_T != LAST) & (ids_T != 0))[:, None]
            idx_TK = forced_experts(ids_T, _router.layer_number - 1)
            p_TK = torch.softmax(logits_TE, -1).gather(1, idx_TK)
            p_TK = p_TK / p_TK.sum(-1, keepdim=True)
            forced_TE = torch.zeros_like(logits_TE).scatter(1, idx_TK, p_TK)
            forced_map_TE = torch.zeros_like(map_TE).scatter(1, idx_TK, True)
            return torch.where(fed_T, forced_TE, probs_TE), torch.where(
                fed_T, forced_map_TE, map_TE
            )

        router.routing = routing


def test_router_gradient_flows_through_replayed_experts(engine_of):
    data = marked_batch(max_tokens=16)
    data["routed_experts"] = rollout_routes(data)
    grads = {}
    for mode in ("R3", "by_hand"):
        engine = engine_of(router_replay="R3" if mode == "R3" else "disabled")
        if mode == "by_hand":
            _force_by_hand(engine, Watch(engine))
            del data["routed_experts"]
        with engine.train_mode(zero_grad_on_exit=False):
            engine.optimizer_zero_grad()
            engine.forward_backward_batch(data, sum_loss)
            grads[mode] = _router_grads(engine)
    assert len(grads["R3"]) == LAYERS
    for name, g in grads["R3"].items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(g, grads["by_hand"][name], rtol=1e-5, atol=1e-7)


def _own_routes(engine_of, data):
    """The router's own routes of `data` (an R2 engine's recording)."""
    engine = engine_of(router_replay="R2")
    with engine.eval_mode():
        return engine.infer_batch(data)["model_output"]["routed_experts"]


def test_injected_route_changes_drop_the_agreement_by_their_share(engine_of):
    data = marked_batch(max_tokens=16)
    own = _own_routes(engine_of, data)
    rows = [r.clone() for r in own.unbind()]
    counted = []  # (row, position) of the response tokens the rollout fed its model
    for b, (p_len, r_len) in enumerate(
        (len(p), len(r))
        for p, r in zip(data["prompts"].unbind(), data["responses"].unbind(), strict=True)
    ):
        counted += [(b, pos) for pos in range(p_len, p_len + r_len - 1)]
        rows[b][-1] = 0  # the rollout's placeholder for its unfed last token
    changed = counted[::3]  # layer 1 only: a third (rounded up) of the counted tokens
    for b, pos in changed:
        rows[b][pos, 1] = (rows[b][pos, 1] + 1) % E
    data["routed_experts"] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    engine = engine_of()  # disabled: the forward is the rollout's (same weights, no replay)
    with engine.eval_mode():
        metrics = engine.infer_batch(data)["metrics"]
    share = 1 - len(changed) / len(counted)
    assert metrics["moe/routing_agreement/layer_00"] == [1.0]
    assert metrics["moe/routing_agreement/layer_01"] == [pytest.approx(share, abs=1e-12)]
    assert metrics["moe/routing_agreement/min"] == [pytest.approx(share, abs=1e-12)]
    assert metrics["moe/routing_agreement/mean"] == [pytest.approx((1 + share) / 2, abs=1e-12)]


def test_rollout_logprob_diff_and_agreement_reach_the_update_metrics_and_report(
    engine_of, tmp_path
):
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import response_from_nested

    from backend.monitor.report import load_report
    from tests.recipes.test_verl_engine import dapo_actor_config

    data = marked_batch()
    data["routed_experts"] = _own_routes(engine_of, data)
    engine = engine_of()
    with engine.eval_mode():
        lp = engine.infer_batch(data)["model_output"]["log_probs"]
    rollout = response_from_nested(lp, data["response_mask"])
    values = rollout.values().clone()
    values[3] += 0.5  # one response token off by 0.5, the others exact
    data["rollout_log_probs"] = torch.nested.nested_tensor_from_jagged(values, rollout.offsets())
    with engine.eval_mode():
        old = engine.infer_batch(data)
    data["old_log_probs"] = response_from_nested(
        old["model_output"]["log_probs"], data["response_mask"]
    )
    n = values.numel()
    m = old["metrics"]
    assert m["actor/rollout_logprob_abs_diff/max"] == [pytest.approx(0.5, abs=1e-6)]
    assert m["actor/rollout_logprob_abs_diff/mean"] == [pytest.approx(0.5 / n, abs=1e-6)]
    # nearest rank: with fewer than 100 tokens the 99th percentile is the largest
    assert m["actor/rollout_logprob_abs_diff/p99"] == [pytest.approx(0.5, abs=1e-6)]
    assert m["moe/routing_agreement/mean"] == [1.0]  # CPU: the same fp32 forward
    with engine.train_mode():
        out = engine.train_batch(data, loss_function=partial(ppo_loss, config=dapo_actor_config()))
    assert out["metrics"]["moe/routing_agreement/min"] == [1.0]
    assert "actor/rollout_logprob_abs_diff/max" in out["metrics"]
    engine.routing.write_report(tmp_path / "r.json", model="tiny")
    report = load_report(tmp_path / "r.json")
    assert report.meta["router_replay"] == "disabled"
    assert report.agreement_L().tolist() == [1.0, 1.0]


def test_monitor_counts_used_experts_and_aux_loss_reads_the_routers_own(engine_of):
    """Every fed token forced onto experts {0, 1}: the monitor counts them there; the aux
    loss of layer 0 (whose router input replay cannot change) is the unreplayed value."""
    data = marked_batch(max_tokens=16)
    routes = [torch.zeros_like(r) for r in rollout_routes(data).unbind()]
    for r in routes:
        r[..., 1] = 1
    aux = {"mode": "observe", "type": "global_batch", "coeff": 1e-3, "scope": "all"}
    values = {}
    for mode in ("disabled", "R3"):
        engine = engine_of(router_replay=mode, aux_loss=aux)
        if mode == "R3":
            data["routed_experts"] = torch.nested.as_nested_tensor(routes, layout=torch.jagged)
        with engine.train_mode():
            engine.optimizer_zero_grad()
            values[mode] = engine.forward_backward_batch(data, sum_loss)["metrics"]
        counts_LE = engine.routing.monitor.history.cumulative_PLE[0]  # phase "update"
    fed = sum(len(ids) - 1 for ids in data["input_ids"].unbind())
    rows = len(data["input_ids"].unbind())
    for layer in range(LAYERS):
        assert counts_LE[layer, 0] >= fed and counts_LE[layer, 1] >= fed
        assert counts_LE[layer].sum() == K * (fed + rows)
    key = "moe/aux_loss/load_balancing/layer_0"
    assert values["R3"][key] == [pytest.approx(values["disabled"][key][0], rel=1e-6)]


def test_replay_mode_is_validated(engine_of):
    from recipes.dapo.engine.config import EngineConfigError, McoreEpEngineConfig

    with pytest.raises(EngineConfigError, match="router_replay='R4'"):
        McoreEpEngineConfig(router_replay="R4")
    engine = engine_of(router_replay="R3")
    with pytest.raises(ValueError, match="enable_rollout_routing_replay=True"):
        with engine.eval_mode():
            engine.infer_batch(marked_batch())


def test_p99_is_the_nearest_rank_percentile():
    from recipes.dapo.engine.mismatch import summary

    diffs = torch.cat((torch.zeros(990), torch.ones(10)))  # 1% of the tokens at 1
    assert summary(diffs)["actor/rollout_logprob_abs_diff/p99"] == 0.0
    assert summary(torch.cat((diffs, torch.ones(1))))["actor/rollout_logprob_abs_diff/p99"] == 1.0


@pytest.mark.parametrize("mode", ["disabled", "R3"])
def test_update_route_match_counts_the_experts_the_update_used(engine_of, mode):
    """`moe/update_route_match`: the share of response tokens whose experts used in the update
    equal the rollout's. Rollout routes that differ from the router's own on a third of the
    counted tokens (layer 1): disabled matches on the rest, R3 on all (mutation: comparing the
    router's own choice instead of the experts used makes R3 read like disabled)."""
    data = marked_batch(max_tokens=16)
    own = _own_routes(engine_of, data)
    rows = [r.clone() for r in own.unbind()]
    counted = []
    for b, (p_len, r_len) in enumerate(
        (len(p), len(r))
        for p, r in zip(data["prompts"].unbind(), data["responses"].unbind(), strict=True)
    ):
        counted += [(b, pos) for pos in range(p_len, p_len + r_len - 1)]
        rows[b][-1] = 0
    changed = counted[::3]
    for b, pos in changed:
        rows[b][pos, 1] = (rows[b][pos, 1] + 1) % E
    data["routed_experts"] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    engine = engine_of(router_replay=mode)
    with engine.train_mode():
        engine.optimizer_zero_grad()
        metrics = engine.forward_backward_batch(data, sum_loss)["metrics"]
    share = 1.0 if mode == "R3" else 1 - len(changed) / len(counted)
    assert metrics["moe/update_route_match/layer_00"] == [1.0]
    assert metrics["moe/update_route_match/layer_01"] == [pytest.approx(share, abs=1e-12)]
    assert metrics["moe/update_route_match/min"] == [pytest.approx(share, abs=1e-12)]
