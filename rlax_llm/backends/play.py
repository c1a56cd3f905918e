"""In an inference worker's process: playing an environment run's requests.

The controller's ``play`` calls on a worker handle (``controller.protocols``) end here, in
whichever process holds the worker (the local backend's thread, a Ray worker actor, the
evaluated policy of ``python -m rlax_llm.evaluate``): the episode runner plays them in the
worker's slots (``rollout.episodes``), or an agent harness through the OpenAI-compatible
endpoint when ``env.name`` names one (``serve.harness_runner``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from rlax_llm.data_types import GenerationRequest, Trajectory
from rlax_llm.envs import Environment
from rlax_llm.rollout.episodes import request_episodes
from rlax_llm.rollout.worker import InferenceWorker
from rlax_llm.schedule import EpisodeSettings
from rlax_llm.serve.harness import is_harness


def play_requests(worker: InferenceWorker, fetch, requests: Sequence[GenerationRequest],
                  rng_data: np.ndarray, version: int, first: int, episodes: EpisodeSettings,
                  make_env: Callable[[], Environment]
                  ) -> tuple[list[Trajectory], dict[str, float]]:
  """In a worker's process: plays the episodes of an environment run's ``requests``
  (``episodes.request_episodes``: ``num_samples`` per request, keys from ``rng_data`` and
  ``first`` as ``generate`` draws them) with the weights of ``version``, pulled through
  ``fetch`` unless held (``InferenceWorker.play_at``), with the requests' sampling spec (one
  for all). Returns the trajectories in order and the runner's figures."""
  specs = {request.sampling for request in requests}
  if len(specs) != 1:
    raise ValueError(f'play_requests: the requests mix sampling specs {specs}; send one.')
  if is_harness(episodes.env):  # an agent harness plays them, through the endpoint
    # Imported here: the serve extra (fastapi, uvicorn, openai) only a harness run needs.
    from rlax_llm.serve.harness_runner import (  # pylint: disable=import-outside-toplevel
      play_harness,
    )
    return play_harness(worker, fetch, requests, rng_data, version, first, specs.pop(),
                        episodes)
  played = request_episodes(requests, make_env, jax.random.wrap_key_data(rng_data), first)
  return worker.play_at(version, fetch, played, specs.pop(), **episodes.runner_kwargs())
