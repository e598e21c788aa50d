"""R3 on a response generated across a weight update (verl's async modes, partial rollouts).

verl's partial-rollout client keeps the routes of the tokens generated before an abort and
appends only the new tokens' routes when the request resumes under new weights
(`verl/workers/rollout/llm_server.py:306-313`: `concatenate([kept, output.routed_experts
[-len(output.token_ids):]])`). The update must replay each token's own route: the old
weights' experts for the first part of the response, the new weights' for the rest, never
re-routing either part (docs/async_modes.md).
"""

import torch

from tests.backend.test_router_replay import (
    FIRST,
    LAST,
    LAYERS,
    E,
    Watch,
    forced_experts,
    marked_batch,
    sum_loss,
)
from tests.recipes.test_verl_engine import LENGTHS, build_engine

# fed response tokens generated after the update (every row has more response than that)
RESUMED = 1


def new_weights_experts(ids: torch.Tensor, layer: int) -> torch.Tensor:
    """What the new weights' router picks (the test's: another function of the token id)."""
    ids = ids.long()
    return torch.stack(((ids + layer + 1) % E, (ids + layer + 5) % E), dim=-1).sort(-1).values


def spliced_routes(data) -> tuple[torch.Tensor, list[int]]:
    """verl's merge of two requests' routes per row ([len, L, K], int16 with the CPU
    rollout's zero last row), and where each row's resumed part starts."""
    rows, cuts = [], []
    for ids in data["input_ids"].unbind():
        before = torch.stack([forced_experts(ids, layer) for layer in range(LAYERS)], dim=1)
        after = torch.stack([new_weights_experts(ids, layer) for layer in range(LAYERS)], dim=1)
        fed = len(ids) - 1  # vLLM routes every token it fed: all but the last
        cut = fed - RESUMED
        merged = torch.cat([before[:cut], after[:fed][-RESUMED:], torch.zeros_like(before[:1])])
        rows.append(merged.to(torch.int16))
        cuts.append(cut)
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged), cuts


def test_r3_replays_each_token_the_route_of_the_weights_that_generated_it(
    world1, tiny_hf_dir, monkeypatch
):
    """Bug caught: routes of a resumed response replayed shifted (the resumed request's
    prompt rows taken for its new tokens), or all of it re-routed by one set of weights."""
    from backend.model.router_replay import indices_to_map_TE

    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    engine = build_engine(str(tiny_hf_dir), router_replay="R3")
    data = marked_batch(max_tokens=16)
    data["routed_experts"], cuts = spliced_routes(data)
    assert all(r > RESUMED for _, r in LENGTHS)  # every row has a part from each version
    watch = Watch(engine)
    with engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward_batch(data, sum_loss)
    seen = {"before": 0, "after": 0}
    for c in watch.calls:
        fed_T = (c["ids_T"] != LAST) & (c["valid_T"] if c["valid_T"] is not None else True)
        cut_T = torch.tensor(cuts)[c["first_T"] - FIRST]  # rows by their unique first token
        resumed_T = c["pos_T"] >= cut_T
        want_TE = torch.where(
            resumed_T[:, None],
            indices_to_map_TE(new_weights_experts(c["ids_T"], c["layer"]), E),
            indices_to_map_TE(forced_experts(c["ids_T"], c["layer"]), E),
        )
        same_T = (c["used_TE"] == want_TE).all(-1)
        assert bool(same_T[fed_T].all()), f"layer {c['layer']}: {int((fed_T & ~same_T).sum())} off"
        seen["before"] += int((fed_T & ~resumed_T).sum())
        seen["after"] += int((fed_T & resumed_T).sum())
    assert seen["after"] == LAYERS * RESUMED * len(LENGTHS) and seen["before"] > seen["after"]
