"""One rank of the local DAPO run: set up, loop over steps, checkpoint, finish (export, report)."""

import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from recipes.local import checkpoint
from recipes.local.summary import print_summary, write_summary

TINY_SHAPE = dict(vocab_size=16)  # the task's character vocabulary; the rest is tiny_model's


def run(args, settings: dict, t0: float) -> int:
    from backend.device import prepare_device

    device = prepare_device("cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    from backend.distributed import destroy_parallel, init_parallel

    created = not dist.is_initialized()
    groups = init_parallel(device, tp=args.tp, ep=args.ep, seed=args.seed)
    try:
        return Run(args, settings, groups, t0).loop()
    finally:
        if created:
            destroy_parallel()


def _tiny_checkpoint(out: Path, seed: int, groups) -> Path:
    """The initial policy: the tiny Qwen3-MoE written by transformers (rank 0, once)."""
    from recipes.local.tiny_model import make_tiny_checkpoint

    hf_dir = out / "tiny_hf"
    if dist.get_rank(groups.world) == 0 and not (hf_dir / "config.json").is_file():
        shutil.rmtree(hf_dir, ignore_errors=True)
        tmp = make_tiny_checkpoint(out / ".tiny_hf.partial", seed=seed, **TINY_SHAPE)
        os.replace(tmp, hf_dir)
    checkpoint.barrier(groups.world)
    return hf_dir


def _aux_config(args):
    from backend.aux_loss import AuxLossConfig

    if args.aux_loss == "off":
        return AuxLossConfig()
    # Qwen3's balancing: global-batch level; all non-padding tokens count
    return AuxLossConfig(mode=args.aux_loss, type="global_batch", coeff=args.aux_coeff, scope="all")


def step_config(args):
    from recipes.local.trainer import StepConfig

    return StepConfig(n=args.n, train_prompts=args.train_prompts, gen_prompts=args.gen_prompts,
                      max_num_gen_batches=args.max_num_gen_batches, mini_prompts=args.mini_prompts,
                      micro_size=args.micro_size, filter_metric=args.filter_metric)  # fmt: skip


class Run:
    """One rank's run: built from the CLI arguments, then loop() until --steps and finish()."""

    def __init__(self, args, settings: dict, groups, t0: float):
        self.args, self.settings, self.groups, self.t0 = args, settings, groups, t0
        self.is_main = dist.get_rank(groups.world) == 0
        self.out, self.ckpt_root = args.out, args.out / "checkpoints"
        self.history: list[dict] = []  # metrics.jsonl rows, on rank 0
        self.clocks: dict[str, float] = {}
        # a resumed run continues the clocks from its checkpoint
        self.offsets = {"time/elapsed_s": 0.0, "time/cpu_s": 0.0}
        self.start = 0
        self.saved_step = None
        self._build()

    def _build(self) -> None:
        from recipes.local import algorithm
        from recipes.local.trainer import DapoTrainer

        a = self.args
        if not a.resume:
            self._clear_previous_run()
        self.resume_from = checkpoint.latest(self.ckpt_root) if a.resume else None
        # refuse a checkpoint of other settings before writing anything
        meta = checkpoint.read_meta(self.resume_from, self.settings) if self.resume_from else None
        self.writer = self._writer(meta["step"] if meta else None)
        actor = self._actor()
        tap, aux = self._watchers(actor.model)
        problems, layout, reward_fn = self._task()
        self.sampler = torch.Generator().manual_seed(a.seed)
        self.trainer = DapoTrainer(
            actor, self.groups, tap, self.monitor, aux, reward_fn, layout, self.stream,
            step_config(a), algorithm.policy_loss_config(a.n), self.sampler,
        )  # fmt: skip
        if self.is_main:
            print(f"tiny Qwen3-MoE ({self.spec.num_experts} experts top-{self.spec.top_k}), "
                  f"{len(problems)} problems, tp={a.tp} ep={a.ep} dp={a.dp}; "
                  f"{aux.config.describe()}")  # fmt: skip

    def _clear_previous_run(self) -> None:
        """A fresh run in a used --out starts over: its old checkpoints would mislead --resume."""
        old = [self.ckpt_root, self.out / "metrics.jsonl", self.out / "tensorboard"]
        if self.is_main and any(p.exists() for p in old):
            print(f"starting over in {self.out} (add --resume to continue the run there)")
            shutil.rmtree(self.ckpt_root, ignore_errors=True)
            shutil.rmtree(self.out / "tensorboard", ignore_errors=True)
            (self.out / "metrics.jsonl").unlink(missing_ok=True)
        checkpoint.barrier(self.groups.world)

    def _actor(self):
        """The tiny model, this rank's shard loaded from the HF checkpoint, in the mcore actor."""
        from backend.actor import McoreActor, OptimConfig
        from backend.hf_config import load_qwen3_moe_spec
        from backend.model import build_model
        from converters.hf_io import read_state_dict
        from converters.sharding import load_hf_sharded

        a, groups = self.args, self.groups
        self.hf_dir = _tiny_checkpoint(self.out, a.seed, groups)
        self.spec = load_qwen3_moe_spec(self.hf_dir)
        model = build_model(self.spec, groups)
        load_hf_sharded(model, read_state_dict(self.hf_dir), self.spec, groups)
        optim = OptimConfig(lr=a.lr, weight_decay=0.0, warmup_steps=a.warmup)
        return McoreActor(model, groups, optim)

    def _watchers(self, model):
        """One router tap feeding the expert-load monitor and the aux-loss hook."""
        from backend.aux_loss import mcore_aux_loss
        from backend.monitor import ExpertLoadMonitor
        from backend.router_tap import RouterTap
        from recipes.local.trainer import PHASES

        tap = RouterTap(model, self.groups)
        spec = self.spec
        self.monitor = ExpertLoadMonitor(spec.num_layers, spec.num_experts, self.groups,
                                         phases=PHASES, writer=self.writer,
                                         top_k=spec.top_k).attach(tap)  # fmt: skip
        # grad_scale 1: backend.grads sums DP gradients (the hook's default assumes averaging)
        return tap, mcore_aux_loss(model, tap, _aux_config(self.args), self.groups, grad_scale=1.0)

    def _task(self):
        from recipes.local.rollout import Layout
        from recipes.local.task import CharTokenizer, balanced, make_problems, reward_manager
        from recipes.local.trainer import PromptStream

        a = self.args
        problems, tokenizer = make_problems(a.ops, a.max_operand), CharTokenizer()
        prompt_len = len(tokenizer.encode(problems[0].prompt))
        layout = Layout.for_tp(prompt_len, a.max_response_length, a.tp)
        reward_fn = reward_manager(tokenizer, a.max_response_length, a.overlong_buffer,
                                   a.overlong_penalty)  # fmt: skip
        self.stream = PromptStream(balanced(problems), a.seed)
        return problems, layout, reward_fn

    def _writer(self, resume_step: int | None):
        if not self.is_main:
            return None
        from torch.utils.tensorboard import SummaryWriter

        # a killed run may have logged steps past its checkpoint: hide them
        purge = resume_step + 1 if resume_step is not None else None
        return SummaryWriter(log_dir=str(self.out / "tensorboard"), purge_step=purge)

    # ---- checkpoint ---------------------------------------------------------------------

    def resume(self) -> None:
        if self.args.resume and self.resume_from is None and self.is_main:
            print(f"--resume: no checkpoint in {self.ckpt_root}, starting from step 0")
        if self.resume_from is None:
            return
        rank = dist.get_rank(self.groups.world)
        shard, meta = checkpoint.load(self.resume_from, rank, self.settings)
        self.trainer.actor.load_state_dict(shard["actor"])
        checkpoint.set_rng_state(shard["rng"], self.sampler)
        self.monitor.history = shard["monitor_history"]
        self.stream.load_state(meta["data"])
        self.start = meta["step"]
        self.offsets = {k: meta["clocks"][k] - self._clock(k) for k in self.offsets}
        self.saved_step = self.start
        if self.is_main:
            self.history = self._metrics_upto(self.start)
            print(f"resumed from {self.resume_from} (step {self.start})")

    def _clock(self, key: str) -> float:
        """Seconds of this process: wall since start-up, or CPU of all its threads."""
        return time.perf_counter() - self.t0 if key == "time/elapsed_s" else time.process_time()

    def save(self, step: int) -> None:
        shard = {"actor": self.trainer.actor.state_dict(), "monitor_history": self.monitor.history,
                 "rng": checkpoint.rng_state(self.sampler)}  # fmt: skip
        meta = {"step": step, "data": self.stream.state(), "settings": self.settings,
                "clocks": self.clocks}  # fmt: skip
        rank = dist.get_rank(self.groups.world)
        checkpoint.save(self.ckpt_root, step, rank, self.groups.world, shard, meta, self.args.keep)
        self.saved_step = step

    def _metrics_upto(self, step: int) -> list[dict]:
        """metrics.jsonl cut back to the checkpoint's step (a killed run may have logged more)."""
        path = self.out / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.is_file() else []
        rows = [row for row in map(json.loads, lines) if row["step"] <= step]
        if [row["step"] for row in rows] != list(range(1, step + 1)):
            print(f"warning: {path} lacks some of steps 1..{step}: the reward curve will have gaps")
        tmp = path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
        os.replace(tmp, path)
        return rows

    # ---- loop ---------------------------------------------------------------------------

    def loop(self) -> int:
        from tqdm import tqdm

        self.resume()
        a = self.args
        hide = not self.is_main or a.no_progress
        bar = tqdm(total=a.steps, initial=self.start, desc="DAPO", unit="step", disable=hide)
        for step in range(self.start + 1, a.steps + 1):
            tic = time.perf_counter()
            metrics = self.trainer.step(step)
            metrics["time/step_s"] = time.perf_counter() - tic
            metrics.update({k: offset + self._clock(k) for k, offset in self.offsets.items()})
            self._log(step, metrics)
            bar.set_postfix(
                reward=f"{metrics['rollout/reward_mean']:.2f}",
                acc=f"{metrics['rollout/acc_mean']:.2f}",
                gen=int(metrics["dapo/num_gen_batches"]),
            )
            bar.update()
            if step % a.save_freq == 0 or step == a.steps:
                self.save(step)
        bar.close()
        return self.finish()

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        self.clocks = {k: metrics[k] for k in self.offsets}
        if not self.is_main:
            return
        self.history.append({"step": step, **metrics})
        with (self.out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(self.history[-1]) + "\n")
        for key, value in metrics.items():
            if not key.startswith("moe/"):  # the monitor logs its own
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    # ---- finish -------------------------------------------------------------------------

    def _probe_BS(self) -> torch.Tensor:
        """A few task sequences, padded to the layout, to compare mcore and transformers on."""
        tok, layout = self.trainer.tokenizer, self.trainer.layout
        rows = [tok.encode(text) + [tok.eos_token_id] for text in ("3+4=7", "9-5=4", "0+0=0")]
        return torch.tensor([r + [tok.pad_token_id] * (layout.seq_len - len(r)) for r in rows])

    def finish(self) -> int:
        from recipes.local.export import check_export, export_hf

        export_dir = export_hf(
            self.trainer.actor.model, self.groups, self.spec, self.hf_dir, self.out / "export_hf"
        )
        diff = check_export(self.trainer.actor.model, self.groups, export_dir, self._probe_BS())
        report = self.monitor.write_report(
            self.out / "routing_report.json", model="tiny Qwen3-MoE", task="local DAPO arithmetic"
        )
        if not self.is_main:
            return 0
        from backend.monitor.render import render
        from backend.monitor.report import load_report

        html = render(load_report(report), self.out / "routing_report") / "index.html"
        self.writer.close()
        paths = {"routing_report": report, "routing_html": html,
                 "tensorboard": self.out / "tensorboard", "export": export_dir,
                 "checkpoint": self.ckpt_root / f"step_{self.saved_step:06d}"}  # fmt: skip
        wall = time.perf_counter() - self.t0
        summary = write_summary(self.out, self.history, self.args.target_reward, paths, wall,
                                export_max_logits_diff=diff)  # fmt: skip
        print_summary(summary)
        print(f"export reloads in transformers: max |logits diff| = {diff:.2e}")
        return 0 if diff < 1e-4 else 1
