"""The local run's `--model DIR` refusals, rows of tests/support/bad_inputs.py: each broken model
directory is one line, exit 2, before Ray starts and before anything is written (the run's
--ckpt-dir, {tmp}/out, stays absent). {hf} has the tiny model's weights; `_user_model` adds
the task's tokenizer (with its chat template) so that only the named part is wrong. The
weights are read from their headers against config.json (converters.hf_check): a config
edited after the save, a shard missing or truncated, a tensor of another dtype or shape, a
tokenizer longer than the vocabulary."""

import json
from pathlib import Path

from tests.support import model_dirs
from tests.support.bad_input_case import Case, Ctx

SIZES = "num_hidden_layers {layers}, hidden_size {hidden}, num_experts {experts}, "
SIZES += "moe_intermediate_size 32, vocab_size 128"
FIX = "does config.json match the weights? save both with save_pretrained"


def _user_model(ctx: Ctx, tokenizer: bool = True, template: bool = True, built=None,
                **config) -> Path:  # fmt: skip
    """{tmp}/m: the tiny model (+ tokenizer), config.json changed by `config`; `built`: a
    model built with those config changes instead (its weights match its config)."""
    from recipes.local.task.doubles import write_tokenizer

    model = model_dirs.built(ctx.tmp / "m", built) if built else ctx.copy(ctx.hf, "m")
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
        lambda c: _argv(c, _user_model(c, built={"head_dim": 24})),
        2,
        "error: {tmp}/m: head_dim 24 is not a head size vLLM's CPU attention supports (32, 64, "
        "80, 96, 112, 128, 160, 192, 224, 256, 512): give the model one of them",
    ),
    Case(
        "launcher",
        "local run: --tp 3 against --model DIR's 4 kv heads (its config, not the tiny one's)",
        lambda c: _argv(c, _user_model(c, built={"num_key_value_heads": 4}), "--tp", "3"),
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

BROKEN_MODEL_DIR = [
    Case(
        "launcher",
        "local run: --model DIR whose config.json says 12 experts, its weights 8",
        lambda c: _argv(c, _user_model(c, num_experts=12)),
        2,
        "error: --model {tmp}/m: config.json implies model.layers.0.mlp.experts.8.gate_proj.weight "
        "(and 23 more), which no shard holds ("
        + SIZES.format(layers=2, hidden=64, experts=12)
        + f"): {FIX}",
    ),
    Case(
        "launcher",
        "local run: --model DIR whose config.json says hidden_size 96, its weights 64",
        lambda c: _argv(c, _user_model(c, hidden_size=96)),
        2,
        "error: --model {tmp}/m: model.safetensors: model.embed_tokens.weight (and 64 more "
        "tensors) is [128, 64] where config.json implies [128, 96] ("
        + SIZES.format(layers=2, hidden=96, experts=8)
        + f"): {FIX}",
    ),
    Case(
        "launcher",
        "local run: --model DIR whose config.json says 1 layer, its weights 2",
        lambda c: _argv(c, _user_model(c, num_hidden_layers=1)),
        2,
        "error: --model {tmp}/m: model.safetensors holds model.layers.1.input_layernorm.weight "
        "(and 32 more), which config.json does not imply ("
        + SIZES.format(layers=1, hidden=64, experts=8)
        + f"): {FIX}",
    ),
    Case(
        "launcher",
        "local run: --model DIR with a shard the index does not name",
        lambda c: _argv(c, _unindexed(model_dirs.shard(_user_model(c)))),
        2,
        "error: --model {tmp}/m: model-00002-of-00002.safetensors is not in "
        "model.safetensors.index.json, so no loader reads it: re-save the checkpoint "
        "(save_pretrained writes both) or restore the index",
    ),
    Case(
        "launcher",
        "local run: --model DIR whose index names a shard that is not there",
        lambda c: _argv(
            c, _drop(model_dirs.shard(_user_model(c)), "model-00001-of-00002.safetensors")
        ),
        2,
        "error: --model {tmp}/m: model.safetensors.index.json names missing shard(s) "
        "model-00001-of-00002.safetensors: re-download them into {tmp}/m",
    ),
    Case(
        "launcher",
        "local run: --model DIR with a truncated shard",
        lambda c: _argv(c, _truncated(_user_model(c))),
        2,
        "error: --model {tmp}/m: model.safetensors is unreadable or truncated ({reason}): "
        "re-download it",
    ),
    Case(
        "launcher",
        "local run: --model DIR with a tensor saved in float16 among float32",
        lambda c: _argv(c, model_dirs.resave(_user_model(c), _half("model.norm.weight"))),
        2,
        "error: --model {tmp}/m: model.safetensors: model.norm.weight is float16, not float32 "
        "(config.json's dtype): save every weight in float32",
    ),
    Case(
        "launcher",
        "local run: --model DIR with a tensor of another shape",
        lambda c: _argv(
            c, model_dirs.resave(_user_model(c), _cut("model.layers.1.mlp.gate.weight"))
        ),
        2,
        "error: --model {tmp}/m: model.safetensors: model.layers.1.mlp.gate.weight is [7, 64] "
        "where config.json implies [8, 64] ("
        + SIZES.format(layers=2, hidden=64, experts=8)
        + f"): {FIX}",
    ),
    Case(
        "launcher",
        "local run: --model DIR whose tokenizer is longer than the vocabulary",
        lambda c: _argv(c, model_dirs.longer_tokenizer(_user_model(c, built={"vocab_size": 32}))),
        2,
        "error: --model {tmp}/m: the tokenizer has 33 tokens, more than the 32 embedding rows "
        "(config.json's vocab_size): ids past 31 have no embedding; save the model's own "
        "tokenizer with it",
    ),
    Case(
        "launcher",
        "local run: --model DIR whose config.json's eos_token_id lies outside the vocabulary",
        lambda c: _argv(c, _user_model(c, eos_token_id=128)),
        2,
        "error: --model {tmp}/m: config.json's eos_token_id 128 lies outside the vocabulary "
        "(vocab_size 128): set it to the tokenizer's own id",
    ),
]


def _unindexed(model: Path) -> Path:
    """The index without the second shard's tensors (the shard itself left in place)."""
    index = model / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"] = {
        k: v for k, v in data["weight_map"].items() if not v.startswith("model-00002")
    }
    index.write_text(json.dumps(data))
    return model


def _truncated(model: Path) -> Path:
    path = model / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 64)
    return model


def _half(name: str):
    def change(tensors):
        tensors[name] = tensors[name].half()

    return change


def _cut(name: str):
    def change(tensors):
        tensors[name] = tensors[name][:-1].contiguous()

    return change


def _drop(model: Path, name: str) -> Path:
    (model / name).unlink()
    return model
