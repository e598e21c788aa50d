"""R3 on Ascend A2 (the npu-cann91 set: vllm-ascend 0.23.0.post1, vLLM 0.23.0): what the dry
run says of it, and the rollout settings the launcher refuses with R3 before Ray starts.

vllm-ascend 0.23.0 records the routes in its unquantized MoE method only, before the EPLB
logical-to-physical map (vllm_ascend/ops/fused_moe/fused_moe.py:177-204; the map is applied in
moe_comm_method.py:141-142, 300-301), through vLLM's capturer patched for its token layouts
(vllm_ascend/patch/worker/patch_routed_experts_capture.py:35-188). A route it did not record
stays 0 (the buffer is zeroed every step, model_runner_v1.py:1955-1957) and R3 would replay
expert 0: such settings are refused, in one line naming the upstream source and the fix.

- quantized MoE (a ModelSlim W8A8 model, `rollout.quantization`, QAT): its methods never call
  the capturer (vllm_ascend/quantization/methods/w8a8_dynamic.py:262-287); vllm-ascend picks
  them from the model directory too (quantization/utils.py:96-117).
- EPLB (vLLM's `enable_eplb`, vllm-ascend's `additional_config.eplb_config`): at 0.23.0 the
  capture precedes log2phy, but a later capture path did export physical ids under EPLB
  (vllm-ascend#13882, merged after 0.23) and vllm-ascend's R3 test never runs EPLB: refused
  until an A2 run shows the routes agree.
- rollout expert parallelism at DP 1 with TP > 1: the patched capture takes the whole batch
  when DP is 1, while the MC2 / all-to-all dispatch split the tokens over the TP ranks, so
  one TP shard is recorded and the rest stays 0 (vllm-ascend#15451, open; the multi-DP/TP
  fixes #8651 / #9016 are open PRs). On A2 vllm-ascend picks MC2 only for an EP group of
  16 or more (ascend_forward_context.py:240-252; all-gather otherwise, which keeps every
  token), but the issue is open and untested here: refused at any TP > 1.

Our rollout (recipes.dapo.job.overrides.rollout: TP 2, DP 1, no expert parallelism, bf16) takes
vllm-ascend's all-gather path (ascend_forward_context.py:341-342: no EP -> ALLGATHER), which
routes every token on every TP rank: it is clear of all three and is left as it is.
"""

import re
from pathlib import Path

from recipes.dapo.errors import LaunchError

R = "actor_rollout_ref.rollout"
VLLM_KWARGS = f"{R}.engine_kwargs.vllm."
ISSUE_TP_SHARD = "vllm-ascend#15451"
# the dry run's "R3 with the npu-cann91 set:" line
A2_R3 = (
    "available: vllm-ascend 0.23.0.post1 (vLLM 0.23.0) returns routed_experts (uint8 "
    "[prompt + response - 1, layers, top-k], logical expert ids), kept uint8 through verl's "
    "agent loop (ours) to the routers; not run on A2 here (no NPU; vllm-ascend's own R3 test "
    "runs on A3 only); refused "
    "with R3: quantized MoE (records nothing), EPLB, rollout expert parallelism at DP 1 with "
    f"TP > 1 ({ISSUE_TP_SHARD}); the default rollout (TP 2, no EP) has none of them"
)
_TRUE = r"['\"]?\s*[:=]\s*['\"]?(?:true|1)\b"
EPLB = re.compile(
    rf"(?:enable_eplb|dynamic_eplb){_TRUE}"
    r"|expert_map(?:_record)?_path['\"]?\s*[:=]\s*['\"]?(?!null\b|none\b)[^\s,}'\"]"
    r"|num_redundant_experts['\"]?\s*[:=]\s*['\"]?[1-9]",
    re.IGNORECASE,
)


def _set(value) -> bool:
    return value is not None and str(value).strip().lower() not in ("", "null", "none", "false")


def _int(value, default: int = 1) -> int:
    try:
        return int(str(value).strip().strip("'\""))
    except ValueError:
        return default


def refusal(groups: dict[str, dict]) -> str | None:
    """The first rollout setting vllm-ascend 0.23 cannot record R3's routes under, as one line
    naming it, the upstream source and the fix; None when there is none."""
    from recipes.dapo.job.overrides import key_of, value_of

    items = {key_of(k): v for kv in groups.values() for k, v in kv.items()}
    vllm = {k.removeprefix(VLLM_KWARGS): v for k, v in items.items() if k.startswith(VLLM_KWARGS)}
    of = lambda key: value_of(groups, key)  # noqa: E731
    head = "router_replay=R3 on npu (vllm-ascend 0.23)"
    quant = [f"{R}.quantization={of(f'{R}.quantization')}"] if _set(of(f"{R}.quantization")) else []
    quant += [f"{VLLM_KWARGS}quantization"] if _set(vllm.get("quantization")) else []
    quant += [f"{R}.qat.enable"] if str(of(f"{R}.qat.enable")).lower() == "true" else []
    model = of("actor_rollout_ref.model.path")
    if model and (Path(str(model)).expanduser() / "quant_model_description.json").is_file():
        quant.append(f"{model} (a ModelSlim quantized model: quant_model_description.json)")
    if quant:
        return (
            f"{head} with a quantized MoE ({quant[0]}): vllm-ascend records routes only in its "
            "unquantized MoE (vllm_ascend/ops/fused_moe/fused_moe.py:204), the rest would replay "
            "as expert 0: roll out the bf16 model, or use router_replay=R2"
        )
    eplb = next((f"{k}={v}" for k, v in vllm.items() if EPLB.search(f"{k}={v}")), None)
    if eplb:
        return (
            f"{head} with EPLB on ({VLLM_KWARGS}{eplb}): routes under EPLB are unverified "
            "(vllm-ascend#13882 fixed physical ids leaking into them after 0.23): drop the EPLB "
            "setting, or use router_replay=R2"
        )
    ep = _int(of(f"{R}.expert_parallel_size")) > 1 or str(
        vllm.get("enable_expert_parallel")
    ).lower() in ("true", "1")
    dp = _int(vllm.get("data_parallel_size", of(f"{R}.data_parallel_size")))
    tp = _int(vllm.get("tensor_parallel_size", of(f"{R}.tensor_model_parallel_size")))
    if ep and dp == 1 and tp > 1:
        return (
            f"{head} with rollout expert parallelism at DP 1 and TP {tp}: vllm-ascend records "
            f"one TP rank's share of the tokens ({ISSUE_TP_SHARD}), the rest would replay as "
            f"expert 0: drop it ({R}.expert_parallel_size=1, as the default rollout), or use "
            "router_replay=R2"
        )
    return None


def check_r3_rollout(device: str, groups: dict[str, dict]) -> None:
    """LaunchError (exit 2, before Ray) for R3 on npu with a rollout vllm-ascend cannot record."""
    from recipes.dapo import BACKEND
    from recipes.dapo.job.overrides import ACTOR, value_of

    if device != "npu" or str(value_of(groups, f"{ACTOR}.{BACKEND}.router_replay")) != "R3":
        return
    found = refusal(groups)
    if found:
        raise LaunchError(found)
