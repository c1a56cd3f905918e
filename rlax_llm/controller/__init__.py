"""The controller: the one active part, scheduling the RL loop deterministically.

It owns the data order (a grain dataset of prompt batches and its iterator position), the RNG
(one root key, ``rl.seed``'s or by default ``config.seed``'s; batch ``i`` samples with
``fold_in(root, i)``; held-out evaluation keeps ``config.seed``'s), the step counter and the
staleness schedule; the trainer and the inference workers act only when it calls them,
through typed interfaces (``GenerationRequest``s in, ``Rollouts`` out, ``TrainBatch`` to the
trainer) and through *handles* whose calls return futures, so the same code drives roles in
this process (``rlax_llm.backends.local``) or in Ray actors (``rlax_llm.backends.ray``).
Everything it must remember to resume is one ``ControllerState``.

The controller moves version numbers, never weights: the trainer pushes each new version to
the parameter server itself, and each ``generate`` call names the version the schedule
chose, which the worker pulls from the server itself (``InferenceWorker.generate_at``). The
controller holds no server and never asks a role for its params; it only adds up the pull
figures (``sync/...``) the workers report with their rollouts, in the fixed order it gathers
them.

The schedule (which version samples which batch, when a batch launches, what is trained,
recycled, padded, carried or dropped: RLAX's ``(j, k)`` staleness, dynamic sampling, prompt
replay, APRIL's partial rollouts) is decided by the pure functions of ``rlax_llm.schedule``;
this package runs it: launches batches, gathers and scores their rollouts, trains, evaluates,
checkpoints.

Deterministic asynchrony: every decision is a function of the schedule and of results the
controller waits for in a fixed order, never of which thread finishes first. An asynchronous
run therefore gives the same metrics and params whatever the timing, on every backend; only
``time/...`` metrics differ. The exception is the optional free-running mode
(``staleness.schedule='free'``, ``rlax_llm.schedule``): ``generate`` names no version
(``FollowLatest(j)``), the workers follow the server between decode steps, and which version
draws which token depends on timing; the acceptance window ``k`` is then enforced when a
batch is trained, and ``sampling_version`` reports the batch's oldest token's version.

One loop, two rollout kinds: the loop (``loop.Controller``) launches, gathers, trains,
evaluates and checkpoints the same way for every run; what a run's rollouts are is one
``RolloutKind`` (``protocols``): ``completions.Completions`` (a task's prompts, scored by its
verifier, with APRIL's carried groups, dynamic sampling's recycled groups and the replay
pool) or ``episodes.Episodes`` (an environment run, ``settings.episodes``: each prompt is an
environment seed whose ``group_size`` episodes the workers ``play``, the environment's
returns the rewards; docs/environments.md, "Training on an environment"). The kind submits a
chunk of requests and merges the chunks' results, composes a batch's prompts, makes the
trainer's batch and the step's metrics, evaluates (through ``rlax_llm.evaluation``, as
``python -m rlax_llm.evaluate`` does with the same kind), and stores what it has in flight
in a checkpoint (``state.ControllerState``).

Worker failures: a worker whose call raises, or returns nothing within ``worker_timeout_s``,
is retired and its requests re-issued to a live one (same keys, same version: the same
rollouts); the run goes on and reports the loss. A backend that restarts a lost worker
process (Ray) retries its call there; the worker reports the restart with its rollouts
(``workers/restarts``, and an event). Checkpoints: the controller decides when to save and
hands its state to the trainer, whose process writes it with the weights
(``TrainerHandle.save``).
"""

from rlax_llm.controller.loop import Controller, rollout_kind
from rlax_llm.controller.protocols import Made, RolloutKind, TrainerHandle, WorkerHandle
from rlax_llm.controller.state import ControllerState

__all__ = ['Controller', 'ControllerState', 'Made', 'RolloutKind', 'TrainerHandle',
           'WorkerHandle', 'rollout_kind']
