r"""Serve a checkpoint through JetStream's orchestrator and gRPC server (optional).

JetStream (``google-jetstream``) defines the Engine API rlax_llm's engine follows; its
repository is archived and its last release (0.2.2) declares dependencies that pull
TensorFlow through ``seqio``. This module is the only place that imports it, and the only
place with the compatibility shims it needs (``import_jetstream``):

* ``seqio.vocabularies`` is stubbed when ``seqio`` is absent (only its SentencePiece
  tokenizer uses it; ours does not);
* ``jax.tree_map``, removed from JAX, is aliased to ``jax.tree.map`` if missing;
* importing its orchestrator sets the *root* logger to DEBUG and adds a stdout handler; both
  are undone;
* its server binds every interface (``[::]``); ``serve`` binds ``host`` (loopback unless
  asked otherwise).

Install: ``pip install 'rlax_llm[jetstream]'`` (grpcio, protobuf, prometheus-client,
shortuuid, tiktoken) and ``pip install --no-deps google-jetstream==0.2.2`` (``scripts/setup.sh``
does both). Run a server in its own process (JetStream SIGKILLs its process when an engine
call raises):

    python -m rlax_llm.rollout.jetstream_adapter --checkpoint=PATH --port=9000

Clients use JetStream's own stub (``jetstream_pb2_grpc.OrchestratorStub``) with
``DecodeRequest(token_content=..., max_tokens=...)``; replies carry token ids (and text for
text requests) but, as JetStream's protocol has no field for them, neither log-probs nor
versions nor a mixture of experts' routes (an engine recording them for R3 is refused): RL
rollouts use ``rlax_llm.rollout.driver``, not this server. Known JetStream
behaviour kept as it is: it prepends the tokenizer's bos to every new prompt (this adapter
drops it again when the checkpoint does not want one, so ``session_cache`` conversation
history is not supported); server-side detokenization decodes one token at a time, which
can garble byte-level BPE text (request token ids and decode them yourself); the stop token
is not returned.

Weights: the engine's params argument is a ``VersionedParams`` holder dereferenced at every
prefill and decode step (JetStream's orchestrator reads "params" once per thread), so
``JetStreamEngine.holder.set(version, params)`` swaps them for a live server in-process.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import types
from typing import Any

import jax
import numpy as np

from rlax_llm import extras
from rlax_llm.sampling_spec import GREEDY, SamplingSpec
from rlax_llm.rollout.driver import VersionedParams
from rlax_llm.rollout.engine import Engine, Insert


_WHY = 'the JetStream adapter'
# The JetStream modules the adapter uses (``import_jetstream``'s namespace: by last part).
_JETSTREAM_MODULES = (
    'core.config_lib', 'core.orchestrator', 'core.server_lib', 'core.proto.jetstream_pb2',
    'core.proto.jetstream_pb2_grpc', 'engine.engine_api', 'engine.tokenizer_api',
    'engine.tokenizer_pb2', 'engine.token_utils')


def import_jetstream() -> types.SimpleNamespace:
  """Imports JetStream 0.2.2 with the shims it needs (see the module docstring); raises
  MissingExtra naming the jetstream extra and google-jetstream's install without it."""
  try:
    import seqio.vocabularies  # noqa: F401 pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    vocabularies = types.ModuleType('seqio.vocabularies')
    vocabularies.Vocabulary = type('Vocabulary', (), {})
    vocabularies.SentencePieceVocabulary = type('SentencePieceVocabulary',
                                                (vocabularies.Vocabulary,), {})
    seqio = types.ModuleType('seqio')
    seqio.vocabularies = vocabularies
    sys.modules.setdefault('seqio', seqio)
    sys.modules.setdefault('seqio.vocabularies', vocabularies)
  if not hasattr(jax, 'tree_map'):
    jax.tree_map = jax.tree.map
  root = logging.getLogger()
  level, handlers = root.level, list(root.handlers)
  try:  # MissingExtra without google-jetstream or the jetstream extra's packages
    modules = {name.rpartition('.')[2]: extras.require(f'jetstream.{name}', _WHY)
               for name in _JETSTREAM_MODULES}
  finally:
    root.setLevel(level)
    for handler in list(root.handlers):
      if handler not in handlers:
        root.removeHandler(handler)
  return types.SimpleNamespace(**modules)


def _jetstream_bos(tokenizer) -> int:
  """The id JetStream prepends to every new prompt: the tokenizer's bos, or its pad when it
  has none (JetStream needs some id there)."""
  return tokenizer.pad_id if tokenizer.bos_id is None else tokenizer.bos_id


