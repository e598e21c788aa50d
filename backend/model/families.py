"""Model families: one folder per Hugging Face `model_type`, found by its name.

`backend/<model_type>/family.py` defines `FAMILY`, a `ModelFamily`: everything the generic
code (backend.model.build, converters, parallel) needs to know about that model: reading its HF
config into a spec, the megatron-core TransformerConfig fields and layer spec, the weight
mapping objects (backend.model.weight_mappings) and parameter counts. A spec names its family
through its `model_type` class attribute. Adding a model is adding its folder: nothing here lists them.
"""

import importlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).parents[1]  # backend/: one folder per family


class ConfigError(ValueError):
    """The HF config cannot describe a model this backend builds."""


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of the HF model (unpadded vocab unless a vocab is given)."""

    embedding: int
    lm_head: int
    final_norm: int
    attention: int  # one layer: q, k, v, o projections and the q/k norms
    layer_norms: int  # one layer: input and post-attention RMSNorm
    router: int  # one layer
    expert: int  # one expert: gate, up and down projections
    num_layers: int
    num_experts: int
    top_k: int
    attention_replicated: int = 0  # of `attention`: not split over TP (q/k norms)

    @property
    def dense_per_layer(self) -> int:
        return self.attention + self.layer_norms + self.router

    @property
    def total(self) -> int:
        layers = self.num_layers * (self.dense_per_layer + self.num_experts * self.expert)
        return self.embedding + self.lm_head + self.final_norm + layers

    @property
    def active(self) -> int:
        """Parameters one token uses: everything but the experts it is not routed to."""
        return self.total - self.num_layers * (self.num_experts - self.top_k) * self.expert

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding - self.lm_head


@dataclass(frozen=True)
class ModelFamily:
    """One HF model family, as the generic code sees it (the model folder fills it in)."""

    model_type: str  # HF config.json `model_type`, also the folder's name
    name: str  # for messages: "Qwen3-MoE"
    architectures: tuple[str, ...]  # HF config.json `architectures` (transformers classes)
    spec_from_config: Callable[[dict], Any]  # validated spec from a config.json dict
    # megatron-core: TransformerConfig fields and GPTModel arguments the model decides, and
    # its layer spec (spec, backend.model.build.BuildOptions, ProcessGroups) -> ModuleSpec
    transformer_config_kwargs: Callable[[Any], dict]
    gpt_model_kwargs: Callable[[Any], dict]
    layer_spec: Callable[..., Any]
    # weights: backend.model.weight_mappings objects (one per mcore tensor, `{layer}`/`{expert}`
    # templated, HF hub layout), HF keys to ignore, and the in-memory <-> hub HF layouts
    # (identity if one)
    mappings: tuple
    hf_ignored: re.Pattern
    unfuse_hf: Callable[[Mapping], dict]
    fuse_hf: Callable[[Mapping], dict]
    has_fused_hf: Callable[[Mapping], bool]
    # (spec, vocab or None) -> ParamCounts; built transformers model -> (total, active)
    param_counts: Callable[[Any, int | None], ParamCounts]
    hf_param_counts: Callable[[Any], tuple[int, int]]
    # (spec, fused) -> {HF tensor name: shape} the config implies (hub or fused layout)
    hf_shapes: Callable[..., dict[str, tuple[int, ...]]]

    def load_spec(self, source: Any) -> Any:
        return self.spec_from_config(read_config(source))


def read_config(source: Any) -> dict:
    """config.json as a dict, from a dict, an HF config object, a config.json path or a checkpoint dir."""
    if isinstance(source, dict):
        return dict(source)
    if hasattr(source, "to_dict"):
        return source.to_dict()
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"no config.json at {path}: pass an HF checkpoint directory or its config.json"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{path} is not valid JSON ({err}): re-download or re-export the config"
        ) from err


def model_types() -> tuple[str, ...]:
    """The model_types with a model folder (backend/<model_type>/family.py)."""
    return tuple(sorted(p.parent.name for p in _ROOT.glob("*/family.py")))


@cache
def family(model_type: Any) -> ModelFamily:
    """The family of an HF model_type; ConfigError naming the supported ones if none."""
    known = model_types()
    if model_type not in known:
        names = " / ".join(family(t).name for t in known)
        expected = " or ".join(map(repr, known))
        raise ConfigError(
            f"model_type is {model_type!r}, expected {expected}: "
            f"this backend builds {names} models only"
        )
    found = importlib.import_module(f"backend.{model_type}.family").FAMILY
    assert isinstance(found, ModelFamily) and found.model_type == model_type, model_type
    return found


def family_of(spec: Any) -> ModelFamily:
    """The family a spec belongs to (its class's `model_type`)."""
    return family(spec.model_type)


def load_spec(source: Any) -> Any:
    """Validated spec of whatever supported model the config describes (see read_config)."""
    cfg = read_config(source)
    return family(cfg.get("model_type")).spec_from_config(cfg)
