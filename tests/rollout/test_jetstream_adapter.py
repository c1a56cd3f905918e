"""The optional JetStream serving adapter: our engine behind JetStream's orchestrator and gRPC
server, in its own process on loopback; JetStream's own client stub gets the same tokens as
rlax_llm's driver."""

import os
import pathlib
import subprocess
import sys
import time
import types

import numpy as np
import pytest
from flax import nnx

pytest.importorskip('jetstream', reason='optional: pip install --no-deps google-jetstream')
grpc = pytest.importorskip('grpc')

from rlax_llm.models import from_pretrained, save_pretrained, smollm2_gguf_path  # noqa: E402
from rlax_llm.models.decoder import Decoder  # noqa: E402
from rlax_llm.models.decoder_config import DecoderConfig  # noqa: E402
from rlax_llm.models.model import split_module  # noqa: E402
from rlax_llm.models.files.tokenizer import HFTokenizer  # noqa: E402
from rlax_llm.sampling_spec import GREEDY  # noqa: E402
from rlax_llm.rollout import jetstream_adapter  # noqa: E402
from rlax_llm.rollout.driver import generate  # noqa: E402

from ports import free_port  # noqa: E402  (tests/ports.py)

ROOT = pathlib.Path(__file__).resolve().parents[2]
NEW = 12


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
  """A tiny random Llama with SmolLM2's tokenizer (and chat template), as an HF directory."""
  try:
    tokenizer = HFTokenizer.from_gguf(smollm2_gguf_path())
  except FileNotFoundError as e:
    pytest.skip(str(e))
  config = DecoderConfig(vocab_size=tokenizer.vocab_size, num_layers=2, embed_dim=64,
                         num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                         max_seq_len=256)
  out = tmp_path_factory.mktemp('ckpt')
  save_pretrained(Decoder(config, rngs=nnx.Rngs(3)), tokenizer, out)
  return out


