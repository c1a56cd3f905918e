"""An inference worker: holds a weight version, reloads from the parameter server, samples.

The worker is passive (the controller calls it). It pulls new weights when the server is at
least ``j`` versions ahead of the weights it holds (RLAX reload staleness, DESIGN.md), and
stamps every sampled token with the version it was sampled with. It runs on its own
``inference`` mesh: params replicated, prompts sharded along ``batch``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from rlax_llm.models.model import Model
from rlax_llm.models.tokenizer import CharTokenizer
from rlax_llm.paramserver import ParameterServer
from rlax_llm.rollout.sampler import Sampler, Samples, SamplingConfig
from rlax_llm.tasks import Prompt
from rlax_llm import sharding as sharding_lib


def encode_prompts(tokenizer: CharTokenizer, prompts: Sequence[Prompt], length: int):
  """Encodes prompt texts -> ``(tokens int32 [B, length], lengths int32 [B])``.

  A bos is prepended when the tokenizer's ``add_bos_token`` says its model expects one.
  """
  return tokenizer.encode_batch([p.text for p in prompts], length=length,
                                add_bos=tokenizer.add_bos_token)


class InferenceWorker:
  """Samples completions with the latest weights it has pulled.

  Args:
    model: the decoder.
    tokenizer: encodes prompts and decodes completions.
    sampling: decoding settings for rollouts.
    mesh: the inference mesh.
    max_prompt_len: prompts are right-padded to this many tokens (bos included), so every
      batch has one shape and ``generate`` compiles once.
  """

  def __init__(self, model: Model, tokenizer: CharTokenizer, sampling: SamplingConfig,
               mesh: Mesh, max_prompt_len: int):
    if max_prompt_len + sampling.max_new_tokens > model.config.max_seq_len:
      raise ValueError(
          f'max_prompt_len ({max_prompt_len}) + max_new_tokens ({sampling.max_new_tokens}) '
          f'exceeds the model max_seq_len ({model.config.max_seq_len}); raise '
          'model.max_seq_len or shorten the prompts/completions.')
    self.model = model
    self.max_prompt_len = max_prompt_len
    self.tokenizer = tokenizer
    self.mesh = mesh
    self.sampler = Sampler(model, sampling)
    greedy = SamplingConfig(max_new_tokens=sampling.max_new_tokens, eos_id=sampling.eos_id,
                            pad_id=sampling.pad_id, temperature=0.0)
    self.greedy_sampler = Sampler(model, greedy)
    self.version = -1
    self.params = None
    self.reloads = 0

  def load(self, version: int, params) -> None:
    """Installs weights (host arrays) of the given version, replicated on the mesh."""
    self.params = jax.device_put(params, sharding_lib.replicated(self.mesh))
    self.version = int(version)
    self.reloads += 1

  def maybe_reload(self, server: ParameterServer, j: int) -> bool:
    """Pulls the latest weights if the server is ``>= j`` versions ahead. Returns True if so."""
    latest = server.latest_version()
    if self.params is None or latest - self.version >= j:
      snapshot = server.pull(min_version=max(latest, 0))
      self.load(snapshot.version, snapshot.params)
      return True
    return False

  def sample(self, prompts: Sequence[Prompt], group_size: int, rng: jax.Array,
             greedy: bool = False) -> tuple[Samples, np.ndarray, np.ndarray]:
    """Samples ``group_size`` completions per prompt (rows of one prompt are contiguous).

    Returns ``(samples as host arrays, prompt_tokens [B, P], prompt_lengths [B])`` with
    ``B = len(prompts) * group_size``.
    """
    if self.params is None:
      raise RuntimeError('InferenceWorker has no weights; call load() or maybe_reload() first.')
    tokens, lengths = encode_prompts(self.tokenizer, prompts, self.max_prompt_len)
    tokens = np.repeat(tokens, group_size, axis=0)
    lengths = np.repeat(lengths, group_size, axis=0)
    batch_sharding = sharding_lib.batch_sharding(self.mesh, {'t': tokens, 'l': lengths})
    tokens_d = jax.device_put(tokens, batch_sharding['t'])
    lengths_d = jax.device_put(lengths, batch_sharding['l'])
    sampler = self.greedy_sampler if greedy else self.sampler
    samples = sampler(self.params, tokens_d, lengths_d, rng, self.version)
    return jax.device_get(samples), tokens, lengths

  def decode(self, samples: Samples) -> list[str]:
    return self.tokenizer.decode_batch(np.asarray(samples.tokens))
