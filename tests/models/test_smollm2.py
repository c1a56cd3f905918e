"""The real SmolLM2-135M-Instruct (GGUF, Q4_1) against transformers holding the same weights
(``test_gguf.py`` checks our GGUF reader against transformers' own, tensor by tensor)."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

os.environ.setdefault('HF_HUB_OFFLINE', '1')
torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from rlax_llm.models import from_pretrained, smollm2_gguf_path  # noqa: E402
from rlax_llm.models.files import gguf as gguf_lib  # noqa: E402
from rlax_llm.models.model import split_module  # noqa: E402
from rlax_llm.sampling_spec import GREEDY  # noqa: E402
from rlax_llm.rollout.driver import generate  # noqa: E402

from parity import transformers_twin  # noqa: E402  (tests/parity.py)

QUESTION = [{'role': 'user', 'content': 'What is the capital of France?'}]


OPENED = []  # the files from_pretrained opened while the `ours` fixture loaded the model


@pytest.fixture(scope='module')
def ours():
  real_open = gguf_lib.open_gguf
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(gguf_lib, 'open_gguf', lambda path: OPENED.append(path) or real_open(path))
    return from_pretrained(smollm2_gguf_path())


def test_the_file_is_parsed_once_for_weights_and_tokenizer(ours):
  """Parsing the GGUF's metadata (a 49k-token vocabulary) takes seconds: from_pretrained
  shares one reader between the weights and the tokenizer."""
  del ours  # loaded: its tokenizer is checked by test_config_of_the_real_model
  assert OPENED == [smollm2_gguf_path()], OPENED


@pytest.fixture(scope='module')
def reference(ours):
  """transformers' Llama holding the weights we loaded: ``test_gguf`` checks that they equal,
  bit for bit, the state dict transformers' own GGUF loader reads from the same file."""
  return transformers_twin(*split_module(ours[0]))


def test_config_of_the_real_model(ours):
  model, tokenizer = ours
  c = model.config
  assert (c.num_layers, c.embed_dim, c.num_heads, c.num_kv_heads, c.vocab_size) == (
      30, 576, 9, 3, 49_152)
  assert c.tie_embeddings and c.family == 'llama'
  assert tokenizer.vocab_size == 49_152


def test_logits_match_transformers_on_the_same_gguf(ours, reference):
  model, tokenizer = ours
  ref_model = reference
  ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
  with torch.no_grad():
    ref = ref_model(torch.tensor([ids])).logits.float().numpy()
  got = np.asarray(model(jnp.asarray([ids], jnp.int32)))
  assert np.abs(got - ref).max() < 1e-3


def test_greedy_chat_completion_says_paris(ours):
  model, tokenizer = ours
  ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
  functional, params = split_module(model)
  sample, = generate(functional, params, [ids], GREEDY, max_new_tokens=12,
                     stop_ids=(tokenizer.eos_id,))
  text = tokenizer.decode(sample.tokens, skip_special_tokens=True)
  assert 'Paris' in text, text
