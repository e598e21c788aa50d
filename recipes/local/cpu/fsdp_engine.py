"""verl's FSDP engine on the CPU platform: `--engine fsdp` on the embedded run.

verl 0.9.1 registers its FSDP engine (`FSDPEngineWithLMHead`, backends fsdp and fsdp2) for
devices cuda and npu only, and `EngineRegistry.get_engine_cls` looks it up by the platform's
device name. Importing this module registers the same class for "cpu" through verl's own
`EngineRegistry.register`; the launcher names it in `actor_rollout_ref.model.external_lib`,
which verl imports in every worker before it builds the engine. Nothing of verl's is replaced,
and no other engine lookup changes (verl's VERL_ENGINE_DEVICE would change every one).
"""

from verl.workers.engine import EngineRegistry, FSDPEngineWithLMHead

from recipes.local.cpu.platform import NAME

EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device=NAME)(
    FSDPEngineWithLMHead
)
