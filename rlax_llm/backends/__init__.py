"""Backends place the roles and move bytes between them; the controller code is the same.

``local``: every role in this process (``rlax_llm.backends.local``); ``ray``: the trainer and
each inference worker in a Ray actor (``rlax_llm.backends.ray``).
"""

from __future__ import annotations

import contextlib
import importlib


@contextlib.contextmanager
def build_run(config, workdir, spec, stop=None):
  """``config.backend``'s ``build_run``; ``spec`` is the ``rlax_llm.config.RunSpec`` that
  ``validate_config(config)`` returned, ``stop`` the preemption event (or None)."""
  module = importlib.import_module(f'rlax_llm.backends.{config.backend}')
  with module.build_run(config, workdir, spec, stop=stop) as run:
    yield run
