"""What the RL loop is given to run a job (`JobSession`), as typed protocols instead of the controller
itself: the training service (one optimizer step, weight export, checkpoints), the generation service
(sampling from the rollout pool), the desired-state store, the weight publish through the executor's gate,
and the few read-outs the step report shows. The real training and generation services are
`libra.training.TrainingPool` and `libra.rollout.RolloutPool`, reached through the controller's edges; the
unit tests pass fakes. Membership changes are not here: they belong to the reconciler and its executor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from libra.controller.desired_store import DesiredStore


class GeneratedText(Protocol):
    """One sampled continuation and the weight version that produced it."""

    @property
    def token_ids(self) -> list[int]: ...
    @property
    def logprobs(self) -> list[float]: ...
    @property
    def finish_reason(self) -> str: ...
    @property
    def weight_version(self) -> int: ...


class GenerationService(Protocol):
    async def generate(self, prompt_ids: list[int], n: int, max_new_tokens: int, temperature: float = 1.0,
                       top_p: float = 1.0, seed: int | None = None) -> Sequence[GeneratedText]: ...


class TrainingService(Protocol):
    def train_step(self, samples: list[Any], step: int) -> dict[str, float]: ...
    def export_hf(self, out_dir: str) -> str: ...
    def save_checkpoint(self, ckpt_dir: str, step: int) -> str: ...
    def load_checkpoint(self, ckpt_dir: str) -> int: ...


@dataclass(frozen=True)
class JobSession:
    """Everything the RL loop needs, built by the controller once the pools are ready."""

    training: TrainingService
    generation: GenerationService
    desired: DesiredStore
    publish_weights: Callable[[int, str, str], Any]  # (publish version, HF dir, checksum) -> the pool's report
    served_versions: Callable[[], list[int]]  # the weight versions live rollout members ACKed
    wake_reconciler: Callable[[], None]
    pool_status: Callable[[], dict[str, Any]]
    pool_text: Callable[[], dict[str, str]]
    tick_errors: Callable[[], int]
    # called with the metric rows of this session after each step (online re-planning); never raises
    after_step: Callable[[list[dict[str, Any]]], None] | None = None
    # (samples, step, rollout groups in flight) -> metrics: one training step with borrowed rollout GPUs
    # (elastic hybrid parallelism, `libra.controller.ehp_borrow`); None when it is off
    ehp_train_step: Callable[[list[Any], int, int], dict[str, float]] | None = None
    # (error of a training call) -> how it says a training worker was lost ("died", "hung"; the pool can be
    # restarted), "" when it does not
    training_loss: Callable[[BaseException], str] | None = None
    # (error of a training call that says a worker was lost) -> the restart's cost when the pool was started again at
    # the same layout (its ranks then hold the initial weights); None when it could not be
    restart_training: Callable[[BaseException], dict[str, Any] | None] | None = None
    # at a step boundary: the pools re-planned onto the GPUs alive when the cluster lost some (a node died); None
    # when nothing was lost, else {"training_restarted": bool, ...}: a restarted training pool holds the initial
    # weights until the loop loads its newest checkpoint. Raises CapacityLost when the smallest pools do not fit
    replan_onto_capacity: Callable[[], dict[str, Any] | None] | None = None
