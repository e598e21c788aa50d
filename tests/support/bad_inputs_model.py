"""The local run's `--model DIR` refusals, rows of tests/support/bad_inputs.py: each broken model
directory is one line, exit 2, before Ray starts and before anything is written (the run's
--ckpt-dir, {tmp}/out, stays absent). {hf} has the tiny model's weights; `_user_model` adds
the task's tokenizer (with its chat template) so that only the named part is wrong."""

import json
from pathlib import Path

from tests.support.bad_input_case import Case, Ctx


def _user_model(ctx: Ctx, tokenizer: bool = True, template: bool = True, **config) -> Path:
    """{tmp}/m: the tiny model (+ tokenizer), config.json changed by `config`."""
    from recipes.local.task.doubles import write_tokenizer

    model = ctx.copy(ctx.hf, "m")
    if tokenizer:
        write_tokenizer(model)
    if not template:
        (model / "chat_template.jinja").unlink(missing_ok=True)
        tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
        tokenizer_config.pop("chat_template", None)
        (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if config:
        ctx.edit_json(model / "config.json", **config)
    return model


def _local(model, *flags) -> list:
    return ["--device", "cpu", "--model", model, "--ckpt-dir", "{out}", *flags]


def _argv(ctx: Ctx, model, *flags) -> list:
    return [ctx.tmp / "out" if a == "{out}" else a for a in _local(model, *flags)]


LOCAL_MODEL = [
    Case(
        "launcher",
        "local run: --model DIR without config.json",
        lambda c: _argv(c, c.tmp),
        2,
        "error: --model {tmp} has no config.json: pass the directory of a small HF Qwen3-MoE "
        "with its tokenizer, or --model tiny",
    ),
    Case(
        "launcher",
        "local run: --model DIR of another architecture (model_type llama)",
        lambda c: _argv(c, _user_model(c, model_type="llama")),
        2,
        "error: --model {tmp}/m: config.json's model_type is 'llama', not 'qwen3_moe': the "
        "mcore_ep actor trains Qwen3-MoE models; pass the directory of a small HF Qwen3-MoE "
        "with its tokenizer, or --model tiny",
    ),
    Case(
        "launcher",
        "local run: --model DIR without safetensors weights",
        lambda c: _argv(c, _drop(_user_model(c), "model.safetensors")),
        2,
        "error: --model {tmp}/m has no safetensors weights (model.safetensors or "
        "model.safetensors.index.json and its shards): save the model there with "
        "save_pretrained(safe_serialization=True)",
    ),
    Case(
        "launcher",
        "local run: --model DIR without a tokenizer",
        lambda c: _argv(c, _user_model(c, tokenizer=False)),
        2,
        "error: --model {tmp}/m has no tokenizer (tokenizer.json, tokenizer.model, vocab.json): "
        "save the model's tokenizer there (tokenizer.save_pretrained)",
    ),
    Case(
        "launcher",
        "local run: --model DIR without a chat template (verl's dataloader needs one)",
        lambda c: _argv(c, _user_model(c, template=False)),
        2,
        "error: --model {tmp}/m has no chat template (chat_template.jinja, or chat_template in "
        "tokenizer_config.json), which verl's dataloader applies to every prompt: save one "
        "with the tokenizer (tokenizer.chat_template = ...; save_pretrained)",
    ),
    Case(
        "launcher",
        "local run: --model DIR whose head_dim vLLM's CPU attention cannot serve",
        lambda c: _argv(c, _user_model(c, head_dim=24)),
        2,
        "error: {tmp}/m: head_dim 24 is not a head size vLLM's CPU attention supports (32, 64, "
        "80, 96, 112, 128, 160, 192, 224, 256, 512): give the model one of them",
    ),
    Case(
        "launcher",
        "local run: --tp 3 against --model DIR's 4 kv heads (its config, not the tiny one's)",
        lambda c: _argv(c, _user_model(c, num_key_value_heads=4), "--tp", "3"),
        2,
        "error: tp=3 does not divide num_key_value_heads=4: legal tp for this model: 1, 2, 4",
    ),
    Case(
        "launcher",
        "local run: --model and -- actor_rollout_ref.model.path naming different models",
        lambda c: _argv(c, "tiny", "--", f"actor_rollout_ref.model.path={c.tmp / 'm'}"),
        2,
        "error: --model tiny and -- actor_rollout_ref.model.path={tmp}/m name different models: "
        "pass one (--model takes tiny, mini or a directory)",
    ),
]


def _drop(model: Path, name: str) -> Path:
    (model / name).unlink()
    return model
