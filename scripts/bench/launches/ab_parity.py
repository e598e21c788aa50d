"""Step 1 on both actors: verl's FSDP2 engine and ours, from the same HF weights, on one batch.

Both engines are built as verl's TrainingWorker builds them (`EngineRegistry.new`, world size
1, fp32, the aux loss off) and get the same DAPO-shaped mini-batch: `groups` random prompts
x n responses sampled from the policy (transformers on the same weights), token-mean loss with DAPO's clip-higher, GRPO-like
advantages (zero-mean per group). Each runs the old-log-prob pass (`infer_batch`) and one
update (`train_batch`: forward, backward, clip, optimizer step) through verl's own ppo_loss.
Returns, per engine, the log-probs, the loss and the grad norm of that update, and the largest
differences: what `python -m scripts.bench.launches.ab_engines` reports as the step-1 agreement.

    python -m scripts.bench.launches.ab_parity HF_DIR     # a line "step-1 agreement: {JSON}" on stdout
"""

import json
import sys
from functools import partial
from pathlib import Path

import torch

MARK = "step-1 agreement: "  # the JSON's line among verl's prints
DAPO_LOSS = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0)
OPTIM = dict(lr=1e-6, lr_warmup_steps=10, weight_decay=0.1, clip_grad=1.0)


def make_batch(vocab: int, pad_id: int | None, groups: int = 2, n: int = 16, prompt_len: int = 12,
               max_response: int = 8, seed: int = 0, policy=None):  # fmt: skip
    """A verl training batch of groups x n sequences: random prompts, responses sampled from
    `policy` (transformers' model of the same weights; None: random tokens), random lengths
    and rewards; without the pad token: transformers' nn.Embedding(padding_idx) never trains
    its row, ours (as verl's Megatron engine) does, a known difference
    (tests/recipes/test_first_update.py)."""
    from verl.utils import tensordict_utils as tu

    gen, rows = torch.Generator().manual_seed(seed), []
    for g in range(groups):  # prompts of different lengths: nested, as verl's batches are
        prompt = _tokens(vocab, pad_id, prompt_len + 3 * g, gen)
        rewards = torch.randint(0, 2, (n,), generator=gen).float()
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for advantage in advantages:
            r_len = int(torch.randint(1, max_response + 1, (1,), generator=gen))
            response = (_tokens(vocab, pad_id, r_len, gen) if policy is None
                        else _sampled(policy, prompt, r_len, pad_id, gen))  # fmt: skip
            ids, ones = torch.cat([prompt, response]), torch.ones(r_len, dtype=torch.long)
            rows.append(dict(prompts=prompt, responses=response, input_ids=ids,
                             attention_mask=torch.ones_like(ids), position_ids=torch.arange(len(ids)),
                             response_mask=ones, loss_mask=ones,
                             advantages=torch.full((r_len,), float(advantage))))  # fmt: skip
    data = tu.list_of_dict_to_tensordict(rows)
    tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=4096,
                         temperature=1.0, calculate_entropy=False,
                         global_batch_size=len(rows))  # fmt: skip
    return data


def _tokens(vocab: int, pad_id: int | None, count: int, gen) -> torch.Tensor:
    if pad_id is None:
        return torch.randint(0, vocab, (count,), generator=gen)
    ids = torch.randint(0, vocab - 1, (count,), generator=gen)
    return ids + (ids >= pad_id).long()  # every id but the pad token's


@torch.no_grad()
def _sampled(policy, prompt: torch.Tensor, count: int, pad_id: int | None, gen) -> torch.Tensor:
    """`count` tokens sampled from `policy` after `prompt` at temperature 1 (the rollout's
    tokens: likely ones, as step 1's are), never the pad token."""
    ids = prompt
    for _ in range(count):
        logits_V = policy(ids[None]).logits[0, -1].float()
        if pad_id is not None:
            logits_V[pad_id] = float("-inf")
        ids = torch.cat([ids, torch.multinomial(logits_V.softmax(-1), 1, generator=gen)])
    return ids[len(prompt) :]


def build(kind: str, hf_dir: Path):
    """verl's FSDP2 engine ("fsdp") or ours ("mcore_ep"), initialized, fp32, aux loss off."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    if kind == "fsdp":
        import recipes.local.cpu.fsdp_engine  # noqa: F401  (verl's FSDP engine for device cpu)

        model = HFModelConfig(path=str(hf_dir), load_tokenizer=False,
                              override_config={"attn_implementation": "sdpa"})  # fmt: skip
        engine_config = FSDPEngineConfig(
            strategy="fsdp2", model_dtype="fp32", use_torch_compile=False,
            mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        )  # fmt: skip
        backend = "fsdp2"
    else:
        import recipes.dapo.engine.verl_engine  # noqa: F401  (registers ours)
        from recipes.dapo.engine.config import McoreEpEngineConfig

        model = HFModelConfig(path=str(hf_dir), load_tokenizer=False)
        engine_config, backend = McoreEpEngineConfig(aux_loss={"mode": "off"}), "mcore_ep"
    engine = EngineRegistry.new(model_type="language_model", backend=backend,
                                model_config=model, engine_config=engine_config,
                                optimizer_config=FSDPOptimizerConfig(**OPTIM),
                                checkpoint_config=CheckpointConfig())  # fmt: skip
    engine.initialize()
    return engine


def step_one(engine, data) -> dict:
    """Old log-probs (the response's), then one update on them: loss and grad norm."""
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import response_from_nested

    from recipes.dapo.engine.config import McoreEpActorConfig

    with engine.eval_mode():
        log_probs = engine.infer_batch(data)["model_output"]["log_probs"]
    old_RT = response_from_nested(log_probs, data["response_mask"])
    data["old_log_probs"] = old_RT
    config = McoreEpActorConfig(rollout_n=1, use_dynamic_bsz=True, loss_agg_mode="token-mean",
                                **DAPO_LOSS)  # fmt: skip
    with engine.train_mode():
        out = engine.train_batch(data, loss_function=partial(ppo_loss, config=config))
    metrics = out["metrics"]
    return {
        "old_log_probs": old_RT.values().detach().clone(),
        "loss": float(sum(out["loss"])),
        "grad_norm": float(metrics["grad_norm"]),
    }


def compare(hf_dir: Path, batch_seed: int = 0) -> dict:
    """Both engines on one batch, one after the other in this process (world size 1)."""
    import os

    import torch.distributed as dist
    from transformers import AutoConfig

    os.environ["VERL_PLATFORM"] = "cpu"  # verl's engines ask it for their device
    import recipes.local.cpu.platform  # noqa: F401  (registers that platform)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    from transformers import AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    policy = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    runs = {}
    for kind in ("fsdp", "mcore_ep"):
        batch = make_batch(config.vocab_size, config.pad_token_id, seed=batch_seed, policy=policy)
        runs[kind] = step_one(build(kind, hf_dir), batch)
    a, b = runs["fsdp"], runs["mcore_ep"]
    return {
        "tokens": int(a["old_log_probs"].numel()),
        "old_log_prob_max_abs_diff": (a["old_log_probs"] - b["old_log_probs"]).abs().max().item(),
        "loss": {"fsdp": a["loss"], "mcore_ep": b["loss"]},
        "loss_abs_diff": abs(a["loss"] - b["loss"]),
        "grad_norm": {"fsdp": a["grad_norm"], "mcore_ep": b["grad_norm"]},
        "grad_norm_rel_diff": abs(a["grad_norm"] - b["grad_norm"]) / max(a["grad_norm"], 1e-12),
    }


if __name__ == "__main__":
    print(MARK + json.dumps(compare(Path(sys.argv[1]))))
