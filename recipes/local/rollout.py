"""Rollout with the megatron-core policy itself: n sampled responses per prompt.

Why not transformers or vLLM with synced weights: responses are a few tokens, so one forward
of the prefix per new token (no KV cache) over all prompts x n at once costs a handful of
tiny forwards, the weights are the ones being trained (nothing to sync or convert), and the
TP/EP forward is exercised by generation as well. Every rank runs the same forwards (they
are collective); rank 0's sampled tokens are broadcast so all ranks hold identical rollouts.

Sequences live in a fixed [N, S] buffer: prompt (P tokens, all prompts the same length),
response slots (R), right padding up to a multiple of tp (sequence parallelism splits S).
Causal attention makes the padding invisible to earlier positions.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from backend.distributed import ProcessGroups
from backend.forward import forward_logits


@dataclass(frozen=True)
class Layout:
    prompt_len: int  # P
    response_len: int  # R, the max response length
    seq_len: int  # S >= P + R, a multiple of tp

    @classmethod
    def for_tp(cls, prompt_len: int, response_len: int, tp: int) -> "Layout":
        total = prompt_len + response_len
        return cls(prompt_len, response_len, -(-total // tp) * tp)

    def response_cols(self) -> slice:
        return slice(self.prompt_len, self.prompt_len + self.response_len)

    def log_prob_cols(self) -> slice:
        """Columns of next-token log-probs [N, S-1] that score the response tokens."""
        return slice(self.prompt_len - 1, self.prompt_len - 1 + self.response_len)


def full_vocab_logits(logits_NV: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    """Gather vocab-parallel logits [N, V/tp] into [N, V] on every TP rank."""
    if groups.size("tp") == 1:
        return logits_NV
    parts = [torch.empty_like(logits_NV) for _ in range(groups.size("tp"))]
    dist.all_gather(parts, logits_NV.contiguous(), group=groups.tp)
    return torch.cat(parts, dim=-1)


def gumbel_sample(
    logits_NV: torch.Tensor, temperature: float, gen: torch.Generator
) -> torch.Tensor:
    """A sample of softmax(logits / T) per row; draws a fixed number of uniforms (resumable RNG)."""
    u_NV = torch.rand(logits_NV.shape, generator=gen, dtype=torch.float64).clamp_min(1e-300)
    gumbel_NV = -torch.log(-torch.log(u_NV))
    return (logits_NV.double() / temperature + gumbel_NV).argmax(-1)


def response_lengths(responses_NR: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Tokens up to and including the first EOS, or R when none (truncated)."""
    is_eos_NR = responses_NR == eos_id
    first_N = torch.where(is_eos_NR.any(-1), is_eos_NR.int().argmax(-1), responses_NR.shape[1] - 1)
    return first_N + 1


def _new_tokens(shape, prompt_len: int, t: int, done_N: torch.Tensor) -> torch.Tensor:
    """Positions the t-th decode forward adds: the prompt first, then each live row's last token."""
    new_NS = torch.zeros(shape, dtype=torch.bool)
    if t == 0:
        new_NS[:, :prompt_len] = True
    else:
        new_NS[:, prompt_len + t - 1] = ~done_N
    return new_NS


@torch.no_grad()
def generate(
    model,
    groups: ProcessGroups,
    prompt_ids_BP: torch.Tensor,
    n: int,
    layout: Layout,
    eos_id: int,
    pad_id: int,
    gen: torch.Generator,
    temperature: float = 1.0,
    before_forward: Callable[[torch.Tensor], None] | None = None,
) -> dict:
    """Sample n responses per prompt (rows grouped: prompt i owns rows i*n .. i*n+n-1).

    before_forward(new_tokens_NS) is called before each forward with the positions that
    forward adds (an engine with a KV cache computes each token once): for routing monitors.
    Returns input_ids [N, S], attention_mask [N, S], prompts [N, P], responses [N, R].
    """
    model.eval()
    prompts_NP = prompt_ids_BP.repeat_interleave(n, dim=0)
    num, p = prompts_NP.shape
    ids_NS = torch.full((num, layout.seq_len), pad_id, dtype=torch.long)
    ids_NS[:, :p] = prompts_NP
    done_N = torch.zeros(num, dtype=torch.bool)
    tp = groups.size("tp")  # sequence parallelism splits the sequence: widths are multiples of tp
    for t in range(layout.response_len):
        pos = p + t
        width = min(layout.seq_len, -(-pos // tp) * tp)  # causal: later columns do not matter
        if before_forward is not None:
            before_forward(_new_tokens(ids_NS.shape, p, t, done_N)[:, :width])
        logits_NV = full_vocab_logits(forward_logits(model, ids_NS[:, :width])[:, pos - 1], groups)
        token_N = gumbel_sample(logits_NV, temperature, gen)
        if dist.get_world_size(groups.world) > 1:
            dist.broadcast(token_N, src=0, group=groups.world)
        ids_NS[:, pos] = torch.where(done_N, pad_id, token_N)
        done_N |= token_N == eos_id
        if done_N.all():
            break
    return assemble(prompts_NP, ids_NS[:, layout.response_cols()], layout, eos_id, pad_id)


def assemble(
    prompts_NP: torch.Tensor, responses_NR: torch.Tensor, layout: Layout, eos_id: int, pad_id: int
) -> dict:
    """Rollout tensors as verl names them: input_ids, attention_mask, prompts, responses."""
    num, p = prompts_NP.shape
    lengths_N = response_lengths(responses_NR, eos_id)
    valid_NR = torch.arange(layout.response_len) < lengths_N[:, None]
    ids_NS = torch.full((num, layout.seq_len), pad_id, dtype=torch.long)
    ids_NS[:, :p] = prompts_NP
    ids_NS[:, layout.response_cols()] = torch.where(valid_NR, responses_NR, pad_id)
    mask_NS = torch.zeros_like(ids_NS)
    mask_NS[:, :p] = 1
    mask_NS[:, layout.response_cols()] = valid_NR.long()
    return {
        "input_ids": ids_NS,
        "attention_mask": mask_NS,
        "prompts": prompts_NP,
        "responses": ids_NS[:, layout.response_cols()].clone(),
    }
