"""An inference worker: holds a weight version, reloads from the parameter server, generates.

The worker is passive (the controller calls it) and speaks typed requests and results only:
``generate(requests, rng) -> Rollouts``. It tokenizes prompts with the model's tokenizer
(chat messages through the checkpoint's chat template), samples from the policy
(``rlax_llm.policy``) and returns each completion whole: tokens, behaviour log-probs, the
version of every token, finish reason, decoded text and timings.

Reload staleness ``j`` (RLAX, docs/architecture.md): ``maybe_reload`` pulls new weights when the
server is at least ``j`` versions ahead of the weights held. Params live on the worker's own
``inference`` mesh with the shardings the logical-axis rules give there (the same rules as
the trainer's), and prompts are sharded along ``batch``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from rlax_llm import sharding as sharding_lib
from rlax_llm.data_types import GenerationRequest, Rollouts
from rlax_llm.models.model import Model
from rlax_llm.paramserver import ParameterServer
from rlax_llm.policy import Policy, SamplingSpec
from rlax_llm.rollout.sampler import generate
from rlax_llm.tokenization import Tokenizer, encode_prompt


class InferenceWorker:
  """Generates completions with the latest weights it has pulled.

  Args:
    model: the decoder.
    tokenizer: the model's tokenizer (encodes prompts, decodes completions).
    mesh: the inference mesh.
    max_prompt_len: prompts are right-padded to this many tokens (bos or chat template
      included), so every batch has one shape and generation compiles once per sampling
      spec and length.
    rules: logical-axis rules placing the params on ``mesh``.
  """

  def __init__(self, model: Model, tokenizer: Tokenizer, mesh: Mesh, max_prompt_len: int, *,
               rules: Sequence[tuple[str, Any]] = sharding_lib.LOGICAL_RULES):
    self.model = model
    self.tokenizer = tokenizer
    self.mesh = mesh
    self.max_prompt_len = max_prompt_len
    self.param_shardings = sharding_lib.param_shardings(
        model.abstract_params(), model.logical_axes(), mesh, rules)
    self.version = -1
    self.params = None
    self.reloads = 0

  def load(self, version: int, params) -> None:
    """Installs weights (host or device arrays) of ``version``, sharded on the mesh."""
    self.params = jax.device_put(params, self.param_shardings)
    self.version = int(version)
    self.reloads += 1

  def maybe_reload(self, server: ParameterServer, j: int) -> bool:
    """Pulls the latest weights if the server is ``>= j`` versions ahead (or none are held).

    Returns True if it reloaded.
    """
    if isinstance(j, bool) or not isinstance(j, int) or j < 1:
      raise ValueError(f'reload threshold j={j!r} must be an int >= 1.')
    latest = server.latest_version()
    if latest < 0:
      raise LookupError('the parameter server holds no weights yet; push version 0 first.')
    if self.params is None or latest - self.version >= j:
      snapshot = server.pull(min_version=latest)
      self.load(snapshot.version, snapshot.params)
      return True
    return False

  def encode(self, requests: Sequence[GenerationRequest]) -> tuple[np.ndarray, np.ndarray]:
    """Prompt ids of each request, right-padded: ``(int32 [R, max_prompt_len], int32 [R])``.

    Raises ValueError naming the prompt when one is empty or longer than ``max_prompt_len``.
    """
    tokens = np.full((len(requests), self.max_prompt_len), self.tokenizer.pad_id, np.int32)
    lengths = np.zeros(len(requests), np.int32)
    for row, request in enumerate(requests):
      prompt = request.prompt
      ids = encode_prompt(self.tokenizer, messages=prompt.messages) if prompt.messages else (
          encode_prompt(self.tokenizer, text=prompt.text))
      if not ids or len(ids) > self.max_prompt_len:
        raise ValueError(
            f'prompt {prompt.prompt_id} encodes to {len(ids)} tokens; it must have between 1 '
            f'and max_prompt_len={self.max_prompt_len} (raise sampling.max_prompt_len): '
            f'{(prompt.messages or prompt.text)!r}')
      tokens[row, :len(ids)] = ids
      lengths[row] = len(ids)
    return tokens, lengths

  def generate(self, requests: Sequence[GenerationRequest], rng: jax.Array) -> Rollouts:
    """Samples every request; rows of request ``i`` are contiguous with group id ``i``.

    All requests of one call must share ``sampling`` and ``max_new_tokens`` (one static
    batch). The same weights, requests and ``rng`` give the same rollouts.
    """
    if self.params is None:
      raise RuntimeError('InferenceWorker has no weights; call load() or maybe_reload() first.')
    if not requests:
      raise ValueError('generate needs at least one request.')
    sampling: SamplingSpec = requests[0].sampling
    max_new = requests[0].max_new_tokens
    for request in requests:
      if (request.sampling, request.max_new_tokens) != (sampling, max_new):
        raise ValueError(
            'all requests of one generate call must share sampling and max_new_tokens; got '
            f'{request.sampling}/{request.max_new_tokens} and {sampling}/{max_new}.')
    if self.max_prompt_len + max_new > self.model.config.max_seq_len:
      raise ValueError(
          f'max_prompt_len ({self.max_prompt_len}) + max_new_tokens ({max_new}) exceeds the '
          f'model max_seq_len ({self.model.config.max_seq_len}).')
    start = time.perf_counter()
    tokens, lengths = self.encode(requests)
    counts = np.asarray([r.num_samples for r in requests])
    tokens = np.repeat(tokens, counts, axis=0)
    lengths = np.repeat(lengths, counts, axis=0)
    shardings = sharding_lib.batch_sharding(self.mesh, {'t': tokens, 'l': lengths})
    samples = generate(Policy(self.model, sampling), self.params,
                       jax.device_put(tokens, shardings['t']),
                       jax.device_put(lengths, shardings['l']), rng, self.version,
                       max_new_tokens=max_new, eos_id=self.tokenizer.eos_id,
                       pad_id=self.tokenizer.pad_id)
    samples = jax.device_get(samples)
    generate_s = time.perf_counter() - start
    completion_tokens = np.asarray(samples.tokens)
    return Rollouts(
        prompt_ids=np.repeat([r.prompt.prompt_id for r in requests], counts).astype(np.int64),
        group_ids=np.repeat(np.arange(len(requests), dtype=np.int32), counts),
        prompt_tokens=tokens, prompt_lengths=lengths,
        completion_tokens=completion_tokens,
        completion_mask=np.asarray(samples.mask),
        behaviour_logprobs=np.asarray(samples.logprobs),
        versions=np.asarray(samples.versions),
        finish_reasons=np.where(np.asarray(samples.finished), 'stop', 'length'),
        completions=self.tokenizer.decode_batch(completion_tokens),
        sampling=sampling,
        timings={'generate_s': generate_s,
                 'tokens_per_s': float(np.asarray(samples.lengths).sum()) / generate_s})
