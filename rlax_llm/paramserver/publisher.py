"""The trainer side of weight sync, one for every backend: the base once, then each version
once (whole params, which the server hands out as deltas, or LoRA adapters).

A backend supplies only the transport, a ``Push`` and its servers: the local backend pushes to
a ``ParameterServer`` of its process (``backends.local``), Ray to a server actor through a
shared-memory slot or the object store (``backends.ray_actors.push_shards``). The ``Publisher`` owns
the rules: what a version is (``lora.pushed_params``: the trainer's params cast to the
workers' dtypes on the trainer's devices, a LoRA model's merged, or under adapter-only sync
its adapters alone), that under adapter-only sync the base (``lora.pushed_base``) goes first,
once, to a server of its own, and that a version already pushed is not pushed again (a step
skipped for a non-finite update makes no new version; a restored trainer publishes the
version it restored).

Adapter-only sync is decided once, from the run's config (``adapter_sync``): the backends ask
it whether to give the run a base server, and the workers whether to merge adapters
(``roles.build_worker``, ``receiver.Receiver``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlax_llm.models import lora as lora_lib
from rlax_llm.models.model import Model, Params

# ``push(server, version, params)``: a backend's way to store ``params`` (arrays on the
# trainer's devices) as ``version`` in ``server``, one of its parameter servers (a
# ``ParameterServer`` in process, a server actor's handle on Ray).
Push = Callable[[Any, int, Params], None]


def adapter_sync(config: Any) -> lora_lib.LoRAConfig | None:
  """The run's LoRA config when its versions are adapters over a base pushed once
  (``lora.rank > 0`` and ``lora.sync='adapters'``, the default for LoRA), else None (every
  version carries the whole weights, a LoRA model's merged). ``config``: the run's
  ``ml_collections.ConfigDict``."""
  lora = lora_lib.from_config(config)
  return lora if lora is not None and lora.sync == 'adapters' else None


class Publisher:
  """Publishes a trainer's versions to the workers.

  Args:
    model: the trainer's model (a ``LoRAModel`` for a LoRA run).
    inference: the workers' model (``roles.inference_model``: the base in the workers'
      dtypes); each version is cast to its dtypes on the trainer's devices.
    push: the backend's transport.
    server: the versions' server.
    base_server: under adapter-only sync (``lora.syncs_adapters(model)``), the base's
      server (keeping one version; ``adapter_sync`` tells a backend to make one); else None.
  """

  def __init__(self, model: Model, inference: Model, push: Push, server: Any,
               base_server: Any = None):
    if lora_lib.syncs_adapters(model) != (base_server is not None):
      raise ValueError('a LoRA trainer syncing adapters needs a base_server (its base is '
                       'pushed once, to a server of its own), and only it (lora.sync); got '
                       f'base_server={base_server!r} for {model}.')
    self.model, self.inference = model, inference
    self._push, self._server, self._base_server = push, server, base_server
    self._base_pushed = False
    self.pushed = -1  # the newest version pushed (-1: none)

  def publish(self, version: int, params: Params) -> None:
    """Pushes ``params`` (the trainer's, of ``version``) unless ``version`` was pushed
    already; under adapter-only sync the base first, once, before the first version."""
    if self._base_server is not None and not self._base_pushed:
      self._push(self._base_server, 0,
                 lora_lib.pushed_base(self.model, params, self.inference))
      self._base_pushed = True
    if self.pushed < version:
      self._push(self._server, version,
                 lora_lib.pushed_params(self.model, params, self.inference))
      self.pushed = version