def _tokenizer_class(js: types.SimpleNamespace):

  class Tokenizer(js.tokenizer_api.Tokenizer):
    """JetStream's tokenizer interface over an rlax_llm tokenizer."""

    def __init__(self, tokenizer):
      self.tokenizer = tokenizer

    def encode(self, s: str, **kwargs) -> tuple[np.ndarray, int]:
      ids = np.asarray(self.tokenizer.encode(s), np.int32)
      return js.token_utils.pad_tokens(
          ids, self.bos_id, self.pad_id, is_bos=kwargs.get('is_bos', True),
          max_prefill_length=kwargs.get('max_prefill_length'),
          jax_padding=kwargs.get('jax_padding', True))

    def decode(self, token_ids: list[int], **kwargs) -> str:
      del kwargs
      return self.tokenizer.decode(token_ids, stop_at_eos=False)

    @property
    def pad_id(self) -> int:
      return self.tokenizer.pad_id

    @property
    def eos_id(self) -> int:
      return self.tokenizer.eos_id

    @property
    def bos_id(self) -> int:
      return _jetstream_bos(self.tokenizer)

    @property
    def stop_tokens(self) -> set[int]:
      return {self.tokenizer.eos_id}

  return Tokenizer


@dataclasses.dataclass
class _State:
  """The adapter's decode state: the engine's, plus the token each slot has sampled but not
  yet reported (JetStream reports tokens from ``generate`` only, so the first token, which
  our engine samples at ``insert``, goes out one step late, and so does every token)."""

  engine_state: Any
  pending: np.ndarray  # int32 [S]
  pending_valid: np.ndarray  # bool [S]
  lengths: np.ndarray  # int32 [S]: tokens reported so far
  prompt_lengths: np.ndarray  # int32 [S]: the prompt each slot was inserted with


def make_engine(js: types.SimpleNamespace, engine: Engine, tokenizer, holder: VersionedParams,
                *, sampling: SamplingSpec = GREEDY, seed: int = 0):
  """A ``jetstream.engine.engine_api.Engine`` serving ``engine`` with weights from
  ``holder`` and the model's ``tokenizer``. Refuses an engine that records routes (R3):
  JetStream's replies have no field for them."""
  if engine.record_routes:
    raise ValueError('the engine records routes (record_routes=True, for R3: '
                     "model.routing_replay='r3') but JetStream's replies have no field for "
                     'them, so they would be lost; serve an engine built without '
                     'record_routes (R3 rollouts run through rlax_llm.rollout.driver).')
  tokenizer_cls = _tokenizer_class(js)
  add_bos = bool(getattr(tokenizer, 'add_bos_token', False))

  class JetStreamEngine(js.engine_api.Engine):
    """Our engine behind JetStream's Engine API (one prompt per prefill, one slot per
    insert, one step over all slots per generate)."""

    def __init__(self):
      self.engine = engine
      self.holder = holder
      self._inserts = 0
      self._root = jax.random.key(seed)

    def load_params(self, *args, **kwargs) -> VersionedParams:
      del args, kwargs
      return self.holder

    def prefill(self, *, params: VersionedParams, existing_prefix=None, padded_tokens,
                true_length: int):
      if existing_prefix is not None:
        raise ValueError('prefix caching (existing_prefix) is not supported.')
      ids = np.asarray(padded_tokens)[:int(true_length)].tolist()
      if not add_bos and len(ids) > 1 and ids[0] == _jetstream_bos(tokenizer):
        ids = ids[1:]  # JetStream prepends a bos (or pad) the checkpoint does not use
      return self.engine.prefill(params.get()[1], [ids])

    def insert(self, prefix, decode_state: _State, slot: int) -> _State:
      key = jax.random.key_data(jax.random.fold_in(self._root, self._inserts))
      self._inserts += 1
      insert = Insert(row=0, slot=int(slot), key=np.asarray(key),
                      max_new_tokens=self.engine.max_decode_length,
                      stop_ids=(tokenizer.eos_id,))
      state, first = self.engine.insert(prefix, decode_state.engine_state, [insert], sampling)
      first = first.to_host()
      decode_state.engine_state = state
      decode_state.pending[slot] = first.tokens[0]
      decode_state.pending_valid[slot] = True
      decode_state.lengths[slot] = 0
      decode_state.prompt_lengths[slot] = int(prefix.lengths[0])
      return decode_state

    def generate(self, params: VersionedParams, decode_state: _State):
      reported = decode_state.pending.copy()
      valid = decode_state.pending_valid.copy()
      decode_state.lengths += valid
      lengths = decode_state.lengths.copy()
      # Every token reported now is the one this step feeds, so a slot holds its prompt
      # plus `lengths` positions after it; attention reads the bucket holding the longest.
      longest = int(np.max(np.where(valid, decode_state.prompt_lengths + lengths, 1)))
      state, step = self.engine.generate(params.get()[1], decode_state.engine_state, sampling,
                                         longest)
      step = step.to_host()
      decode_state.engine_state = state
      decode_state.pending = np.where(step.valid, step.tokens, decode_state.pending)
      decode_state.pending_valid = step.valid.copy()
      data = np.stack([reported, valid.astype(np.int32), lengths], axis=1).astype(np.int32)
      return decode_state, js.engine_api.ResultTokens(
          data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3),
          samples_per_slot=1)

    def init_decode_state(self, *args, **kwargs) -> _State:
      del args, kwargs
      s = self.engine.slots
      return _State(engine_state=self.engine.init_decode_state(),
                    pending=np.zeros(s, np.int32), pending_valid=np.zeros(s, bool),
                    lengths=np.zeros(s, np.int32), prompt_lengths=np.zeros(s, np.int32))

    def get_prefix_destination_sharding(self) -> Any:
      return None

    def get_tokenizer(self):
      return js.tokenizer_pb2.TokenizerParameters(path='rlax_llm', extra_ids=0)

    def build_tokenizer(self, metadata):
      del metadata
      return tokenizer_cls(tokenizer)

    @property
    def max_concurrent_decodes(self) -> int:
      return self.engine.slots

    @property
    def samples_per_slot(self) -> int:
      return 1

    @property
    def max_prefill_length(self) -> int:
      return self.engine.max_prefill_length

    @property
    def mesh(self) -> jax.sharding.Mesh:
      return self.engine.mesh

    @property
    def colocated_cpus(self) -> None:
      return None

  return JetStreamEngine()


