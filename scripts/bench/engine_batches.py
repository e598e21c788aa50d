"""verl-style batches of random sequences for the engine benchmarks (aux-loss and replay cost)."""

import torch


def random_batch(seqs: int, prompt: int, response: int, max_tokens: int, vocab: int = 128):
    """A TensorDict of `seqs` random rows (prompt + response tokens, every response token in
    the loss), with dynamic batch size at `max_tokens` per micro-batch, as verl's actor sends."""
    from verl.utils import tensordict_utils as tu

    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(seqs):
        ids = torch.randint(0, vocab, (prompt + response,), generator=gen)
        ones = torch.ones(response, dtype=torch.long)
        rows.append(dict(prompts=ids[:prompt], responses=ids[prompt:], input_ids=ids,
                         response_mask=ones, loss_mask=ones))  # fmt: skip
    data = tu.list_of_dict_to_tensordict(rows)
    tu.assign_non_tensor(data, use_dynamic_bsz=True, temperature=1.0,
                         max_token_len_per_gpu=max_tokens)  # fmt: skip
    return data


def build_engine(hf_dir, lr: float = 1e-5, **engine_config):
    """The mcore_ep engine through verl's EngineRegistry (world 1: init_parallel first)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    import recipes.dapo.engine.verl_engine  # noqa: F401  (registers the backend)
    from recipes.dapo.engine.config import McoreEpEngineConfig

    engine = EngineRegistry.new(
        model_type="language_model",
        backend="mcore_ep",
        model_config=HFModelConfig(path=str(hf_dir), load_tokenizer=False),
        engine_config=McoreEpEngineConfig(**engine_config),
        optimizer_config=FSDPOptimizerConfig(lr=lr),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine
