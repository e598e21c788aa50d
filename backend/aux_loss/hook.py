"""AuxLossHook: router aux losses over one optimizer step, attached per router call.

Lifecycle per optimizer step (see the package docstring for the scaling):

    masks = [hook.valid_tokens(mb.attention_mask, mb.response_mask) for mb in micro_batches]
    hook.start_step(masks)                       # N, sequence count: summed over DP
    if hook.config.needs_counting_pass:          # global_batch, mode on
        with hook.counting():                    # no-grad forwards: routing counts only
            for mb, m in zip(micro_batches, masks): hook.set_tokens(m); forward(mb)
    for mb, m in zip(micro_batches, masks):
        hook.set_tokens(m)                       # keep it until this micro-batch's backward
        loss(mb).backward()                      # aux gradient rides on the router outputs
    metrics = hook.end_step()                    # flat `moe/aux_loss/...` dict

With global_counts="old_log_prob" the counts come instead from a forward that runs anyway,
before the trainer step's first start_step, and serve all its optimizer steps:

    with hook.old_log_prob_counts(): for mb, m in ...: hook.set_tokens(m); forward(mb)
    ... optimizer steps as above, without the counting pass ...
    hook.drop_old_log_prob_counts()              # after the trainer step's last update

Each router call's listener computes this call's share of the step loss; a forward hook
on the same router (registered after the tap's, so it runs right after) attaches it.
Calls are logged when they are not a recompute replay, and carry a gradient when grad is
enabled: with megatron-core's reentrant recompute the first forward runs without grad
(logged) and the replay inside backward attaches; with non-reentrant checkpointing the
first forward does both and the replay's graph is discarded. Either way once each.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

import backend.aux_loss.losses as losses
from backend.aux_loss.attach import RouterSite, with_aux_grad
from backend.aux_loss.config import AuxLossConfig
from backend.aux_loss.metrics import metric_dict
from backend.instruments.router_tap import RouterCall
from backend.training.distributed import ProcessGroups

IDLE, STEP, COUNTING, OLD_LOG_PROB = "idle", "step", "counting", "old_log_prob"


class AuxLossHook:
    def __init__(
        self,
        tap,
        sites: Sequence[RouterSite],
        config: AuxLossConfig,
        groups: ProcessGroups | None,
        *,
        num_experts: int,
        top_k: int,
        num_layers: int,
        layout: str,
        sequence_parallel: bool = False,
        grad_scale: float = 1.0,
    ):
        """`tap`: RouterTap (megatron-core) or HFRouterTap, built before this hook.

        layout: token order of router calls, "sb" (megatron-core) or "bs" (transformers).
        grad_scale: multiplies the attached gradient. 1 (default) where DP ranks sum
        gradients of globally normalised losses, as tests/support/reference_actor.py does; the DP
        size under megatron-core's DDP, which averages over DP (verl's engine multiplies its
        token-mean loss by dp_size for the same reason); times the loss scale in fp16.
        """
        _check_parallel(groups, sequence_parallel)
        self.tap, self.config, self.groups = tap, config, groups
        self.num_experts, self.top_k, self.num_layers, self.layout = (
            num_experts,
            top_k,
            num_layers,
            layout,
        )
        self._tp_slices = sequence_parallel and groups is not None and groups.size("tp") > 1
        self.grad_scale = float(grad_scale)
        self._phase, self._pending, self._handles = IDLE, {}, []
        self._valid_BS: torch.Tensor | None = None
        self.step_counts: tuple[torch.Tensor, torch.Tensor] | None = None  # ([L, E], [L])
        self._device = next(sites[0].module.parameters()).device  # the routers' device
        if config.active:
            tap.add_listener(self._on_call)
            self._handles = [s.module.register_forward_hook(self._attacher(s)) for s in sites]

    # ---- caller API ------------------------------------------------------------------

    def valid_tokens(self, attention_mask_BS, response_mask_BS=None) -> torch.Tensor:
        """The [B, S] bool mask of tokens that count under config.scope.

        A response mask narrower than S is verl's [B, R] over the last R positions.
        """
        valid_BS = attention_mask_BS.bool()
        if self.config.scope == "all":
            return valid_BS
        if response_mask_BS is None:
            raise ValueError(
                "aux_loss.scope='response' needs the response mask: pass response_mask_BS"
            )
        prompt_len = valid_BS.shape[-1] - response_mask_BS.shape[-1]
        if prompt_len < 0:
            raise ValueError(
                f"response mask is longer ({response_mask_BS.shape[-1]}) than the "
                f"sequence ({valid_BS.shape[-1]}): pass masks of the same micro-batch"
            )
        return valid_BS & torch.nn.functional.pad(response_mask_BS.bool(), (prompt_len, 0))

    def set_tokens(self, valid_BS: torch.Tensor) -> None:
        """Mask of the next micro-batch; also the tap's, so monitors count the same tokens."""
        self._valid_BS = valid_BS.to(self._device, torch.bool)
        self.tap.set_token_mask(self._valid_BS)

    def start_step(self, valid_masks_BS: Sequence[torch.Tensor]) -> None:
        """Begin a step whose micro-batches on this rank have these masks (summed over DP)."""
        if self._phase != IDLE:
            raise RuntimeError("start_step called inside a step: call end_step after each step")
        if not self.config.active:
            return
        local = torch.zeros(2, dtype=torch.int64, device=self._device)
        for valid_BS in valid_masks_BS:
            valid_BS = valid_BS.to(self._device, torch.bool)
            local += torch.stack((valid_BS.sum(), valid_BS.any(-1).sum()))
        self._all_reduce(local, "dp")
        self._num_tokens, self._num_seqs = local.tolist()
        if self._num_tokens == 0:
            raise ValueError(
                "no valid token in this step's masks: check scope and masks, or skip the step"
            )
        self._reset(self._device)
        if self.config.counts_from_old_log_prob and self.step_counts is not None:
            self._count_LE, self._count_tokens_L = (c.clone() for c in self.step_counts)
            self._have_counts = True
        self._phase = STEP

    @contextmanager
    def counting(self) -> Iterator[None]:
        """Forwards inside only count routing (no grad); counts are summed over ranks at exit."""
        if self._phase != STEP:
            raise RuntimeError("hook.counting() outside a step: call start_step first")
        self._phase = COUNTING
        try:
            with torch.no_grad():
                yield
        finally:
            self._phase = STEP
        self._all_reduce(self._count_LE, "world")
        self._all_reduce(self._count_tokens_L, "world")
        self._have_counts = True

    @contextmanager
    def old_log_prob_counts(self) -> Iterator[None]:
        """Forwards inside (the old-log-prob pass) count routing for the next optimizer steps'
        global_batch f: C_i and N summed over the pass's micro-batches and all ranks, kept in
        `step_counts` until drop_old_log_prob_counts()."""
        if self._phase != IDLE:
            raise RuntimeError("old_log_prob_counts() inside a step: use it before start_step")
        L, E = self.num_layers, self.num_experts
        self._count_LE = torch.zeros(L, E, dtype=torch.int64, device=self._device)
        self._count_tokens_L = torch.zeros(L, dtype=torch.int64, device=self._device)
        self._phase, self.step_counts = OLD_LOG_PROB, None
        try:
            yield
        finally:
            self._phase = IDLE
        self._all_reduce(self._count_LE, "world")
        self._all_reduce(self._count_tokens_L, "world")
        self.step_counts = (self._count_LE, self._count_tokens_L)

    def drop_old_log_prob_counts(self) -> None:
        """Forget the old-log-prob counts (their trainer step is over)."""
        self.step_counts = None

    def end_step(self) -> dict[str, float]:
        """Reduce the step's values over ranks; return the flat `moe/aux_loss/...` metrics."""
        if not self.config.active:
            self.tap.set_token_mask(None)
            return {}
        if self._phase != STEP:
            raise RuntimeError(f"end_step in phase {self._phase!r}: call start_step first")
        self._phase, self._valid_BS = IDLE, None
        self.tap.set_token_mask(None)  # a stale micro-batch mask would not fit the next pass
        if self._pending:
            raise RuntimeError(
                f"aux loss of layers {sorted(self._pending)} was computed but never attached"
            )
        stats = (self._tokens_L, self._share_L, self._z_L, self._routed_LE, self._psum_LE)
        for stat in (*stats, self._carried):
            self._all_reduce(stat, "world")
        self._check_tokens()
        carried, calls = self._carried.tolist()
        return metric_dict(self.config, self._balance_L(), self._z_L, carried / max(calls, 1))

    def remove(self) -> None:
        self.tap.remove_listener(self._on_call)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ---- per router call -------------------------------------------------------------

    def _on_call(self, call: RouterCall) -> None:
        if self._phase == IDLE:
            return
        if call.valid_T is None or self._valid_BS is None:
            raise ValueError(
                "aux loss needs a token mask: call hook.set_tokens(valid_BS) before each forward"
            )
        if self._phase in (COUNTING, OLD_LOG_PROB):
            self._count_LE[call.layer] += losses.routed_counts_E(call.chosen_map_TE, call.valid_T)
            self._count_tokens_L[call.layer] += call.valid_T.sum()
            return
        attach = (
            self.config.adds_gradient and torch.is_grad_enabled() and call.logits_TE.requires_grad
        )
        log = not call.recompute
        if not (attach or log):
            return
        if call.layer in self._pending:
            raise RuntimeError(
                f"aux loss of layer {call.layer} was never attached: build the tap before the hook"
            )
        with torch.set_grad_enabled(attach):
            term = self._term(call, log)
        if attach:
            self._pending[call.layer] = term

    def _term(self, call: RouterCall, log: bool) -> torch.Tensor:
        cfg, layer = self.config, call.layer
        z_grad = torch.is_grad_enabled() and cfg.z_coeff > 0  # z is logged even at coeff 0
        with torch.set_grad_enabled(z_grad):
            z = losses.z_share(call.logits_TE, self._num_tokens, call.valid_T)
        term = cfg.z_coeff * z if cfg.z_coeff else z.new_zeros(())
        if cfg.type != "none":
            term = term + cfg.coeff * self._balance_share(call, log)
        if log:
            self._z_L[layer] += z.detach()
            self._tokens_L[layer] += call.valid_T.sum()
            self._carried[1] += 1  # a router call whose aux gradient backward must carry
        return term

    def _balance_share(self, call: RouterCall, log: bool) -> torch.Tensor:
        logits_TE, map_TE, valid_T = call.logits_TE, call.chosen_map_TE, call.valid_T
        layer = call.layer
        if self.config.type == "global_batch":
            if log:  # the value is computed at step end from whole-step counts and sums
                self._routed_LE[layer] += losses.routed_counts_E(map_TE, valid_T)
                self._psum_LE[layer] += losses.prob_sums_E(logits_TE.detach(), valid_T)
            if not torch.is_grad_enabled():
                return logits_TE.new_zeros(())
            return losses.balance_share(
                logits_TE, self._global_f_E(layer), self._num_tokens, valid_T
            )
        if self.config.type == "micro_batch":
            stats = torch.cat((losses.routed_counts_E(map_TE, valid_T), valid_T.sum()[None]))
            self._all_reduce(stats, "tp")  # the micro-batch's other sequence-parallel slices
            f_E = losses.expert_fractions_E(stats[:-1], stats[-1], self.top_k)
            share = losses.balance_share(logits_TE, f_E, self._num_tokens, valid_T)
        else:
            seq_T = self._seq_index_T(logits_TE.shape[0], logits_TE.device)
            counts_BE, tokens_B = losses.sequence_stats(
                map_TE, seq_T, self._valid_BS.shape[0], valid_T
            )
            stats = torch.cat((counts_BE, tokens_B[:, None]), dim=1)
            self._all_reduce(stats, "tp")
            share = losses.sequence_share(
                logits_TE, seq_T, stats[:, :-1], stats[:, -1], self._num_seqs, self.top_k, valid_T
            )
        if log:
            self._share_L[layer] += share.detach()
        return share

    def _attacher(self, site: RouterSite):
        def hook(module, args, output):
            term = self._pending.pop(site.layer, None)
            if term is None:
                return None
            carried = self._carried[0]  # the backward adds the scale it sends
            return with_aux_grad(output, site.output_index, term, self.grad_scale, carried)

        return hook

    # ---- helpers ---------------------------------------------------------------------

    def _reset(self, device) -> None:
        L, E = self.num_layers, self.num_experts
        self._tokens_L = torch.zeros(L, dtype=torch.int64, device=device)
        self._share_L = torch.zeros(L, dtype=torch.float64, device=device)
        self._z_L = torch.zeros(L, dtype=torch.float64, device=device)
        self._routed_LE = torch.zeros(L, E, dtype=torch.int64, device=device)
        self._psum_LE = torch.zeros(L, E, dtype=torch.float64, device=device)
        self._count_LE = torch.zeros(L, E, dtype=torch.int64, device=device)
        self._count_tokens_L = torch.zeros(L, dtype=torch.int64, device=device)
        # [scale the backward passes carried to the aux terms, router calls that owe one]
        self._carried = torch.zeros(2, dtype=torch.float64, device=device)
        self._have_counts = False
        self._pending.clear()

    def _global_f_E(self, layer: int) -> torch.Tensor:
        if not self._have_counts and self.config.counts_from_old_log_prob:
            raise RuntimeError(
                "global_batch aux loss with global_counts='old_log_prob' needs this trainer "
                "step's old-log-prob pass counted under `hook.old_log_prob_counts()` before the "
                "update: is the old-log-prob pass skipped? Use global_counts='counting_pass'"
            )
        if not self._have_counts:
            raise RuntimeError(
                "global_batch aux loss needs the step's routing counts: run the "
                "micro-batches once inside `with hook.counting():` before training"
            )
        return losses.expert_fractions_E(
            self._count_LE[layer], self._count_tokens_L[layer], self.top_k
        )

    def _seq_index_T(self, num_tokens: int, device) -> torch.Tensor:
        batch = self._valid_BS.shape[0]
        index_T = torch.arange(num_tokens, device=device)
        return index_T % batch if self.layout == "sb" else index_T // (num_tokens // batch)

    def _balance_L(self) -> torch.Tensor:
        if self.config.type != "global_batch":
            return self._share_L
        n = float(self._num_tokens)
        scale = self.num_experts / (self.top_k * n * n)
        return scale * (self._routed_LE.to(torch.float64) * self._psum_LE).sum(-1)

    def _check_tokens(self) -> None:
        wrong = (self._tokens_L != self._num_tokens).nonzero().flatten().tolist()
        if wrong:
            layer = wrong[0]
            raise ValueError(
                f"aux loss: layer {layer} saw {int(self._tokens_L[layer])} valid tokens this step, "
                f"start_step declared {self._num_tokens}: pass start_step the masks of exactly the "
                "micro-batches fed, each forward once outside hook.counting()"
            )

    def _all_reduce(self, tensor: torch.Tensor, name: str) -> None:
        if self.groups is None or (name == "tp" and not self._tp_slices):
            return
        group = getattr(self.groups, name)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(tensor, group=group)


def _check_parallel(groups: ProcessGroups | None, sequence_parallel: bool) -> None:
    if groups is None:
        return
    if groups.size("cp") > 1:
        raise ValueError(
            "the aux-loss hook does not split token masks over context parallelism: use cp=1"
        )
    if groups.size("tp") > 1 and not sequence_parallel:
        raise ValueError(
            "the aux-loss hook needs sequence parallelism with tp > 1 (each router "
            "then sees its own tokens): build the model with sequence_parallel"
        )
