"""The endpoint's bookkeeping of the episodes it serves, beside what the recorder records: the
PRNG key each call samples with, the requests in flight per episode, and the episodes the
trainer abandoned (their requests cancelled, later ones refused).

``EPISODE_HEADER`` names the header a call's episode travels in (and the response's).
"""

from __future__ import annotations

import collections
import itertools
import threading

import jax
import numpy as np

from rlax_llm.serve.http_server import ApiError
from rlax_llm.serve.scheduler import Ticket

EPISODE_HEADER = 'X-Episode-Id'


class OpenEpisodes:
  """Thread-safe per-episode state of the endpoint's calls.

  Args:
    seed: the root of the PRNG keys of calls that name neither an opened episode nor a seed.
  """

  def __init__(self, seed: int = 0):
    self._root = jax.random.key(seed)
    self._counter = itertools.count()
    self._lock = threading.Lock()
    # Episodes opened with a key (``open``): name -> [key data, calls submitted].
    self._keys: dict[str, list] = {}
    self._abandoned: set[str] = set()
    self._tickets: dict[str, list[Ticket]] = collections.defaultdict(list)

  def open(self, name: str, key_data: np.ndarray) -> None:
    """Call ``n`` of episode ``name`` will sample with ``fold_in(key, n)`` (``key_data``:
    uint32 key data), whatever seed it asks for."""
    with self._lock:
      self._keys[name] = [np.asarray(key_data, np.uint32), 0]

  def key_data(self, episode: str, seed: int | None) -> np.ndarray:
    """The PRNG key data (uint32) of the episode's next call: ``fold_in(key, n)`` for an
    episode opened with a key, else ``key(seed)``, else the root key folded with a call
    counter."""
    with self._lock:
      entry = self._keys.get(episode)
      if entry is not None:
        entry[1] += 1
        key = jax.random.fold_in(jax.random.wrap_key_data(entry[0]), entry[1] - 1)
      elif seed is not None:
        key = jax.random.key(seed)
      else:
        key = jax.random.fold_in(self._root, next(self._counter))
    return np.asarray(jax.random.key_data(key))

  def abandon(self, name: str) -> None:
    """Marks episode ``name`` abandoned and cancels its requests in flight."""
    with self._lock:
      self._abandoned.add(name)
      tickets = list(self._tickets.get(name, ()))
    for ticket in tickets:
      ticket.cancel.set()

  def check_not_abandoned(self, episode: str) -> None:
    """Raises ApiError 409 ``episode_abandoned`` for an abandoned episode."""
    with self._lock:
      abandoned = episode in self._abandoned
    if abandoned:
      raise ApiError(409, f'episode {episode!r} was ended by the trainer (its harness ran past '
                     'its timeout); start a new episode.', code='episode_abandoned')

  def track(self, episode: str, ticket: Ticket) -> None:
    """Notes ``ticket`` in flight for ``episode`` (cancelled if the episode is abandoned)."""
    with self._lock:
      self._tickets[episode].append(ticket)

  def untrack(self, episode: str, ticket: Ticket) -> None:
    """Forgets ``ticket`` once its request is answered."""
    with self._lock:
      tickets = self._tickets[episode]
      tickets.remove(ticket)
      if not tickets:
        del self._tickets[episode]