def serve(checkpoint: str, port: int, *, host: str = 'localhost', slots: int = 8,
          max_prefill_length: int = 256, max_decode_length: int = 256,
          sampling: SamplingSpec = GREEDY, seed: int = 0, threads: int | None = None):
  """Starts a JetStream gRPC server for ``checkpoint`` (HF directory or .gguf) on
  ``host:port``; returns JetStream's server object (``.stop()``,
  ``.wait_for_termination()``)."""
  js = import_jetstream()
  grpc = extras.require('grpc', _WHY)
  # pylint: disable=import-outside-toplevel
  from rlax_llm.models import from_pretrained, split_module
  from rlax_llm.sharding import make_mesh
  module, tokenizer = from_pretrained(checkpoint)
  if tokenizer is None:
    raise ValueError(f'{checkpoint} has no tokenizer; the server tokenizes with it.')
  model, params = split_module(module)
  devices = jax.devices()[:1]
  engine = Engine(model, make_mesh({'data': 1}, devices), slots=slots,
                  max_prefill_length=max_prefill_length,
                  max_decode_length=max_decode_length, pad_id=tokenizer.pad_id)
  holder = VersionedParams()
  holder.set(0, engine.place_params(params))
  jengine = make_engine(js, engine, tokenizer, holder, sampling=sampling, seed=seed)

  @dataclasses.dataclass
  class Config(js.config_lib.ServerConfig):
    interleaved_slices: tuple[str, ...] = (f'cpu={len(devices)}',)
    interleaved_engine_create_fns: tuple = (lambda devices: jengine,)

  js.server_lib._HOST = host  # pylint: disable=protected-access
  return js.server_lib.run(port=port, config=Config, devices=devices,
                           credentials=grpc.insecure_server_credentials(), threads=threads)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--checkpoint', required=True, help='HF directory or .gguf file')
  parser.add_argument('--port', type=int, default=9000)
  parser.add_argument('--host', default='localhost')
  parser.add_argument('--slots', type=int, default=8)
  parser.add_argument('--max_prefill_length', type=int, default=256)
  parser.add_argument('--max_decode_length', type=int, default=256)
  parser.add_argument('--temperature', type=float, default=0.0)
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.WARNING)
  server = serve(args.checkpoint, args.port, host=args.host, slots=args.slots,
                 max_prefill_length=args.max_prefill_length,
                 max_decode_length=args.max_decode_length,
                 sampling=SamplingSpec(args.temperature), seed=args.seed)
  print(f'JetStream server for {args.checkpoint} on {args.host}:{args.port}', flush=True)
  server.wait_for_termination()


if __name__ == '__main__':
  main()
