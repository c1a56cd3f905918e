"""The tiny character-level model the harness and streaming tests serve (random weights):
``make_char_worker()``, which a test module makes its module-scoped fixture."""

import jax
import numpy as np

from rlax_llm.envs.seeds import CHARSET
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model
from rlax_llm.rollout.driver import Job
from rlax_llm.rollout.worker import InferenceWorker
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.sharding import make_mesh
from rlax_llm.tokenization import CharTokenizer

CHAR_VERSION = 7  # the version the worker holds
CHAR_TURN_TOKENS = 6  # its max_new_tokens
CHAR_SPEC = SamplingSpec(temperature=1.0)


def make_char_worker() -> InferenceWorker:
  """An inference worker over a 1-layer decoder with the environments' character tokenizer,
  holding version ``CHAR_VERSION``, prompts up to 40 tokens, replies up to 6, 8 slots."""
  tok = CharTokenizer(CHARSET)
  config = DecoderConfig(vocab_size=tok.vocab_size, num_layers=1, embed_dim=32, num_heads=2,
                         num_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=64)
  model, params = create_model(config, seed=0)
  worker = InferenceWorker(model, tok, make_mesh({'data': 1}, jax.devices()[:1]),
                           max_prompt_len=40, max_new_tokens=CHAR_TURN_TOKENS, slots=8)
  worker.load(CHAR_VERSION, params)
  # Compiles what the tests sample with (prefills of 1, 2 and 4 rows, each padded to a
  # power of two, in the 8- and 16-token buckets), so that no request waits on a compile.
  key = np.asarray(jax.random.key_data(jax.random.key(0)))[None]
  for rows in (1, 2, 4):
    for length in (5, 12):
      worker.driver.run([Job(prompt_ids=(1,) * length, num_samples=1, sampling=CHAR_SPEC,
                             max_new_tokens=CHAR_TURN_TOKENS, stop_ids=(tok.eos_id,), keys=key)
                         for _ in range(rows)])
  return worker
