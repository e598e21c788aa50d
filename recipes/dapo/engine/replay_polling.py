"""verl's sync replay buffer, polling for finished rollouts as often as a CPU step needs.

verl 0.9.1's V1 trainer waits for generation by polling TransferQueue's metadata: its
`ReplayBuffer` sleeps `poll_interval` seconds between two looks (2.0 by default; verl's
builder passes none and no config key reaches it). DAPO's group filter refills evicted groups
one poll round at a time, so a step's generation is a whole number of 2 s rounds, however
little the rollout takes: on the CPU run vLLM itself spends ~1 s on a step's 128 responses.

The hook verl offers is its custom sampler (`trainer.v1.sampler.custom_sampler.{path,name}`,
with `trainer.v1.sampler.sampler_kwargs`). verl builds it with the base arguments only; the
DAPO ones that its own sync branch adds (filter metric, batch sizes, in-flight batches) it
leaves to the custom class. `PollingReplayBuffer` takes them from the trainer that owns
`refill_fn`, as `PPOTrainer._build_replay_buffer` computes them, and its interval from
`sampler_kwargs.poll_interval_s`. `check_verl` refuses in one line at import unless verl is
0.9.1 with that builder's source (tests/recipes/test_replay_polling.py builds both through
verl's own builder and compares them).
"""

import hashlib
import inspect

import verl
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
from verl.trainer.ppo.v1.trainer_base import PPOTrainer

VERL_VERSION = "0.9.1"
# sha256 of inspect.getsource(PPOTrainer._build_replay_buffer) in verl 0.9.1: dapo_arguments
# mirrors its sync branch
BUILDER_SHA256 = "c6c5bd0783311ea3ed37f2f5054eb1d23533deb76b181643419b2f37897f38be"
PATH = "pkg://recipes.dapo.engine.replay_polling"
NAME = "PollingReplayBuffer"


def builder_digest() -> str:
    return hashlib.sha256(inspect.getsource(PPOTrainer._build_replay_buffer).encode()).hexdigest()


def check_verl() -> None:
    """Refuse in one line unless verl's builder is the one dapo_arguments mirrors."""
    if verl.__version__ != VERL_VERSION or builder_digest() != BUILDER_SHA256:
        raise RuntimeError(
            f"{NAME} mirrors verl {VERL_VERSION}'s PPOTrainer._build_replay_buffer; verl "
            f"{verl.__version__}'s differs: install verl=={VERL_VERSION} or drop "
            "trainer.v1.sampler.custom_sampler"
        )


def dapo_arguments(trainer) -> dict:
    """What verl's builder adds for its own sync ReplayBuffer (trainer_base.py, lines 164-183)."""
    config, sampler = trainer.config, trainer.config.trainer.v1.sampler
    metric = trainer._resolve_filter_groups_metric()
    refill_failed = bool(sampler.get("sync_refill_failed_groups", False))
    inflight = 1
    if metric is not None:
        inflight = config.algorithm.get("filter_groups", None).get("max_inflight_gen_batches", 1)
    train_batch = config.data.train_batch_size
    one_at_a_time = metric is not None or refill_failed
    return dict(
        filter_groups_metric=metric,
        sync_refill_failed_groups=refill_failed,
        train_batch_size=train_batch,
        gen_batch_size=1
        if one_at_a_time
        else (config.data.get("gen_batch_size", None) or train_batch),
        max_inflight_gen_batches=inflight,
    )


class PollingReplayBuffer(ReplayBuffer):
    """verl's sync ReplayBuffer, its DAPO arguments as verl's builder gives them, polling every
    `sampler_kwargs.poll_interval_s` seconds."""

    def __init__(self, *, trainer_mode: str, refill_fn, sampler_kwargs, **base):
        if trainer_mode != "sync":
            raise ValueError(f"{NAME} is the sync trainer's buffer; trainer_mode is {trainer_mode}")
        super().__init__(
            trainer_mode=trainer_mode, refill_fn=refill_fn, sampler_kwargs=sampler_kwargs,
            poll_interval=float(sampler_kwargs["poll_interval_s"]),
            **base, **dapo_arguments(refill_fn.__self__),
        )  # fmt: skip


check_verl()
