"""The trainer's side of a sampler/trainer parity check (imported by the engine tests)."""

import numpy as np


def trainer_logprobs(score, params, pairs, width: int) -> list[np.ndarray]:
  """The trainer's recompute of each ``(prompt, sample)`` pair's log-probs, in one batch:
  ``score`` (a jitted ``Policy.sequence_log_probs``) of each prompt plus its sample's tokens,
  right-padded with zeros to ``width``, with the sample's support sizes. Returns one float32
  ``[len(sample.tokens)]`` array per pair (the trainer scores batches, not single rows)."""
  pairs = list(pairs)
  tokens = np.zeros((len(pairs), width), np.int32)
  sizes = np.zeros((len(pairs), width), np.int32)
  for row, (prompt, sample) in enumerate(pairs):
    n = len(prompt) + len(sample.tokens)
    tokens[row, :n] = list(prompt) + list(sample.tokens)
    sizes[row, len(prompt):n] = sample.supports
  logp = np.asarray(score(params, tokens, sizes).logp)
  return [logp[row, len(prompt) - 1:len(prompt) + len(sample.tokens) - 1]
          for row, (prompt, sample) in enumerate(pairs)]


def transformers_twin(model, params):
  """The transformers implementation of ``model``'s architecture (fp32, eval mode) holding
  ``params``: built from ``hf.config_to_hf`` and ``hf.params_to_hf``, the export path
  ``save_pretrained`` writes and ``test_hf_parity`` checks, without a trip through disk. For
  SmolLM2 it holds exactly what transformers' own GGUF loader reads (``test_gguf`` compares the
  two state dicts tensor by tensor), at a third of that loader's time."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from rlax_llm.models.files import hf  # pylint: disable=import-outside-toplevel
  config = transformers.AutoConfig.for_model(**hf.config_to_hf(model.config))
  twin = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
  state = {name: torch.tensor(array)
           for name, array in hf.params_to_hf(params, model.config).items()}
  missing, unexpected = twin.load_state_dict(state, strict=False)
  tied = {'lm_head.weight'} if model.config.tie_embeddings else set()
  assert set(missing) == tied and not unexpected, (missing, unexpected)
  if tied:
    assert twin.lm_head.weight.data_ptr() == twin.model.embed_tokens.weight.data_ptr()
  return twin
