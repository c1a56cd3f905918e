"""What the controller's loop talks to: the roles' handles and the rollout kind.

The loop (``rlax_llm.controller.loop``) is written once; what differs between a run on a
task's single-turn completions and a run on an environment's multi-turn episodes is one
``RolloutKind`` (``completions.Completions``, ``episodes.Episodes``): how a chunk of requests
is submitted to a worker and its results merged, which prompts a batch asks, how its results
become the trainer's batch and its metrics, how held-out evaluation runs, and what of it a
checkpoint stores.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from rlax_llm.data_types import FollowLatest, GenerationRequest, TrainBatch
from rlax_llm.tasks import Prompt


class Future(Protocol):
  def result(self, timeout: float | None = None) -> Any:
    ...


def done(value: Any) -> concurrent.futures.Future:
  """A future that already holds ``value`` (results restored from a checkpoint)."""
  future = concurrent.futures.Future()
  future.set_result(value)
  return future


class TrainerHandle(Protocol):
  """The trainer role as the controller sees it (calls return futures, run in order).
  ``version``: the updates it applied; each ``step`` that makes a new version pushes it to
  the parameter server before its future resolves (the trainer does, not the controller)."""

  version: int

  def step(self, batch) -> Future:  # -> metrics dict
    ...

  def save(self, step: int, controller: dict[str, Any],
           rollouts: dict[str, dict[str, np.ndarray]]) -> Future:  # -> None
    """Checkpoints the run after ``step`` in the trainer's process: its params, optimizer
    state and counters with the controller's state (``ControllerState.to_dict()``) and the
    rollouts' arrays (``Controller.snapshot``), as one step (``rlax_llm.checkpoint``). The
    future resolves once the save has started (the files are written in the background)."""


class WorkerHandle(Protocol):
  """An inference worker as the controller sees it (calls return futures, run in order)."""

  def generate(self, requests: Sequence[GenerationRequest], rng_data: np.ndarray,
               version: int | FollowLatest, stop_after: int | None = None, first: int = 0
               ) -> Future:  # -> Rollouts
    """``InferenceWorker.generate_at``: sample with weights ``version``, which the worker
    pulls from the parameter server itself when it does not hold them (the figures of that
    pull in the rollouts' ``timings``, under ``sync/``); ``FollowLatest(j)``: free-running,
    with the newest weights, pulled between decode steps too."""

  def play(self, requests: Sequence[GenerationRequest], rng_data: np.ndarray, version: int,
           first: int = 0) -> Future:  # -> (list[Trajectory], dict[str, float])
    """An environment run's ``generate`` (``backends.play.play_requests``): plays each request's
    ``num_samples`` episodes of the environment seed its prompt stands for with weights
    ``version`` (pulled by the worker itself), keys as ``generate`` draws them; returns the
    trajectories and the runner's figures (``sync/`` keys: the pull's)."""

  def retire(self) -> None:
    ...


@dataclasses.dataclass
class Batch:
  """A batch in flight: its prompts, the version sampling it and the futures of its chunks."""

  index: int
  version: int | None  # None: free-running (the workers follow the server)
  prompts: list[Prompt]
  chunks: list[tuple[int, list[GenerationRequest], Any]]  # (worker, requests, future)
  stop_after: int = 0  # APRIL: the batch stops when this many groups finished (0: never)
  carried: int = 0  # groups carried in from earlier batches (the first ones)
  restarted: int = 0  # of those, regenerated from scratch (too stale to continue)
  replayed: int = 0  # prompts re-asked from the replay pool (after the carried ones)

  def prompt_ids(self) -> dict[str, list[int]]:
    """The ledger's account of the batch's prompts: new ones from the stream
    (``prompt_ids``), APRIL's carried groups (continued or restarted) and prompts re-asked
    from the replay pool apart (``carried_prompt_ids``, ``replayed_prompt_ids``, when any)."""
    new = self.carried + self.replayed  # the stream's prompts follow these
    ids = lambda prompts: [p.prompt_id for p in prompts]
    return {'prompt_ids': ids(self.prompts[new:]),
            **({'carried_prompt_ids': ids(self.prompts[:self.carried])} if self.carried else {}),
            **({'replayed_prompt_ids': ids(self.prompts[self.carried:new])}
               if self.replayed else {})}


@dataclasses.dataclass
class Made:
  """What a kind makes of a gathered batch (``RolloutKind.make``).

  Attributes:
    metrics: the step's metrics so far (rewards, the kind's figures, ``sampling_version``).
    train: the trainer's batch, or None: the step skips its update.
    trained_prompt_ids: the prompts trained on, in order, each once (the ledger's).
    trained_versions: the versions that sampled the trained tokens, sorted (the ledger's).
    tokens_per_s: the generation's token throughput (``time/rollout_tokens_per_s``).
    rollouts: what the kind logs of the step (``RolloutKind.log``), or None.
  """

  metrics: dict[str, Any]
  train: TrainBatch | None
  trained_prompt_ids: list[int]
  trained_versions: list[int]
  tokens_per_s: float
  rollouts: Any = None


# ``run(requests, key) -> merged results``: one chunk of requests on a live worker.
Run = Callable[[list[GenerationRequest], jax.Array], Any]


class RolloutKind(Protocol):
  """What the loop does differently for completions and for episodes (module docstring)."""

  def submit(self, worker: WorkerHandle, requests: list[GenerationRequest],
             rng_data: np.ndarray, version: int | FollowLatest, stop_after: int | None,
             first: int) -> Future:
    """Queues ``requests`` on ``worker`` (``WorkerHandle.generate`` or ``play``)."""

  def counted(self, result: Any, count: Callable[[dict[str, float]], dict[str, float]]) -> Any:
    """``result`` with its figures replaced by ``count(figures)`` (the loop adds the pull's
    and restart's to its counters and hands back the rest)."""

  def merge(self, parts: list[Any]) -> Any:
    """The results of a batch's chunks, in order, as one."""

  def compose(self, count: int, version_bound: int, draw: Callable[[], Prompt]
              ) -> tuple[list[Prompt], list[Any], dict[str, int]]:
    """A new batch's ``count`` prompts (``draw()``: the stream's next), the rows to resume
    per prompt (None: start afresh) and the ``Batch`` counts (``carried``, ``restarted``,
    ``replayed``). ``version_bound``: the highest version the trainer may hold when the
    batch is trained."""

  def make(self, batch: Batch, merged: Any, trainer_version: int) -> Made:
    """The trainer's batch and the metrics of ``batch``'s merged results."""

  def log(self, writer: Any, step: int, made: Made, staleness: np.ndarray | None) -> None:
    """Writes what the kind logs of a trained step beyond metrics (histograms)."""

  def evaluate(self, run: Run, prompts: Sequence[Prompt], key: jax.Array) -> dict[str, float]:
    """Held-out metrics (``rlax_llm.evaluation``) of the policy ``run`` samples with."""

  def state(self) -> dict[str, Any]:
    """The kind's own fields of ``ControllerState`` (JSON; no arrays)."""

  def snapshot(self, state: Any, arrays: dict[str, dict[str, np.ndarray]],
               in_flight: Sequence[Batch], gather: Callable[[Batch], Any]) -> None:
    """Adds the batches ``in_flight`` (``gather(batch)`` waits for one's merged results) and
    the kind's pending results to ``state`` (a ``ControllerState``) and ``arrays``."""

  def restore(self, state: Any, arrays: dict[str, dict[str, np.ndarray]]) -> list[Batch]:
    """Takes back what ``state`` and ``snapshot`` stored; returns the batches in flight
    (those with no chunks are launched again, with the same keys and version)."""