@pytest.fixture(scope='module')
def server(checkpoint):
  port = free_port()
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu', XLA_FLAGS='')
  proc = subprocess.Popen(
      [sys.executable, '-m', 'rlax_llm.rollout.jetstream_adapter', f'--checkpoint={checkpoint}',
       f'--port={port}', '--slots=4', '--max_prefill_length=64', f'--max_decode_length={NEW}'],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  js = jetstream_adapter.import_jetstream()
  channel = grpc.insecure_channel(f'localhost:{port}')
  stub = js.jetstream_pb2_grpc.OrchestratorStub(channel)
  deadline = time.time() + 120
  while True:
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    try:
      if stub.HealthCheck(js.jetstream_pb2.HealthCheckRequest(), timeout=2).is_live:
        break
    except grpc.RpcError:
      pass
    assert time.time() < deadline, 'the JetStream server did not come up'
    time.sleep(0.5)
  yield js, stub, port
  proc.terminate()
  proc.wait(timeout=30)
  channel.close()


def test_server_binds_loopback_only(server):
  _, _, port = server
  out = subprocess.run(['cat', '/proc/net/tcp', '/proc/net/tcp6'], capture_output=True,
                       text=True).stdout
  listening = [line.split() for line in out.splitlines()[1:]
               if line.split()[3:4] == ['0A'] and int(line.split()[1].split(':')[1], 16) == port]
  assert listening, f'nothing listens on port {port}'
  for fields in listening:
    address = fields[1].split(':')[0]
    # 127.0.0.1, ::ffff:127.0.0.1 or ::1 (/proc/net shows 32-bit words little-endian).
    assert address in ('0100007F', '0000000000000000FFFF00000100007F',
                       '00000000000000000000000001000000'), address


def test_jetstream_client_gets_the_drivers_tokens(server, checkpoint):
  js, stub, _ = server
  module, tokenizer = from_pretrained(checkpoint)
  model, params = split_module(module)
  questions = ['What is 2 + 3?', 'Name a color.', 'Say hello.']
  prompts = [tokenizer.apply_chat_template([{'role': 'user', 'content': q}],
                                           add_generation_prompt=True, tokenize=True)
             for q in questions]
  ours = generate(model, params, prompts, GREEDY, max_new_tokens=NEW,
                  stop_ids=(tokenizer.eos_id,))
  for prompt, sample in zip(prompts, ours):
    request = js.jetstream_pb2.DecodeRequest(
        token_content=js.jetstream_pb2.DecodeRequest.TokenContent(token_ids=prompt),
        max_tokens=NEW)
    served = [t for response in stub.Decode(request, timeout=60)
              for s in response.stream_content.samples for t in s.token_ids]
    expected = [t for t in sample.tokens if t != tokenizer.eos_id]  # JetStream drops the stop
    assert served == expected, (served, sample.tokens)
    assert len(expected) >= 1


def _in_process(tokenizer, max_prefill_length, max_decode_length):
  """``(model, params, engine, holder, served)``: a random 2-layer model's engine behind the
  adapter, in this process (no server), with a stand-in ``tokenizer``."""
  import jax  # pylint: disable=import-outside-toplevel
  from rlax_llm.rollout.driver import VersionedParams  # pylint: disable=import-outside-toplevel
  from rlax_llm.rollout.engine import Engine  # pylint: disable=import-outside-toplevel
  from rlax_llm.sharding import make_mesh  # pylint: disable=import-outside-toplevel
  config = DecoderConfig(vocab_size=48, num_layers=2, embed_dim=32, num_heads=4,
                         num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=128)
  model, params = split_module(Decoder(config, rngs=nnx.Rngs(0)))
  engine = Engine(model, make_mesh({'data': 1}, jax.devices()[:1]), slots=2,
                  max_prefill_length=max_prefill_length, max_decode_length=max_decode_length,
                  pad_id=0)
  holder = VersionedParams()
  holder.set(0, engine.place_params(params))
  served = jetstream_adapter.make_engine(jetstream_adapter.import_jetstream(), engine,
                                         tokenizer, holder)
  return model, params, engine, holder, served


def test_an_engine_recording_routes_is_refused():
  """R3's routes have no field in JetStream's replies: an engine that records them is
  refused before anything is built."""
  with pytest.raises(ValueError, match=r'the engine records routes \(record_routes=True'):
    jetstream_adapter.make_engine(None, types.SimpleNamespace(record_routes=True), None, None)


@pytest.mark.parametrize('bos_id', [1, None])
def test_prefill_drops_the_id_jetstream_prepends(bos_id):
  """JetStream prepends its tokenizer's bos_id, the pad id when the checkpoint has no bos;
  a checkpoint that does not add a bos gets its own prompt back, either way (with no bos
  the pad used to stay in front of every prompt)."""
  tokenizer = types.SimpleNamespace(add_bos_token=False, bos_id=bos_id, eos_id=2, pad_id=0,
                                    encode=lambda text: [5, 9, 13])
  _, _, engine, holder, served = _in_process(tokenizer, 16, 4)
  padded, true_length = served.build_tokenizer(None).encode('abc', max_prefill_length=16)
  assert list(np.asarray(padded)[:true_length]) == [1 if bos_id else 0, 5, 9, 13]
  prefix = served.prefill(params=holder, padded_tokens=padded, true_length=true_length)
  want = engine.prefill(holder.get()[1], [[5, 9, 13]])
  assert int(prefix.lengths[0]) == 3
  np.testing.assert_array_equal(np.asarray(prefix.logits[0]), np.asarray(want.logits[0]))


def test_adapter_steps_attend_to_the_bucket_of_the_longest_slot():
  """In-process (no server): each generate step passes the engine the positions its longest
  slot holds (prompt plus tokens fed), so attention reads the smallest cache bucket that
  holds it; the tokens are the driver's, which reads the same buckets."""
  tokenizer = types.SimpleNamespace(add_bos_token=False, bos_id=1, eos_id=-1, pad_id=0)
  model, params, engine, holder, served = _in_process(tokenizer, 64, 40)
  assert len(engine.attend_buckets) > 1, engine.attend_buckets
  seen = []
  real = engine.generate
  engine.generate = lambda *a: (seen.append(a[3]), real(*a))[1]
  prompts = [[5, 6, 7], [9] * 30]
  state = served.init_decode_state()
  tokens = [[], []]
  for slot, prompt in enumerate(prompts):
    padded = np.zeros(64, np.int32)
    padded[:len(prompt)] = prompt
    prefix = served.prefill(params=holder, padded_tokens=padded, true_length=len(prompt))
    state = served.insert(prefix, state, slot)
  for _ in range(engine.max_decode_length):
    state, result = served.generate(holder, state)
    for slot in range(2):
      token, valid, _ = result.data[slot]
      if valid:
        tokens[slot].append(int(token))
  # The step that reports the last token feeds nothing: its bound is one too many (safe).
  assert seen == [30 + n for n in range(1, engine.max_decode_length + 1)]
  assert min(seen) < engine.attend_buckets[0] < max(seen)  # more than one bucket was read
  ours = generate(model, params, prompts, GREEDY, max_new_tokens=engine.max_decode_length)
  assert tokens == [s.tokens for s in ours]
  assert [len(t) for t in tokens] == [engine.max_decode_length] * 2


_LOGGER_PROBE = """
import logging, sys
import jax
root = logging.getLogger()
before = (root.level, len(root.handlers))
if sys.argv[1] == 'shim':
  from rlax_llm.rollout import jetstream_adapter
  jetstream_adapter.import_jetstream()
else:  # the bare import, with only the stubs it needs to import at all
  import types
  jax.tree_map = jax.tree.map
  vocabularies = types.ModuleType('seqio.vocabularies')
  vocabularies.Vocabulary = vocabularies.SentencePieceVocabulary = type('V', (), {})
  sys.modules['seqio'] = types.ModuleType('seqio')
  sys.modules['seqio'].vocabularies = sys.modules['seqio.vocabularies'] = vocabularies
  import jetstream.core.orchestrator
print(before == (root.level, len(root.handlers)), jax.tree_map is jax.tree.map)
"""


def test_shims_leave_the_root_logger_alone():
  """In a fresh interpreter (this one has imported JetStream already, so importing it again
  changes nothing): the bare import sets the root logger to DEBUG and adds a handler, the
  adapter's import leaves it as it was and aliases ``jax.tree_map`` to ``jax.tree.map``."""
  run = lambda mode: subprocess.run([sys.executable, '-c', _LOGGER_PROBE, mode], check=True,
                                    capture_output=True, text=True, cwd=ROOT).stdout.split()
  assert run('bare') == ['False', 'True']  # the control: the import does touch the logger
  assert run('shim') == ['True', 'True']
