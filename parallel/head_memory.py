"""Memory of the log-prob head on the last pipeline stage: full logits vs the lean head.

Per device: t = T/cp tokens of a micro-batch, v = padded_vocab/tp, h hidden size, b bytes
per activation (bf16: 2). Bytes per token per vocab entry v of this rank:

Full logits (recipes.dapo.engine.logprobs.full_head_outputs, bf16 logits, temperature 1):
  log-prob pass (no grad, entropy on, as the old-log-prob pass runs): the bf16 logits (2)
      + entropy's fp32 copy (4) + logits - max (4) + its exp (4), then exp * logits (4)
      once the difference is freed: FULL_PASS_BYTES = 14
      (temperature != 1 swaps the bf16 logits for an fp32 scaled copy: 4 + 4 + 4 = 12)
  update (with grad): bf16 logits, the fp32 copy and the fp32 softmax kept for backward:
      FULL_UPDATE_BYTES = 10
  fp32 activations (b = 4, the CPU runs): the logits are their own fp32 copy, 2 bytes less in
      both (12 and 8)
Lean head (backend.model.lean_head: the output projection fused, chunks of c tokens with
c * v * 4 = CHUNK_BYTES, c <= t): no [t, v] tensor; per chunk the bf16 matmul output is cast
to fp32 z, then exp(z) beside it, in both passes (backward recomputes z, then p = exp(z - lse)
and the gradient in place): 8 bytes per token of the chunk, 2 * CHUNK_BYTES. Besides:
  log-prob pass: the hidden states gathered over sequence parallelism, t * h * b
  update: those saved for backward and their gradient, 2 * t * h * b, and the fp32 output
      weight gradient accumulated over the chunks, 4 * v * h
Both paths also keep the output layer's inputs on this rank's sequence slice (head_inputs).
"""

FULL_PASS_BYTES = 14
FULL_UPDATE_BYTES = 10
BF16_LOGITS_BYTES = 2  # in both: absent when the logits are fp32 themselves
CHUNK_BYTES = 256 * 2**20  # backend.model.lean_head.CHUNK_BYTES (tests check they agree)
LEAN_CHUNK_BUFFERS = 2


def chunk_buffer_bytes(tokens: float, vocab_local: float, chunk_bytes: int = CHUNK_BYTES) -> float:
    """The lean head's live chunk buffers: 2 fp32 [c, v], c = min(tokens, chunk_bytes / 4v)."""
    chunk = max(1, chunk_bytes // (4 * int(vocab_local)))
    return LEAN_CHUNK_BUFFERS * 4 * min(tokens, chunk) * vocab_local


def head_bytes(
    tokens: float,
    vocab_local: float,
    hidden: int,
    act_bytes: int,
    lean: bool,
    grad: bool,
    chunk_bytes: int = CHUNK_BYTES,
) -> float:
    """Peak bytes of the head beyond its inputs (module docstring), tokens = T/cp.

    Checked against measured peaks (fp32, scripts/bench/logprob_heads.py --scope head)."""
    if not lean:
        per_value = FULL_UPDATE_BYTES if grad else FULL_PASS_BYTES
        if act_bytes == 4:
            per_value -= BF16_LOGITS_BYTES
        return tokens * vocab_local * per_value
    hidden_copies = 2 if grad else 1
    weight_grad = 4 * vocab_local * hidden if grad else 0.0
    return (
        chunk_buffer_bytes(tokens, vocab_local, chunk_bytes)
        + hidden_copies * tokens * hidden * act_bytes
        + weight_grad
    )
