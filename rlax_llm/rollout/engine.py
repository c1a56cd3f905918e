"""The generation engine: our decoder behind JetStream's Engine semantics.

JetStream (``jetstream/engine/engine_api.py``) splits serving into three device programs over
a fixed set of KV-cache *slots*; rlax_llm's engine keeps that shape:

* ``prefill(params, prompts) -> Prefix``: the prompts' keys/values and the logits of each
  one's last token, for a batch of prompts at once. Prompts are right-padded to a length
  *bucket* (``prefill_buckets``, the largest being ``max_prefill_length``) and the batch to a
  power of two, so each (batch, length) bucket compiles once.
* ``insert(prefix, state, inserts, spec) -> (state, StepResult)``: copies prefix rows into
  slots and samples each new slot's first token from its prefix row's logits. Several slots
  may take the same row (``n`` samples share one prefill); one call inserts up to ``slots``
  samples.
* Continuation (APRIL's partial rollouts, rlax_llm.rollout.driver): a sample cut short after
  drawing ``t`` tokens is resumed by prefilling its prompt *and* those tokens
  (``prefill(..., continuation=True)``, longer length buckets up to the cache length) and
  inserting it with ``Insert.offset = t``: its next token is drawn with ``fold_in(key, t)``,
  exactly the key it would have used uninterrupted, and its budget is what is left.
* ``extend(params, state, extends, spec) -> (state, StepResult)`` (multi-turn episodes,
  rlax_llm.rollout.episodes): appends new tokens to a slot that stopped (its last sampled
  token, then an environment's observation) by prefilling *only those tokens* at the slot's
  current cache position, over the keys/values already there, and samples the slot's next
  turn's first token: a conversation's KV cache is kept across its turns.
* ``generate(params, state, spec) -> (state, StepResult)``: one decode step for every slot:
  feed each slot's last token, sample the next from the policy, write its key/value.

Rollout routing replay (``record_routes``, a mixture of experts): a prefill returns the
experts each prompt token was routed to (``Prefix.routes``) and a decode step those of the
token each slot fed (``HostStep.routes``: the token the slot sampled the step before), so
the driver records every token's routing but a sample's last (never fed), which the trainer
then replays (``rlax_llm.models.moe.replay``).

JetStream's own signatures (one prompt per prefill, one slot per insert) are the batch-1
case; ``rlax_llm.rollout.jetstream_adapter`` wraps them for JetStream's orchestrator.

The decode state is donated to ``insert`` and ``generate``, so the cache is updated in place.
``params`` is an argument of every call (never captured), so a new weight version enters
between two steps without recompiling; ``compilations()`` counts what was compiled.

Randomness is per sample, not per slot or step: the ``t``-th token of a sample is drawn with
``fold_in(sample_key, t)``, so a sample's tokens do not depend on which slot it runs in, on
what else is batched with it, or on when it was scheduled.

A slot is *active* while ``remaining > 0``: tokens it may still sample. A step samples a
token for every active slot; sampling a stop token or reaching ``max_new_tokens`` sets
``remaining`` to 0. Inactive slots run through the step too (fixed shapes) but neither
advance nor produce tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlax_llm import sharding as sharding_lib
from rlax_llm.models import cpu_attention
from rlax_llm.models.decoder import head_is_vocab_major
from rlax_llm.models.decoder_config import LAYER_LOOPS, LAYERS_AXIS
from rlax_llm.models.kv_cache import (ATTEND_BUCKETS, BLOCK_ALIGN, KEY_BLOCK_AXES,
                                      KEY_POSITION_AXIS, KV_CACHE_QUANT_MODES, LAYERED,
                                      VALUE_BLOCK_AXES, VALUE_POSITION_AXIS, KVCache,
                                      block_layout, cache_block_shape)
from rlax_llm.models.model import Model, Params, to_weight_layout, with_weight_layout
from rlax_llm.models.moe import NO_ROUTE
from rlax_llm.models.quant import QUANT_MODES, quantize_params, quantized_shardings
from rlax_llm.paramserver.shards import leaf_specs
from rlax_llm.policy import sample_rows
from rlax_llm.sampling_spec import SamplingSpec

MAX_STOP_IDS = 8  # stop tokens per request (eos included)


@flax.struct.dataclass
class Prefix:
  """``K`` prefilled prompts (rows): keys ``[layers, K, kv_heads, head_dim, bucket]`` and
  values ``[layers, K, kv_heads, bucket, head_dim]`` (a one-block ``KVCache``'s layouts),
  true lengths and the float32 logits ``[K, V]`` of each prompt's last token. An engine
  whose layers run unrolled (``Engine.layer_loop``) holds the keys and values per layer
  instead: tuples of ``[K, kv_heads, head_dim, bucket]`` and ``[K, kv_heads, bucket,
  head_dim]``."""

  k: jax.Array | tuple[jax.Array, ...]
  v: jax.Array | tuple[jax.Array, ...]
  lengths: jax.Array  # int32 [K]
  logits: jax.Array  # float32 [K, V]
  # An int8 cache's (``kv_cache_quant='int8'``) float32 scales, like k and v with head_dim
  # 1; None (per layer: ()) if not.
  k_scale: jax.Array | tuple[jax.Array, ...] | None = None
  v_scale: jax.Array | tuple[jax.Array, ...] | None = None
  # ``record_routes``: the experts each token was routed to, ``[K, bucket, layers, k]`` in
  # ``moe.route_dtype`` (``moe.NO_ROUTE`` past a row's length); None if not recorded.
  routes: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Insert:
  """Put prefix row ``row`` into ``slot``: a sample with its own key, length cap and stops."""

  row: int
  slot: int
  key: np.ndarray  # uint32 [key_size] key data
  max_new_tokens: int
  stop_ids: tuple[int, ...]
  offset: int = 0  # tokens the sample drew before (a continuation; the row holds them)


@dataclasses.dataclass(frozen=True)
class Extend:
  """Append ``tokens`` to ``slot``'s cache (it holds ``start`` positions) and start a new
  sample there: its own key, length cap and stops, as ``Insert``."""

  slot: int
  start: int  # positions the slot's cache holds (the caller's bookkeeping; checked on host)
  tokens: tuple[int, ...]  # the new ids, non-empty
  key: np.ndarray  # uint32 [key_size] key data
  max_new_tokens: int
  stop_ids: tuple[int, ...]
  offset: int = 0


@flax.struct.dataclass
class DecodeState:
  """What ``generate`` transforms; ``S`` slots, cache length ``L``."""

  cache: KVCache  # per block, stacked over the layers (or per layer, then per block):
  # k [(L,) S, kv, d, block] ([.., S, kv, block, d] if batch_invariant), v [(L,) S, kv, block, d]
  tokens: jax.Array  # int32 [S]: the token each slot feeds next
  keys: jax.Array  # uint32 [S, key_size]: each slot's sample key data
  positions: jax.Array  # int32 [S]: tokens the slot's sample has drawn so far
  remaining: jax.Array  # int32 [S]: tokens it may still draw; 0 = inactive
  stop_ids: jax.Array  # int32 [S, MAX_STOP_IDS]: -1 padded


@flax.struct.dataclass
class StepResult:
  """One step's output per slot (JetStream's ``ResultTokens``, with log-probs), packed in one
  int32 ``[S, 5]`` array so that a single device-to-host copy brings it back: columns
  token (pad where not valid), behaviour log-prob (float32 bits; 0 where not valid), support
  size, valid (the slot was active and sampled a token), done (it finished at this step);
  with ``record_routes``, ``layers x k`` more columns: the experts the token the slot fed
  was routed to (``moe.NO_ROUTE`` where it fed none)."""

  data: jax.Array
  route_shape: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
  # ``extend`` with ``record_routes``: the experts of the tokens it appended, ``[R, width,
  # layers, k]`` (row ``i``: ``extends[i].tokens``, ``moe.NO_ROUTE`` past them).
  prefilled: jax.Array | None = None

  @classmethod
  def pack(cls, tokens, logprobs, supports, valid, done, routes=None) -> 'StepResult':
    bits = jax.lax.bitcast_convert_type(logprobs.astype(jnp.float32), jnp.int32)
    columns = jnp.stack([tokens.astype(jnp.int32), bits, supports.astype(jnp.int32),
                         valid.astype(jnp.int32), done.astype(jnp.int32)], axis=1)
    if routes is None:
      return cls(columns)
    flat = routes.reshape(routes.shape[0], -1).astype(jnp.int32)
    return cls(jnp.concatenate([columns, flat], axis=1), tuple(routes.shape[1:]))

  def to_host(self) -> 'HostStep':
    data = np.asarray(jax.device_get(self.data))
    routes = (data[:, 5:].reshape((len(data),) + self.route_shape).astype(np.int16)
              if self.route_shape else None)
    prefilled = (None if self.prefilled is None
                 else np.asarray(jax.device_get(self.prefilled)).astype(np.int16))
    return HostStep(tokens=data[:, 0], logprobs=data[:, 1].view(np.float32),
                    supports=data[:, 2], valid=data[:, 3].astype(bool),
                    done=data[:, 4].astype(bool), routes=routes, prefilled=prefilled)


@dataclasses.dataclass(frozen=True)
class HostStep:
  """``StepResult`` on the host: numpy ``[S]`` arrays."""

  tokens: np.ndarray
  logprobs: np.ndarray
  supports: np.ndarray
  valid: np.ndarray
  done: np.ndarray
  routes: np.ndarray | None = None  # int16 [S, layers, k] (record_routes): the fed token's
  #   experts, NO_ROUTE where a slot fed none
  prefilled: np.ndarray | None = None  # int16 [R, width, layers, k]: extend's tokens' experts


def default_buckets(max_prefill_length: int) -> tuple[int, ...]:
  """Prompt length buckets: multiples of 8 up to 32, then four per octave (40, 48, 56, 64,
  80, 96, 112, 128, 160, ...), then ``max_prefill_length``: a prompt is padded by at most a
  quarter past 32 tokens, and the number of compiled prefill programs grows with the log of
  the longest prompt."""
  if max_prefill_length < 1:
    raise ValueError(f'max_prefill_length={max_prefill_length} must be >= 1.')
  buckets, size = [], 8
  while size < max_prefill_length:
    buckets.append(size)
    size += max(8, 1 << (size.bit_length() - 3))
  return (*buckets, max_prefill_length)


class Engine:
  """Prefill / insert / generate over ``slots`` KV-cache slots on the inference ``mesh``.

  Args:
    model: the decoder.
    mesh: the inference mesh; params take the logical-axis shardings on it, slots are split
      over ``data`` x ``fsdp`` and KV heads over ``tensor``.
    slots: concurrent sequences (JetStream's ``max_concurrent_decodes``).
    max_prefill_length: the longest prompt, in tokens (the largest bucket).
    max_decode_length: the most tokens a sample may generate.
    pad_id: the token a step reports for inactive slots.
    prefill_buckets: sorted prompt length buckets ending at ``max_prefill_length`` (default:
      ``default_buckets``).
    attend_buckets: at most how many blocks the KV cache is kept in (each a multiple of
      ``block_align`` positions); a decode step attends to the fewest leading blocks that
      hold every active sequence (each count compiles once). 1 always attends to the whole
      cache. A ``batch_invariant`` model keeps its cache in blocks of ``INVARIANT_KEYS``
      positions whatever this is; a step still attends to one of these buckets.
    block_align: block lengths are multiples of it (``BLOCK_ALIGN``, 32, suits XLA:CPU;
      TPUs may prefer 128).
    weight_layout: the layout the engine keeps its params in (``Execution.weight_layout``;
      ``place_params`` converts to it). Default: ``'out_in'`` on XLA:CPU, where a decode
      step's weight products run faster that way (``numerics.flipped_product``), unless the
      model is ``batch_invariant`` (its log-probs must match the trainer's bit for bit,
      and the trainer's params are ``'in_out'``); else the model's own.
    decode_attention: how decode steps of two or more slots attend
      (``Execution.decode_attention``). Default: ``'cpu_kernel'`` (the compiled kernel of
      ``rlax_llm.models.cpu_attention``) on XLA:CPU with a one-device mesh, two or more
      slots, float32 and a shape it supports, when it builds here; else the model's own.
      ``decode_attention_note`` records the choice and, if not the kernel, why.
    quant: ``'none'``, or ``'int8'``: ``place_params`` turns the attention and MLP weights
      into int8 with per-output-channel scales (``models.quant.quantize_params``; the
      embedding and lm head stay in the model's param dtype), and the engine samples, and
      records behaviour log-probs, with that quantised policy.
    kv_cache_quant: ``'none'``, or ``'int8'``: the KV cache holds int8 keys and values with a
      float32 scale per (token, kv head) (``models.kv_cache.quantize_kv``), written
      quantised by prefill, extend and decode steps and read dequantised, so the behaviour
      log-probs are those of attention over the dequantised keys and values. Decode steps
      then attend with XLA (the CPU kernel reads float blocks only): unset
      ``decode_attention`` falls back to it; ``'cpu_kernel'`` is refused.
    layer_loop: how the engine runs the decoder's layers (``Execution.layer_loop``):
      ``'scan'``, the params' stacked blocks and a KV cache stacked over the layers, run by
      one ``jax.lax.scan`` (one layer compiled, whatever the depth); ``'unrolled'``: each
      layer's weights and cache blocks in their own buffers, a Python loop over the layers
      (``place_params`` unstacks each version once). ``'auto'`` (default): ``'unrolled'``
      when the mesh's devices are CPUs (XLA:CPU copies every per-layer slice of a stacked
      weight inside the scan's loop before its dot: a SmolLM2-135M decode step ran 1.8-1.95x
      slower scanned, docs/models.md "The layer loop") unless the model is
      ``batch_invariant`` (its log-probs must equal the trainer's scanned forward's bit for
      bit, and the two loops compile to different fusions); else ``'scan'`` (accelerators
      read the slice in the dot; compile time independent of depth matters there).
    record_routes: a mixture of experts only: record each token's experts for routing
      replay (``Prefix.routes``, ``HostStep.routes``; ``model.routing_replay='r3'``).
  """

  def __init__(self, model: Model, mesh: Mesh, *, slots: int, max_prefill_length: int,
               max_decode_length: int, pad_id: int,
               prefill_buckets: Sequence[int] | None = None,
               attend_buckets: int = ATTEND_BUCKETS,
               block_align: int = BLOCK_ALIGN,
               rules: Sequence[tuple[str, Any]] = sharding_lib.LOGICAL_RULES,
               weight_layout: str | None = None, decode_attention: str | None = None,
               quant: str = 'none', kv_cache_quant: str = 'none', layer_loop: str = 'auto',
               record_routes: bool = False):
    if record_routes and not model.config.is_moe:
      raise ValueError('record_routes=True records the experts of a mixture of experts, but '
                       f'the model is dense (num_experts={model.config.num_experts}); pass '
                       'record_routes=False.')
    self.record_routes = bool(record_routes)
    if kv_cache_quant not in KV_CACHE_QUANT_MODES:
      raise ValueError(f'kv_cache_quant={kv_cache_quant!r} is not a KV cache quantisation; '
                       f'choose one of {list(KV_CACHE_QUANT_MODES)}.')
    if kv_cache_quant != 'none' and model.config.execution.batch_invariant:
      raise ValueError(f'kv_cache_quant={kv_cache_quant!r} attends to quantised keys and '
                       'values, so a batch_invariant model\'s log-probs would not equal the '
                       'trainer\'s; pass kv_cache_quant=\'none\'.')
    self.kv_cache_quant = kv_cache_quant
    if quant not in QUANT_MODES:
      raise ValueError(f'quant={quant!r} is not an engine quantisation; choose one of '
                       f'{list(QUANT_MODES)}.')
    if quant != 'none' and model.config.execution.batch_invariant:
      raise ValueError(f'quant={quant!r} samples with quantised weights, so a batch_invariant '
                       'model\'s log-probs would not equal the trainer\'s; pass quant=\'none\'.')
    if min(slots, max_decode_length, attend_buckets, block_align) < 1:
      raise ValueError(f'slots ({slots}), max_decode_length ({max_decode_length}), '
                       f'attend_buckets ({attend_buckets}) and block_align ({block_align}) '
                       'must be >= 1.')
    buckets = tuple(prefill_buckets or default_buckets(max_prefill_length))
    if list(buckets) != sorted(set(buckets)) or buckets[-1] != max_prefill_length or (
        buckets[0] < 1):
      raise ValueError(f'prefill_buckets {buckets} must be increasing positive lengths ending '
                       f'at max_prefill_length={max_prefill_length}.')
    self.cache_length = max_prefill_length + max_decode_length
    if self.cache_length > model.config.max_seq_len:
      raise ValueError(
          f'max_prefill_length ({max_prefill_length}) + max_decode_length '
          f'({max_decode_length}) = {self.cache_length} exceeds the model max_seq_len '
          f'({model.config.max_seq_len}).')
    if layer_loop not in ('auto',) + LAYER_LOOPS:
      raise ValueError(f'layer_loop={layer_loop!r} is not a layer loop; choose one of '
                       f'{["auto", *LAYER_LOOPS]}.')
    if layer_loop == 'auto':
      cpu = all(device.platform == 'cpu' for device in mesh.devices.flat)
      invariant = model.config.execution.batch_invariant
      layer_loop = 'unrolled' if cpu and not invariant else 'scan'
    self.layer_loop = layer_loop
    if weight_layout is None:
      cpu_decode = jax.default_backend() == 'cpu' and not model.config.execution.batch_invariant
      weight_layout = 'out_in' if cpu_decode else model.config.execution.weight_layout
    self.mesh = mesh
    self.slots = slots
    self.max_prefill_length = max_prefill_length
    self.max_decode_length = max_decode_length
    self.prefill_buckets = buckets
    # Continuations prefill a prompt plus the tokens drawn so far (< cache_length).
    self.continuation_buckets = tuple(
        b for b in default_buckets(self.cache_length) if b > max_prefill_length)
    # A decode step attends to the fewest leading multiples of step that hold its rows; the
    # cache is kept in whole blocks (kv_cache.block_layout: the memory plan counts the same).
    step, self.block_length, self.num_blocks = block_layout(
        self.cache_length, batch_invariant=model.config.execution.batch_invariant,
        attend_buckets=attend_buckets, block_align=block_align)
    self.attend_buckets = tuple(
        step * (i + 1) for i in range(-(-self.cache_length // step)))
    decode_attention, self.decode_attention_note = self._decode_attention(
        model, mesh, decode_attention)
    self.source_model = model  # the layout of the params place_params takes
    self.model = with_weight_layout(model, weight_layout, decode_attention, layer_loop)
    self.pad_id = int(pad_id)
    self.quant = quant
    self.param_shardings = sharding_lib.param_shardings(
        self.model.abstract_params(), self.model.logical_axes(), mesh, rules)
    if quant == 'int8':
      self.param_shardings = quantized_shardings(self.param_shardings, self.model)
    self.key_size = int(jax.random.key_data(jax.random.key(0)).shape[-1])  # uint32 words
    self.state_shardings = self._state_shardings(rules)
    self.prefilled_tokens = 0  # true (unpadded) tokens prefill and extend have run
    # The device programs, shared with every engine alike in this process (``_jitted``).
    code = _DeviceCode(model=self.model, slots=slots, block_length=self.block_length,
                       pad_id=self.pad_id, kv_cache_quant=kv_cache_quant,
                       record_routes=self.record_routes, layer_loop=layer_loop)
    (self._quantize, self._prefill, self._insert, self._generate, self._extend,
     self._release_all, self._release) = _jitted(code, self.state_shardings)

  def _decode_attention(self, model: Model, mesh: Mesh, wanted: str | None
                        ) -> tuple[str, str]:
    """``(decode_attention, why)``; refuses a ``'cpu_kernel'`` that cannot run here."""
    c = model.config
    if wanted not in (None, 'cpu_kernel'):
      return wanted, f'{wanted!r}: asked for'
    problem = (
        ('one slot (one-row steps keep XLA\'s attention)' if self.slots == 1 else None)
        or ('the KV cache is int8 (the kernel reads float blocks)'
            if self.kv_cache_quant != 'none' else None)
        or ('the model is batch_invariant' if c.execution.batch_invariant else None)
        or (f'the mesh has {mesh.size} devices (XLA cannot split a custom call)'
            if mesh.size != 1 else None)
        or cpu_attention.supports(head_dim=c.head_dim, groups=c.num_heads // c.num_kv_heads,
                                  block_length=self.block_length, dtype=c.execution.dtype)
        or cpu_attention.unavailable_reason() or None)
    if not problem:
      return 'cpu_kernel', "'cpu_kernel': XLA:CPU, one device, float32, a supported shape"
    if wanted is None:
      current = c.execution.decode_attention
      return current, f'{current!r}: the CPU kernel does not apply ({problem})'
    raise ValueError(f'decode_attention=\'cpu_kernel\' cannot run here: {problem}. Pass '
                     'decode_attention=\'xla\' (or leave it unset to choose).')

  # ----------------------------------------------------------------------- JetStream API

  @property
  def max_concurrent_decodes(self) -> int:
    return self.slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  def init_decode_state(self) -> DecodeState:
    """Every slot empty (inactive)."""
    c = self.model.config
    s = self.slots
    state = DecodeState(
        cache=KVCache.init(c, s, self.cache_length, self.block_length, self.kv_cache_quant),
        tokens=jnp.full((s,), self.pad_id, jnp.int32),
        keys=jnp.zeros((s, self.key_size), jnp.uint32),
        positions=jnp.zeros((s,), jnp.int32), remaining=jnp.zeros((s,), jnp.int32),
        stop_ids=jnp.full((s, MAX_STOP_IDS), -1, jnp.int32))
    return jax.device_put(state, self.state_shardings)

  def check_params(self, params: Params, *, placed: bool = True) -> None:
    """Raises ValueError naming the first leaf that differs when ``params`` are not this
    engine's: its model's tree, shapes and dtypes, in the engine's weight layout
    (``placed``, what ``place_params`` returns) or the given model's (``placed=False``).
    Checked before any compute, so a wrong tree, another model's weights or a dtype that
    would recompile every step fail here instead of running. Placed params of a
    ``quant='int8'`` engine are the quantised ones."""
    model = self.model if placed else self.source_model
    abstract = model.abstract_params()
    if placed and self.quant == 'int8':
      abstract = jax.eval_shape(self._quantize, abstract)
    want, got = leaf_specs(abstract), leaf_specs(params)
    where = ('the engine\'s layout (pass them through place_params first)' if placed
             else 'the model\'s layout')
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
      raise ValueError(f'params do not have the model\'s tree: missing {missing[:3]}, '
                       f'unexpected {extra[:3]} (expected {len(want)} leaves in {where}).')
    for path, (shape, dtype) in want.items():
      if got[path] != (shape, dtype):
        seen_shape, seen_dtype = got[path]
        raise ValueError(f'params{path} is {seen_dtype}{list(seen_shape)}; this engine needs '
                         f'{dtype}{list(shape)} in {where}.')

  def place_params(self, params: Params) -> Params:
    """``params`` of the model the engine was given (host or device), in the engine's
    weight layout and layer loop, sharded on the inference mesh (checked first:
    ``check_params``); with ``quant='int8'``, its projections quantised
    (``models.quant.quantize_params``, per layer when unrolled).

    With ``layer_loop='unrolled'`` the stacked blocks become per-layer buffers here, once per
    weight version (``models.model.to_weight_layout``: each layer's slice of a leaf is
    transposed as it is cut, so the one transient copy is a single layer's slice); the
    engine keeps only the per-layer copy. ``params`` stay the caller's (a worker's receiver
    holds the stacked version it pulled to apply the next delta, as it held it beside the
    engine's ``'out_in'`` copy before)."""
    self.check_params(params, placed=False)
    if self.model is not self.source_model:  # eager: op by op, compiled once per shape
      params = to_weight_layout(params, self.source_model, self.model)
    if self.quant == 'int8':
      params = self._quantize(params)
    return jax.device_put(params, self.param_shardings)

  def bucket(self, length: int, continuation: bool = False) -> int:
    """The smallest prefill bucket holding ``length`` tokens (``continuation``: a prompt
    plus drawn tokens, which may be up to ``cache_length - 1`` long)."""
    sizes = self.prefill_buckets + (self.continuation_buckets if continuation else ())
    for size in sizes:
      if length <= size and (not continuation or length < self.cache_length):
        return size
    if continuation:
      raise ValueError(f'a continuation of {length} tokens leaves no room in the cache of '
                       f'{self.cache_length} (max_prefill_length + max_decode_length).')
    raise ValueError(f'a prompt of {length} tokens is longer than max_prefill_length='
                     f'{self.max_prefill_length}.')

  def prefill(self, params: Params, prompts: Sequence[Sequence[int]], *,
              continuation: bool = False) -> Prefix:
    """Prefills a batch of prompts (non-empty id sequences) in one call.

    The batch is padded to a power of two (at most ``slots``) with one-token dummy rows and
    the prompts to the bucket of the longest; row ``i`` of the result is ``prompts[i]``.
    ``continuation``: the sequences are prompts followed by tokens a sample already drew
    (insert them with ``Insert.offset``), up to ``cache_length - 1`` tokens long.
    """
    if not prompts or len(prompts) > self.slots:
      raise ValueError(f'prefill takes 1 to slots={self.slots} prompts, got {len(prompts)}.')
    lengths = [len(p) for p in prompts]
    if min(lengths) == 0:
      raise ValueError('cannot prefill an empty prompt.')
    rows = 1 << (len(prompts) - 1).bit_length()
    padded = np.full((rows, self.bucket(max(lengths), continuation)), self.pad_id, np.int32)
    true_lengths = np.ones(rows, np.int32)
    for i, prompt in enumerate(prompts):
      padded[i, :len(prompt)] = prompt
      true_lengths[i] = len(prompt)
    self.prefilled_tokens += sum(lengths)
    return self._prefill(params, jnp.asarray(padded), jnp.asarray(true_lengths))

  def insert(self, prefix: Prefix, state: DecodeState, inserts: Sequence[Insert],
             spec: SamplingSpec) -> tuple[DecodeState, StepResult]:
    """Copies prefix rows into slots and samples each one's first token
    (``fold_in(key, offset)``: ``offset`` 0 for a new sample) from its row's logits, all in
    one call.

    Returns ``(state, StepResult)`` whose entry ``i`` belongs to ``inserts[i]`` (the rest is
    padding; ``done`` marks samples that ended at their first token). A slot becomes active
    unless its first token is a stop token or its ``max_new_tokens`` is 1.
    """
    s = self.slots
    if not 1 <= len(inserts) <= s:
      raise ValueError(f'insert takes 1 to slots={s} inserts, got {len(inserts)}.')
    if len({i.slot for i in inserts}) != len(inserts):
      raise ValueError('two inserts target the same slot.')
    rows = np.zeros(s, np.int32)
    slots = np.full(s, s, np.int32)  # slot == S: out of range, dropped
    keys = np.zeros((s, self.key_size), np.uint32)
    max_new = np.ones(s, np.int32)
    offsets = np.zeros(s, np.int32)
    stops = np.full((s, MAX_STOP_IDS), -1, np.int32)
    for i, ins in enumerate(inserts):
      if not 0 <= ins.slot < s or not 0 <= ins.row < prefix.lengths.shape[0]:
        raise ValueError(f'insert {i}: slot {ins.slot} or row {ins.row} out of range.')
      if not 1 <= ins.max_new_tokens <= self.max_decode_length:
        raise ValueError(f'max_new_tokens={ins.max_new_tokens} must be in [1, '
                         f'max_decode_length={self.max_decode_length}].')
      if not 0 <= ins.offset < ins.max_new_tokens:
        raise ValueError(f'insert {i}: offset={ins.offset} (tokens already drawn) must be in '
                         f'[0, max_new_tokens={ins.max_new_tokens}).')
      if len(ins.stop_ids) > MAX_STOP_IDS:
        raise ValueError(f'{len(ins.stop_ids)} stop ids; at most {MAX_STOP_IDS} are supported.')
      rows[i], slots[i], keys[i], max_new[i] = ins.row, ins.slot, ins.key, ins.max_new_tokens
      offsets[i] = ins.offset
      stops[i, :len(ins.stop_ids)] = ins.stop_ids
    return self._insert(prefix, state, jnp.asarray(rows), jnp.asarray(slots),
                        jnp.asarray(keys), jnp.asarray(max_new), jnp.asarray(offsets),
                        jnp.asarray(stops), spec=spec)

  def extend(self, params: Params, state: DecodeState, extends: Sequence[Extend],
             spec: SamplingSpec) -> tuple[DecodeState, StepResult]:
    """Appends each ``Extend``'s tokens to its (inactive) slot's cache and samples the
    slot's next token from the last one's logits (``fold_in(key, offset)``), in one call.

    Only the new tokens are run through the model (``prefilled_tokens`` grows by their
    count), at positions ``start ..`` of their slot, attending to everything the slot's
    cache holds: what a prefill of the whole sequence from scratch computes, up to float
    rounding. A slot whose sample ended holds every token but its last sampled one (a step
    feeds a token after drawing it), so a conversation passes that token first. The batch
    is padded to a power of two and the tokens to a prefill bucket; each compiles once.
    Returns ``(state, StepResult)`` whose entry ``i`` belongs to ``extends[i]``, as
    ``insert``. Raises ValueError, before any compute, for an empty or out-of-range slot
    list, a repeated slot, no tokens, or tokens that leave no room in the cache
    (``start + len(tokens) + max_new_tokens - 1`` must be ``<= cache_length``).
    """
    s = self.slots
    if not 1 <= len(extends) <= s:
      raise ValueError(f'extend takes 1 to slots={s} extends, got {len(extends)}.')
    if len({x.slot for x in extends}) != len(extends):
      raise ValueError('two extends target the same slot.')
    rows = 1 << (len(extends) - 1).bit_length()
    for i, x in enumerate(extends):
      if not 0 <= x.slot < s:
        raise ValueError(f'extend {i}: slot {x.slot} out of range [0, {s}).')
      if not x.tokens:
        raise ValueError(f'extend {i}: no tokens to append.')
      if not 1 <= x.max_new_tokens <= self.max_decode_length or not (
          0 <= x.offset < x.max_new_tokens):
        raise ValueError(f'extend {i}: max_new_tokens={x.max_new_tokens} must be in [1, '
                         f'max_decode_length={self.max_decode_length}] and offset='
                         f'{x.offset} below it.')
      end = x.start + len(x.tokens) + x.max_new_tokens - x.offset - 1
      if x.start < 1 or end > self.cache_length:
        raise ValueError(f'extend {i}: {len(x.tokens)} tokens at position {x.start} plus '
                         f'{x.max_new_tokens - x.offset} to draw need {end} positions; the '
                         f'cache holds cache_length={self.cache_length} (and start must be '
                         '>= 1: extend a slot that holds a prompt).')
      if len(x.stop_ids) > MAX_STOP_IDS:
        raise ValueError(f'{len(x.stop_ids)} stop ids; at most {MAX_STOP_IDS} are supported.')
    width = max(len(x.tokens) for x in extends)
    sizes = self.prefill_buckets + self.continuation_buckets
    width = next((b for b in sizes if b >= width), width)
    tokens = np.full((rows, width), self.pad_id, np.int32)
    lengths = np.zeros(rows, np.int32)
    slots = np.full(rows, s, np.int32)  # slot == S: padding, dropped
    keys = np.zeros((rows, self.key_size), np.uint32)
    max_new = np.ones(rows, np.int32)
    offsets = np.zeros(rows, np.int32)
    stops = np.full((rows, MAX_STOP_IDS), -1, np.int32)
    for i, x in enumerate(extends):
      tokens[i, :len(x.tokens)] = x.tokens
      lengths[i], slots[i], keys[i] = len(x.tokens), x.slot, x.key
      max_new[i], offsets[i] = x.max_new_tokens, x.offset
      stops[i, :len(x.stop_ids)] = x.stop_ids
    self.prefilled_tokens += int(lengths.sum())
    return self._extend(params, state, jnp.asarray(tokens), jnp.asarray(lengths),
                        jnp.asarray(slots), jnp.asarray(keys), jnp.asarray(max_new),
                        jnp.asarray(offsets), jnp.asarray(stops), spec=spec)

  def generate(self, params: Params, state: DecodeState, spec: SamplingSpec,
               longest: int | None = None) -> tuple[DecodeState, StepResult]:
    """One decode step over all slots with ``params``.

    ``longest``: the most cache positions any active slot holds after this step (its
    prompt plus the tokens fed so far, this one included); attention then reads only the
    smallest ``attend_buckets`` entry holding it. ``None`` reads the whole cache. It must
    not understate: the device does not check it (that would cost a host sync a step), and
    a slot longer than the bucket would neither see nor write its positions past it. The
    driver and the JetStream adapter compute it from their host-side bookkeeping. A value
    no slot can hold (below 1, or past ``cache_length``) is refused (``ValueError``).
    """
    attend = self.attend_buckets[-1]
    if longest is not None:
      if not 1 <= longest <= self.cache_length:
        raise ValueError(f'longest={longest}: a slot holds 1 to cache_length='
                         f'{self.cache_length} positions after a step; pass what the '
                         'longest active slot holds, or None to read the whole cache.')
      attend = next((b for b in self.attend_buckets if longest <= b), attend)
    return self._generate(params, state, spec=spec, attend=attend)

  def release_all(self, state: DecodeState) -> DecodeState:
    """Every slot inactive (what the slots held is overwritten by the next inserts)."""
    return self._release_all(state)

  def release(self, state: DecodeState, slots: Sequence[int]) -> DecodeState:
    """``slots`` inactive (an episode that timed out mid-turn); the others unchanged."""
    mask = np.zeros(self.slots, bool)
    mask[list(slots)] = True
    return self._release(state, jnp.asarray(mask))

  def compilations(self) -> int:
    """How many programs the engine's jitted functions have compiled so far (shared with
    the engines alike in this process: ``_jitted``)."""
    jitted = (self._prefill, self._insert, self._generate, self._extend, self._release_all,
              self._release)
    return sum(f._cache_size() for f in jitted)  # pylint: disable=protected-access

  # ----------------------------------------------------------------------- device code

  def _state_shardings(self, rules) -> DecodeState:
    c = self.model.config
    mesh = self.mesh

    def named(logical, shape):
      return NamedSharding(mesh, sharding_lib.logical_to_spec(PartitionSpec(*logical), shape,
                                                              mesh, rules))
    stacked = self.layer_loop == 'scan'
    lead_axes, lead = ((LAYERS_AXIS,), (c.num_layers,)) if stacked else ((), ())
    layer = lambda axes, scale=False: (named(lead_axes + axes, lead + cache_block_shape(
        axes, c, self.slots, self.block_length, scale=scale)),) * self.num_blocks
    block = lambda axes, scale=False: (layer(axes, scale) if stacked
                                       else (layer(axes, scale),) * c.num_layers)
    k, v = block(KEY_BLOCK_AXES), block(VALUE_BLOCK_AXES)
    int8 = self.kv_cache_quant == 'int8'
    scales = lambda axes: block(axes, scale=True) if int8 else ()
    per_slot = named(('batch',), (self.slots,))
    per_slot_2d = lambda width: named(('batch', None), (self.slots, width))
    return DecodeState(
        cache=KVCache(k=k, v=v, lengths=per_slot, k_scale=scales(KEY_BLOCK_AXES),
                      v_scale=scales(VALUE_BLOCK_AXES), stacked=stacked),
        tokens=per_slot, keys=per_slot_2d(self.key_size), positions=per_slot,
        remaining=per_slot, stop_ids=per_slot_2d(MAX_STOP_IDS))


@dataclasses.dataclass(frozen=True)
class _DeviceCode:
  """What the engine's device programs read, compared and hashed by value: engines with
  equal ones (and equal state shardings) share their jitted functions (``_jitted``)."""

  model: Model  # the engine's own: its weight layout, decode attention and layer loop
  slots: int
  block_length: int
  pad_id: int
  kv_cache_quant: str
  record_routes: bool
  layer_loop: str

  def prefill(self, params, tokens, lengths):
    cache = KVCache.init(self.model.config, tokens.shape[0], tokens.shape[1],
                         quant=self.kv_cache_quant)
    last, cache, *routes = self.model.prefill(params, tokens, lengths, cache,
                                              return_routes=self.record_routes)
    only = lambda part: self._layer_groups(  # the one block
        lambda blocks, lead: blocks[0] if blocks else None, part)
    if routes:
      valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
      routes = [jnp.where(valid[:, :, None, None], routes[0], NO_ROUTE).astype(routes[0].dtype)]
    return Prefix(k=only(cache.k), v=only(cache.v), lengths=lengths, logits=last,
                  k_scale=only(cache.k_scale), v_scale=only(cache.v_scale),
                  routes=routes[0] if routes else None)

  def _layer_groups(self, fn, *parts):
    """``fn(*blocks, lead=...)`` over the layer groups of cache ``parts`` (a ``KVCache``'s
    ``k``, ``v``, ... or a ``Prefix``'s, taken together): with ``layer_loop='scan'`` the one
    group of every layer, stacked (``lead=LAYERED`` axes before a layer's block axes); with
    ``'unrolled'`` each layer's own (``lead=0``), as a tuple over the layers."""
    if self.layer_loop == 'scan':
      return fn(*parts, lead=LAYERED)
    return tuple(fn(*group, lead=0) for group in zip(*parts))

  def insert(self, prefix, state, rows, slots, keys, max_new, offsets, stop_ids, *, spec):
    # Entries with slot == S are padding: scatters drop them (mode='drop').
    stacked = self.layer_loop == 'scan'
    bucket = (prefix.v if stacked else prefix.v[0]).shape[
        (LAYERED if stacked else 0) + VALUE_POSITION_AXIS]

    def put(blocks, source, axis, lead):  # axis: a layer's blocks' position axis
      if source is None:  # a float cache has no scales
        return blocks
      pre = (slice(None),) * lead  # the layers, when stacked
      update = source[pre + (rows,)]  # [(L,) S, kv, bucket, d] or [(L,) S, kv, d, bucket]
      written = []
      for j, buffer in enumerate(blocks):  # the part of the prompt each block holds
        lo, size = j * self.block_length, min(self.block_length, bucket - j * self.block_length)
        if size <= 0:
          written.append(buffer)
          continue
        into = pre + (slots,) + (slice(None),) * (axis - 1) + (slice(0, size),)
        part = jax.lax.slice_in_dim(update, lo, lo + size, axis=lead + axis)
        if (part.dtype == jnp.int8) != (buffer.dtype == jnp.int8):  # a cast would not quantise
          raise ValueError(f'prefix blocks of {part.dtype} cannot go into a {buffer.dtype} '
                           'cache; prefill with this engine (its kv_cache_quant).')
        written.append(buffer.at[into].set(part.astype(buffer.dtype), mode='drop'))
      return tuple(written)
    puts = lambda cached, prefixed, axis: self._layer_groups(
        functools.partial(put, axis=axis), cached, prefixed)
    cache = KVCache(
        k=puts(state.cache.k, prefix.k, KEY_POSITION_AXIS),
        v=puts(state.cache.v, prefix.v, VALUE_POSITION_AXIS),
        lengths=state.cache.lengths.at[slots].set(prefix.lengths[rows], mode='drop'),
        k_scale=puts(state.cache.k_scale, prefix.k_scale, KEY_POSITION_AXIS),
        v_scale=puts(state.cache.v_scale, prefix.v_scale, VALUE_POSITION_AXIS),
        stacked=stacked)
    return self._start_samples(state, cache, prefix.logits[rows], slots, keys, max_new,
                               offsets, stop_ids, spec)

  def _start_samples(self, state, cache, logits, slots, keys, max_new, offsets, stop_ids,
                     spec):
    """The state with ``cache`` and a new sample in each of ``slots`` (S: padding, dropped),
    its first token drawn from ``logits`` ``[R, V]`` with ``fold_in(key, offset)``."""
    first_keys = jax.vmap(lambda data, offset: jax.random.fold_in(
        jax.random.wrap_key_data(data), offset))(keys, offsets)
    token, logp, support = sample_rows(logits, first_keys, spec,
                                       invariant=self.model.config.execution.batch_invariant)
    stopped = jnp.any(token[:, None] == stop_ids, axis=1)
    left = max_new - offsets - 1  # tokens it may draw after this one
    remaining = jnp.where(stopped | (left <= 0), 0, left)
    set_rows = lambda buffer, values: buffer.at[slots].set(values, mode='drop')
    state = DecodeState(
        cache=cache, tokens=set_rows(state.tokens, token), keys=set_rows(state.keys, keys),
        positions=set_rows(state.positions, offsets + 1),
        remaining=set_rows(state.remaining, remaining),
        stop_ids=set_rows(state.stop_ids, stop_ids))
    valid = slots < state.tokens.shape[0]
    return state, StepResult.pack(token, logp, support, valid, valid & (remaining == 0),
                                  self._no_routes(token.shape[0]))

  def _no_routes(self, rows: int) -> jax.Array | None:
    """``StepResult`` route columns of ``rows`` that fed no token (None: not recording)."""
    if not self.record_routes:
      return None
    c = self.model.config
    return jnp.full((rows, c.num_moe_layers, c.num_experts_per_tok), NO_ROUTE, jnp.int32)

  def extend(self, params, state, tokens, lengths, slots, keys, max_new, offsets, stop_ids,
             *, spec):
    # The slots' blocks joined into one contiguous cache (all layers), with room past its end
    # for the new tokens wherever they start (a one-block write clamps at the end), run
    # as a prefill over it, then split back into blocks and scattered to the slots.
    block = self.block_length
    extra = -(-tokens.shape[1] // block) * block
    gather = jnp.minimum(slots, self.slots - 1)

    stacked = self.layer_loop == 'scan'

    def join(blocks, axis, lead):  # axis: a layer's blocks' position axis
      if not blocks:
        return ()
      pre = (slice(None),) * lead  # the layers, when stacked
      rows = jnp.concatenate([b[pre + (gather,)] for b in blocks], axis=lead + axis)
      pad = [(0, 0)] * rows.ndim
      pad[lead + axis] = (0, extra)
      return (jnp.pad(rows, pad),)
    joins = lambda part, axis: self._layer_groups(functools.partial(join, axis=axis), part)
    cache = KVCache(k=joins(state.cache.k, KEY_POSITION_AXIS),
                    v=joins(state.cache.v, VALUE_POSITION_AXIS),
                    lengths=state.cache.lengths[gather],
                    k_scale=joins(state.cache.k_scale, KEY_POSITION_AXIS),
                    v_scale=joins(state.cache.v_scale, VALUE_POSITION_AXIS), stacked=stacked)
    last, cache, *routes = self.model.prefill(params, tokens, lengths, cache,
                                              return_routes=self.record_routes)

    def split(buffers, new, axis, lead):
      if not buffers:
        return ()
      (whole,) = new
      pre = (slice(None),) * lead
      return tuple(
          buffer.at[pre + (slots,)].set(jax.lax.slice_in_dim(
              whole, j * block, (j + 1) * block, axis=lead + axis).astype(buffer.dtype),
                                        mode='drop')
          for j, buffer in enumerate(buffers))
    splits = lambda olds, news, axis: self._layer_groups(functools.partial(split, axis=axis),
                                                         olds, news)
    new_cache = KVCache(
        k=splits(state.cache.k, cache.k, KEY_POSITION_AXIS),
        v=splits(state.cache.v, cache.v, VALUE_POSITION_AXIS),
        lengths=state.cache.lengths.at[slots].set(cache.lengths, mode='drop'),
        k_scale=splits(state.cache.k_scale, cache.k_scale, KEY_POSITION_AXIS),
        v_scale=splits(state.cache.v_scale, cache.v_scale, VALUE_POSITION_AXIS),
        stacked=stacked)
    state, result = self._start_samples(state, new_cache, last, slots, keys, max_new, offsets,
                                        stop_ids, spec)
    if routes:
      valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
      result = result.replace(prefilled=jnp.where(valid[:, :, None, None], routes[0],
                                                  NO_ROUTE).astype(routes[0].dtype))
    return state, result

  def generate(self, params, state, *, spec, attend):
    active = state.remaining > 0
    logits, cache, *routes = self.model.apply(
        params, state.tokens[:, None], cache=state.cache, num_valid=active.astype(jnp.int32),
        attend=attend, return_routes=self.record_routes)
    routes = (jnp.where(active[:, None, None], routes[0][:, 0].astype(jnp.int32), NO_ROUTE)
              if routes else None)
    keys = jax.vmap(lambda data, position: jax.random.fold_in(
        jax.random.wrap_key_data(data), position))(state.keys, state.positions)
    token, logp, support = sample_rows(
        logits[:, 0], keys, spec, invariant=self.model.config.execution.batch_invariant,
        active=active,
        vocab_major=head_is_vocab_major(self.model.config, state.tokens.shape[0]))
    token = jnp.where(active, token, self.pad_id)
    logp = jnp.where(active, logp, 0.0)
    support = jnp.where(active, support, 0)
    stopped = jnp.any(token[:, None] == state.stop_ids, axis=1)
    remaining = jnp.where(active & ~stopped, state.remaining - 1, 0)
    state = DecodeState(cache=cache, tokens=jnp.where(active, token, state.tokens),
                        keys=state.keys, positions=state.positions + active,
                        remaining=remaining, stop_ids=state.stop_ids)
    return state, StepResult.pack(token, logp, support, active, active & (remaining == 0),
                                  routes)



@functools.lru_cache(maxsize=16)
def _jitted(code: _DeviceCode, state_shardings: DecodeState) -> tuple[Any, ...]:
  """The engine's jitted functions, ``(quantize, prefill, insert, generate, extend,
  release_all, release)``, made once per ``(code, state_shardings)`` (both by value): a
  second engine alike in one process (a new run, an evaluation beside training, a sweep)
  gets the same ``jax.jit`` objects, and JAX's own cache serves its calls without tracing,
  lowering or compiling. The decode state is donated to every function that updates it."""
  steps = dict(donate_argnums=(1,), out_shardings=(state_shardings, None))
  return (
      jax.jit(functools.partial(quantize_params, model=code.model)),
      jax.jit(code.prefill),
      jax.jit(code.insert, static_argnames=('spec',), **steps),
      jax.jit(code.generate, static_argnames=('spec', 'attend'), **steps),
      jax.jit(code.extend, static_argnames=('spec',), **steps),
      jax.jit(lambda state: state.replace(remaining=jnp.zeros_like(state.remaining)),
              donate_argnums=(0,), out_shardings=state_shardings),
      jax.jit(lambda state, mask: state.replace(remaining=jnp.where(mask, 0, state.remaining)),
              donate_argnums=(0,), out_shardings=state_shardings))
