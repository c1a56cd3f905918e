"""An inference worker: holds a weight version, pulls versions from the parameter server,
generates.

The worker is passive (the controller calls it) and speaks typed requests and results only:
``generate(requests, rng) -> Rollouts``; ``generate_at(version, fetch, ...)`` first holds the
version the controller names (a version number, never weights), which its ``receiver``
(``rlax_llm.paramserver.receiver.Receiver``) pulls from the parameter server unless held,
through ``fetch`` (the backend's way to reach the server), checking every leaf against the
checksum the server took when the trainer pushed it; under LoRA's adapter-only sync it
merges each version's adapters into the base it pulled once. The worker tokenizes prompts
with the model's tokenizer (chat messages through the checkpoint's chat template), runs them
through the continuous-batching driver (``rlax_llm.rollout.driver``) over the JetStream-API
engine (``rlax_llm.rollout.engine``), and returns each completion whole: tokens, behaviour
log-probs, the version of every token, finish reason, restarts, decoded text and timings.

Reload staleness ``j`` (RLAX, docs/architecture.md): the deterministic schedule names the
version (``generate_at(version)``). In free-running mode (``generate_at`` given
``FollowLatest(j)`` and the backend's ``latest`` callable) the receiver pulls the server's
newest version whenever it is at least ``j`` versions ahead of the one held
(``Receiver.follow``), before generating and between any two decode steps, so a version
pushed while a batch is generated enters it mid-sequence (the driver's per-step swap; every
token keeps the version that drew it). ``load`` installs whole params directly (a version
that no server holds: evaluation, serving a checkpoint); the driver reads the params before
every decode step. Params live on the worker's own ``inference`` mesh with the shardings the
logical-axis rules give there (the same rules as the trainer's).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from rlax_llm import sharding as sharding_lib
from rlax_llm.data_types import FollowLatest, GenerationRequest, Rollouts, Trajectory
from rlax_llm.models import lora as lora_lib
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import Model
from rlax_llm.models.moe import NO_ROUTE, route_dtype
from rlax_llm.paramserver.receiver import Fetch, FetchBase, Latest, Receiver
from rlax_llm.rollout.driver import Driver, Job, Sample, VersionedParams
from rlax_llm.rollout.engine import Engine
from rlax_llm.rollout.episodes import Episode, EpisodeRunner
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.tokenization import Tokenizer, encode_prompts


class InferenceWorker:
  """Generates completions with the latest weights it has pulled.

  Args:
    model: the decoder.
    tokenizer: the model's tokenizer (encodes prompts, decodes completions).
    mesh: the inference mesh.
    max_prompt_len: the longest prompt in tokens (bos or chat template included); the
      engine's largest prefill bucket.
    max_new_tokens: the most tokens a request may generate.
    slots: concurrent sequences of the engine (``max_concurrent_decodes``).
    on_swap: what a weight swap does to sequences in flight (``'continue'``/``'discard'``).
    prefill_buckets: prompt length buckets (default: ``engine.default_buckets``).
    rules: logical-axis rules placing the params on ``mesh``.
    quant: ``'none'`` or ``'int8'`` (``model.inference_quant``): the engine samples with an
      int8 copy of each version it loads (``Engine``); its receiver still holds, verifies and
      applies deltas to the params it pulls, unquantised.
    kv_cache_quant: ``'none'`` or ``'int8'`` (``model.kv_cache_quant``): the engine's KV
      cache in int8 with per-(token, kv head) scales (``Engine``).
    layer_loop: how the engine runs the layers, ``'auto'``, ``'scan'`` or ``'unrolled'``
      (``rollout.layer_loop``, ``Engine``).
    lora: with ``fetch_base``, the trainer's adapters under adapter-only sync
      (``paramserver.publisher.adapter_sync``): the versions pulled are adapter trees, merged
      into the base pulled once through ``fetch_base`` (``Receiver``). None: the versions
      are the model's params.
    fetch_base: the backend's way to pull that base (``FetchBase``).
    record_routes: a mixture of experts under ``model.routing_replay='r3'``: the rollouts
      carry the experts every prompt and completion token was routed to
      (``Rollouts.prompt_routes``/``completion_routes``, ``Engine``).
  """

  def __init__(self, model: Model, tokenizer: Tokenizer, mesh: Mesh, *, max_prompt_len: int,
               max_new_tokens: int, slots: int = 32, on_swap: str = 'continue',
               prefill_buckets: Sequence[int] | None = None,
               rules: Sequence[tuple[str, Any]] = sharding_lib.LOGICAL_RULES,
               quant: str = 'none', lora: lora_lib.LoRAConfig | None = None,
               fetch_base: FetchBase | None = None, kv_cache_quant: str = 'none',
               layer_loop: str = 'auto', record_routes: bool = False):
    self.model = model
    self.tokenizer = tokenizer
    self.mesh = mesh
    self.max_prompt_len = max_prompt_len
    self.engine = Engine(model, mesh, slots=slots, max_prefill_length=max_prompt_len,
                         max_decode_length=max_new_tokens, pad_id=tokenizer.pad_id,
                         prefill_buckets=prefill_buckets, rules=rules, quant=quant,
                         kv_cache_quant=kv_cache_quant, layer_loop=layer_loop,
                         record_routes=record_routes)
    self.holder = VersionedParams()
    self.driver = Driver(self.engine, self.holder, on_swap=on_swap)
    self.reloads = 0
    place_base = None
    if lora is not None:
      shardings = sharding_lib.param_shardings(model.abstract_params(), model.logical_axes(),
                                               mesh, rules)

      def place_base(base):
        self.engine.check_params(base, placed=False)
        return jax.device_put(base, shardings)
    self.receiver = Receiver(model, self._swap_in, lora=lora, fetch_base=fetch_base,
                             place_base=place_base)

  @property
  def version(self) -> int:
    """The version of the weights held (-1: none)."""
    return self.holder.version

  @property
  def params(self):
    return None if self.holder.version < 0 else self.holder.get()[1]

  def _swap_in(self, version: int, params) -> None:
    """The receiver's ``Install``: ``params`` sharded on the mesh (checked first: a tree that
    is not the model's raises ValueError and changes nothing), used by the driver from its
    next decode step on."""
    placed = self.engine.place_params(params)
    self.holder.set(version, placed)
    self.reloads += 1

  def load(self, version: int, params) -> None:
    """Installs whole params (host or device arrays) of ``version`` (``Receiver.load``):
    weights no server holds, e.g. a checkpoint to evaluate or serve. Params that are not the
    model's raise ValueError and leave the held version (and the base of the next delta) as
    it was."""
    self.receiver.load(version, params)

  def generate_at(self, version: int | FollowLatest, fetch: Fetch,
                  requests: Sequence[GenerationRequest], rng: jax.Array,
                  stop_after: int | None = None, first: int = 0,
                  latest: Latest | None = None) -> Rollouts:
    """``generate`` with the weights of ``version``, pulled first unless held
    (``Receiver.ensure``).

    ``version=FollowLatest(j)`` (free-running mode; needs ``latest``): pulls the server's
    latest version whenever it is ``j`` or more ahead of the one held (``Receiver.follow``):
    before generating and before every decode step, where the driver swaps it in. The
    pulls' figures (``Receiver.pull``) are added up into the rollouts' ``timings`` (their
    ``sync/`` keys; none when no pull was needed)."""
    pulled = collections.Counter()
    refresh = None
    if isinstance(version, FollowLatest):
      if latest is None:
        raise ValueError('generate_at(FollowLatest(...)) needs latest, the way to ask the '
                         "parameter server for its newest version (the backend's).")

      def refresh():
        pulled.update(self.receiver.follow(latest, version.j, fetch))
      refresh()
    else:
      pulled.update(self.receiver.ensure(version, fetch))
    rollouts = self.generate(requests, rng, stop_after, first, refresh=refresh)
    return dataclasses.replace(rollouts, timings={**rollouts.timings, **pulled})

  def play_at(self, version: int, fetch: Fetch, episodes: Sequence[Episode],
              spec: SamplingSpec, *, max_concurrent_episodes: int, max_turn_tokens: int,
              timeout_s: float, max_turns: int | None = None
              ) -> tuple[list[Trajectory], dict[str, float]]:
    """Plays multi-turn ``episodes`` (``rlax_llm.rollout.episodes.EpisodeRunner``, its
    arguments) with the weights of ``version``, pulled first unless held
    (``Receiver.ensure``), in this worker's engine slots and KV cache. Returns one
    ``Trajectory`` per episode, in order, and the runner's ``stats`` plus the pull's figures
    (``sync/`` keys; none when no pull was needed)."""
    pulled = self.receiver.ensure(version, fetch)
    runner = EpisodeRunner(self.engine, self.holder, self.tokenizer,
                           max_concurrent_episodes=max_concurrent_episodes,
                           max_turn_tokens=max_turn_tokens, timeout_s=timeout_s,
                           max_turns=max_turns, state=self.driver.state)
    try:
      trajectories = runner.run(episodes, spec)
    finally:
      self.driver.state = runner.state  # the engine donated the driver's: one cache
    return trajectories, {**runner.stats, **pulled}

  def encode(self, request: GenerationRequest) -> list[int]:
    """The prompt's ids; raises ValueError naming the prompt when it is empty or longer than
    ``max_prompt_len``."""
    prompt = request.prompt
    ids = encode_prompts(self.tokenizer, [prompt])[0]
    if not ids or len(ids) > self.max_prompt_len:
      raise ValueError(
          f'prompt {prompt.prompt_id} encodes to {len(ids)} tokens; it must have between 1 '
          f'and max_prompt_len={self.max_prompt_len} (raise sampling.max_prompt_len): '
          f'{(prompt.messages or prompt.text)!r}')
    return ids

  def generate(self, requests: Sequence[GenerationRequest], rng: jax.Array,
               stop_after: int | None = None, first: int = 0,
               refresh: Callable[[], None] | None = None) -> Rollouts:
    """Samples every request; rows of request ``i`` are contiguous with group id ``i``.

    Sample ``s`` of request ``i`` draws with the key ``fold_in(fold_in(rng, first + i), s)``
    (``first``: the index of ``requests[0]`` in a batch split over several workers), so the
    same weights, requests and ``rng`` give the same rollouts however the driver batches
    them and however a batch is split between workers. Requests with different sampling
    specs run one spec after the other.

    ``stop_after`` (APRIL partial rollouts): stop once that many requests have every sample
    finished; the rows of the others may come back ``'unfinished'`` (pass them as a
    request's ``resume`` to continue them with their own keys). A ``resume`` request keeps
    its rows' keys and prompt tokens.

    ``refresh``: called before every decode step (``Driver.run``); it may load new weights,
    which the driver swaps in from that step on (free-running mode, ``generate_at``).
    """
    if self.version < 0:
      raise RuntimeError('InferenceWorker has no weights; load() or pull them first '
                         '(generate_at, receiver.pull).')
    if not requests:
      raise ValueError('generate needs at least one request.')
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
      raise ValueError(f'first={first!r} must be an int >= 0 (the index of requests[0] in its '
                       'batch).')
    start = time.perf_counter()
    stop = (self.tokenizer.eos_id,)
    jobs, prompts = [], []
    for i, request in enumerate(requests):
      resume = request.resume
      if resume is None:
        ids = self.encode(request)
        request_key = jax.random.fold_in(rng, first + i)
        keys = np.stack([np.asarray(jax.random.key_data(jax.random.fold_in(request_key, s)))
                         for s in range(request.num_samples)])
        samples = None
      else:
        ids = resume.prompt_tokens[0, :resume.prompt_lengths[0]].tolist()
        keys = np.asarray(resume.sample_keys, np.uint32)
        samples = tuple(self._sample(resume, row) for row in range(len(resume)))
      prompts.append(ids)
      jobs.append(Job(prompt_ids=tuple(ids), num_samples=request.num_samples,
                      sampling=request.sampling, max_new_tokens=request.max_new_tokens,
                      stop_ids=tuple(dict.fromkeys(stop + tuple(request.stop_token_ids))),
                      keys=keys, resume=samples))
    results = self.driver.run(jobs, stop_after, refresh)
    return self._rollouts(requests, prompts, results, [job.keys for job in jobs],
                          time.perf_counter() - start)

  @staticmethod
  def _sample(rows: Rollouts, row: int) -> Sample:
    """Row ``row`` of ``rows`` as the driver's ``Sample`` (to be kept or continued)."""
    n = int(rows.completion_mask[row].sum())
    reason = str(rows.finish_reasons[row])
    routes = {}
    if rows.completion_routes is not None:  # the recorded ones: all fed tokens'
      fed = rows.completion_routes[row, :n]
      routes = dict(prompt_routes=rows.prompt_routes[row, :int(rows.prompt_lengths[row])],
                    routes=list(fed[fed[:, 0, 0] >= 0]))
    return Sample(**routes,tokens=rows.completion_tokens[row, :n].tolist(),
                  logprobs=rows.behaviour_logprobs[row, :n].tolist(),
                  supports=rows.support_sizes[row, :n].tolist(),
                  versions=rows.versions[row, :n].tolist(),
                  finish_reason=None if reason == 'unfinished' else reason,
                  restarts=0 if rows.restarts is None else int(rows.restarts[row]))

  def _rollouts(self, requests, prompts, results, keys, generate_s) -> Rollouts:
    counts = [r.num_samples for r in requests]
    b = sum(counts)
    width = max(r.max_new_tokens for r in requests)
    pad = self.tokenizer.pad_id
    prompt_tokens = np.full((b, self.max_prompt_len), pad, np.int32)
    prompt_lengths = np.zeros(b, np.int32)
    tokens = np.full((b, width), pad, np.int32)
    mask = np.zeros((b, width), bool)
    logprobs = np.zeros((b, width), np.float32)
    supports = np.zeros((b, width), np.int32)
    versions = np.full((b, width), -1, np.int32)
    finish, restarts = [], np.zeros(b, np.int32)
    row = 0
    for ids, samples in zip(prompts, results):
      for sample in samples:
        n = len(sample.tokens)
        prompt_tokens[row, :len(ids)] = ids
        prompt_lengths[row] = len(ids)
        tokens[row, :n] = sample.tokens
        mask[row, :n] = True
        logprobs[row, :n] = sample.logprobs
        supports[row, :n] = sample.supports
        versions[row, :n] = sample.versions
        finish.append(sample.finish_reason or 'unfinished')
        restarts[row] = sample.restarts
        row += 1
    routes = {}
    if self.engine.record_routes:
      samples = [sample for group in results for sample in group]
      routes = dict(zip(('prompt_routes', 'completion_routes'), pack_routes(
          samples, self.engine.model.config, self.max_prompt_len, width)))
    stats = self.driver.stats
    carried = sum(int(r.resume.completion_mask.sum()) for r in requests if r.resume is not None)
    generated = int(mask.sum()) - carried  # by this call
    specs = {r.sampling for r in requests}
    return Rollouts(
        prompt_ids=np.repeat([r.prompt.prompt_id for r in requests], counts).astype(np.int64),
        group_ids=np.repeat(np.arange(len(requests), dtype=np.int32), counts),
        prompt_tokens=prompt_tokens, prompt_lengths=prompt_lengths,
        completion_tokens=tokens, completion_mask=mask, behaviour_logprobs=logprobs,
        support_sizes=supports, versions=versions, finish_reasons=np.asarray(finish),
        completions=self.tokenizer.decode_batch(tokens),
        sampling=specs.pop() if len(specs) == 1 else None,
        timings={'generate_s': generate_s, 'tokens_per_s': generated / generate_s,
                 'prefill_s': stats.get('prefill_s', 0.0),
                 'decode_s': stats.get('decode_s', 0.0),
                 'decode_steps': stats.get('steps', 0.0),
                 'slot_occupancy': stats.get('slot_steps', 0.0) / max(
                     1.0, stats.get('steps', 0.0) * self.engine.slots)},
        restarts=restarts, on_swap=self.driver.on_swap,
        sample_keys=np.concatenate(keys).astype(np.uint32), **routes)


def pack_routes(samples: Sequence[Sample], config: DecoderConfig, prompt_width: int,
                width: int) -> tuple[np.ndarray, np.ndarray]:
  """The routes an engine recorded for ``samples`` (``Sample.prompt_routes`` and
  ``Sample.routes``) as ``Rollouts.prompt_routes`` ``[B, prompt_width, layers, k]`` and
  ``Rollouts.completion_routes`` ``[B, width, layers, k]`` in ``moe.route_dtype``,
  ``moe.NO_ROUTE`` where none was recorded."""
  shape = (len(samples),)
  per_token = (config.num_moe_layers, config.num_experts_per_tok)
  dtype = route_dtype(config.num_experts)
  prompt = np.full(shape + (prompt_width,) + per_token, NO_ROUTE, dtype)
  completion = np.full(shape + (width,) + per_token, NO_ROUTE, dtype)
  for row, sample in enumerate(samples):
    if sample.prompt_routes is not None:
      prompt[row, :len(sample.prompt_routes)] = sample.prompt_routes
    if sample.routes:  # a one-token sample fed none
      completion[row, :len(sample.routes)] = sample.routes
  return prompt, completion
