"""The endpoint's generation thread: requests from many HTTP handlers, one driver.

The continuous-batching driver (``rlax_llm.rollout.driver``) is single-threaded, so the
endpoint gives it one thread of its own. Handlers ``submit`` a prompt (token ids) with its
sampling spec, length cap, stop ids and PRNG key and wait on the returned ``Ticket``. The
thread takes every waiting request at once (up to the engine's slots) and runs them together
in one ``Driver.run``: concurrent requests share the decode steps. A request that arrives
while a batch runs waits for it (at most ``max_new_tokens`` decode steps), then runs in the
next batch. Bounds: at most ``max_waiting`` requests wait; one more is refused
(``Busy``) instead of queueing without end.

A ticket may be cancelled (its client disconnected): the driver ends its sample before the
next decode step and gives its slot to another request (``Driver.run(cancelled=...)``); the
others in the batch go on. A batch that raises fails only its own tickets (counted in
``stats['batch_errors']``); the thread goes on with the next.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Sequence

import numpy as np

from rlax_llm.rollout.driver import Job, Sample
from rlax_llm.rollout.worker import InferenceWorker
from rlax_llm.sampling_spec import SamplingSpec


class Busy(RuntimeError):
  """More requests are waiting than the scheduler admits (``max_waiting``)."""


@dataclasses.dataclass
class Ticket:
  """A submitted request: its job, the future of its ``Sample``, its cancel flag and the
  sample while it is drawn (``live``: the driver's growing ``Sample``, set at its first
  token)."""

  job: Job
  future: concurrent.futures.Future = dataclasses.field(
      default_factory=concurrent.futures.Future)
  cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
  live: Sample | None = None  # the sample as it grows, token by token (for streaming)


class Scheduler:
  """Runs submitted requests on ``worker``'s driver, batched, in a thread of its own.

  Args:
    worker: the inference worker (weights loaded); its engine's slots bound a batch.
    max_waiting: requests that may wait for a batch; more are refused (``Busy``).
    refresh: called before every decode step (e.g. a worker pulling a newer version from
      the parameter server, ``InferenceWorker.generate_at``'s free-running rule).
  """

  def __init__(self, worker: InferenceWorker, *, max_waiting: int = 64,
               refresh: Callable[[], None] | None = None):
    if worker.version < 0:
      raise ValueError('the endpoint\'s worker holds no weights; load() or pull a version '
                       'before serving.')
    self.worker = worker
    self.max_waiting = max_waiting
    self.refresh = refresh
    self.stats: collections.Counter[str] = collections.Counter()
    self._waiting: collections.deque[Ticket] = collections.deque()
    self._cond = threading.Condition()
    self._stopped = False
    self._thread = threading.Thread(target=self._loop, name='rlax-serve-scheduler',
                                    daemon=True)
    self._thread.start()

  def submit(self, prompt_ids: Sequence[int], sampling: SamplingSpec, max_new_tokens: int,
             stop_ids: Sequence[int], key_data: np.ndarray) -> Ticket:
    """Queues one sample of ``prompt_ids``; ``key_data`` is its PRNG key data (uint32
    ``[key_size]``). Raises ValueError for a job the engine cannot run (``Driver.check``) and
    ``Busy`` when ``max_waiting`` requests already wait."""
    job = Job(prompt_ids=tuple(prompt_ids), num_samples=1, sampling=sampling,
              max_new_tokens=max_new_tokens, stop_ids=tuple(dict.fromkeys(stop_ids)),
              keys=np.asarray(key_data, np.uint32)[None])
    self.worker.driver.check([job])
    ticket = Ticket(job)
    with self._cond:
      if self._stopped:
        raise RuntimeError('the scheduler is stopped.')
      if len(self._waiting) >= self.max_waiting:
        self.stats['busy'] += 1
        raise Busy(f'{len(self._waiting)} requests are waiting (max_waiting='
                   f'{self.max_waiting}); retry later.')
      self._waiting.append(ticket)
      self._cond.notify()
    return ticket

  def stop(self) -> None:
    """Stops the thread after the batch it runs; waiting tickets are cancelled."""
    with self._cond:
      self._stopped = True
      self._cond.notify()
    self._thread.join()
    for ticket in self._waiting:
      ticket.future.cancel()

  def _loop(self) -> None:
    while True:
      with self._cond:
        while not self._waiting and not self._stopped:
          self._cond.wait()
        if self._stopped:
          return
        batch = []
        while self._waiting and len(batch) < self.worker.engine.slots:
          ticket = self._waiting.popleft()
          if ticket.cancel.is_set():  # gave up before it started
            self.stats['cancelled_before_start'] += 1
            ticket.future.cancel()
          else:
            batch.append(ticket)
      if batch:
        self._run(batch)

  def _run(self, batch: list[Ticket]) -> None:
    self.stats['batches'] += 1
    try:
      results = self.worker.driver.run(
          [t.job for t in batch], refresh=self.refresh,
          cancelled=lambda j: batch[j].cancel.is_set(),
          on_token=lambda j, i, sample: setattr(batch[j], 'live', sample))
    except Exception as error:  # noqa: BLE001  (a failed batch fails only its requests)
      self.stats['batch_errors'] += 1
      for ticket in batch:
        ticket.future.set_exception(error)
      return
    for ticket, (sample,) in zip(batch, results):
      # 'cancelled': its client went away mid-generation and the driver freed its slot.
      self.stats['cancelled' if sample.finish_reason == 'cancelled' else 'samples'] += 1
      ticket.future.set_result(sample)
