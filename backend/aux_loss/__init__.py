"""Router aux losses (load balancing, z-loss) for the actor, explicit and visible.

Our model builder sets megatron-core's own balancing to "none" with coefficient 0, and
verl's engine forces "none" as well; balancing is added here, from `AuxLossConfig`, and
logged every step under `moe/aux_loss/...`. Formulas: losses.py. Lifecycle: hook.py.

Scaling. The step objective is J = sum over layers of coeff * L_l + z_coeff * Z_l, each
L_l and Z_l over every valid token of the optimizer step (N tokens, all micro-batches,
all DP ranks). Each router call adds its share s_c of J (sum_c s_c = J, each share
normalised by the global N or sequence count, never by its micro-batch's). Summed over
micro-batches and DP ranks (backend.grads.sync_grads sums over DP), the gradient is then
dJ/dtheta whatever the micro-batch split, dynamic batch sizes or DP degree: the rule of
the actor's token-mean loss (masked sum / global token count). Under megatron-core's DDP,
which averages over DP, pass grad_scale = DP size, as verl multiplies its loss by
dp_size. Levels:
- micro_batch: J uses sum_mb (n_mb / N) * L_mb, so a micro-batch weighs by its tokens as
  in token-mean (megatron-core weighs micro-batches equally, which with dynamic batch
  sizes lets a short micro-batch count as much as a long one). L_mb itself depends on
  the split, by definition.
- sequence: the mean over all the step's sequences of the per-sequence loss (needs one
  sequence per row, i.e. padded [B, S] micro-batches, not packed THD).
- global_batch (how Qwen3 was trained): f_i counts every routed token of the step, so it
  is known only after all micro-batches. Chosen: an exact counting pass, a no-grad
  forward of the step's micro-batches under `hook.counting()` before the training
  forwards; it costs one extra forward per optimizer step (about +1/3 of the update's
  FLOPs, +1/4 with full recompute; rollout dominates a DAPO step). Rejected: a detached
  running f (megatron-core 0.16's "global_aux_loss": micro-batch k uses the counts of
  micro-batches 1..k, so the gradient depends on the split and order, and the first
  micro-batch gets a micro-batch-level f); f from the previous step (other tokens, other
  weights). Option global_counts="old_log_prob" (config.py has the formula): verl's
  old_log_prob forward, which runs anyway, counts under `hook.old_log_prob_counts()`;
  exact when it sees the same tokens with the same weights, i.e. one optimizer step per
  rollout batch (ppo_mini_batch_size == train batch, one epoch); with several mini-batches
  its counts are the whole batch's, stale by the updates in between.
With mode "observe" nothing needs counting: the value is assembled at step end.

megatron-core's machinery, used and not:
- the formulas follow switch_load_balancing_loss_func and z_loss_func (tests compare
  against both), but are re-implemented: 0.12.1's switch function normalises by its own
  call's token count (no global N), 0.16.1 changed the signature, and neither masks
  response-only tokens.
- the gradient carrier is MoEAuxLossAutoScaler's trick (attach.py), not the class
  itself: its backward multiplies by a process-global scale that megatron-core's
  pipeline schedule resets each micro-batch (loss_scale / num_microbatches, times cp in
  0.16, or loss_scale with calculate_per_token_loss), while our shares are already
  globally normalised and must also train the same under a plain backward (tests, HF).
- the router's own load-balancing types: 0.12.1 has "aux_loss" and "seq_aux_loss" only;
  "global_aux_loss" (the running f above) and lists of types exist from 0.16. They
  average micro-batches equally, mask padding only through the router's padding_mask
  (0.16; verl passes none in its padded path) and cannot restrict to response tokens.

Recompute: shares are logged from calls that are not a recompute replay and carry a
gradient when grad is enabled, so each is added exactly once (hook.py). Limits: context
parallelism is refused; with pipeline parallelism and recompute, the tap's token mask
must still be the replayed micro-batch's when its backward runs (true for PP = 1).
Not megatron-core's calculate_per_token_loss regime (finalize divides grads by tokens).
"""

from backend.aux_loss.adapters import hf_aux_loss, mcore_aux_loss
from backend.aux_loss.config import AuxLossConfig, AuxLossConfigError
from backend.aux_loss.hf_tap import HFRouterTap
from backend.aux_loss.hook import AuxLossHook
from backend.aux_loss.metrics import metric_dict

__all__ = [
    "AuxLossConfig",
    "AuxLossConfigError",
    "AuxLossHook",
    "HFRouterTap",
    "hf_aux_loss",
    "mcore_aux_loss",
    "metric_dict",
]
