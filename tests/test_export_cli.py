"""``python -m rlax_llm.export``: a run's checkpoint as a Hugging Face directory that
transformers loads with the same logits; its model card and its one-line errors."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

os.environ.setdefault('HF_HUB_OFFLINE', '1')
torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from flax import nnx  # noqa: E402
from smoke_config import smoke_config  # noqa: E402  # tests/smoke_config.py
from step_checkpoint import perturbed, write_step_checkpoint  # noqa: E402

from rlax_llm import evaluate, export  # noqa: E402
from rlax_llm.models import lora as lora_lib  # noqa: E402


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """A run's workdir holding step 5 (params version 5) of the smoke config's model, and that
  model and its params."""
  workdir = tmp_path_factory.mktemp('run')
  return (workdir, *write_step_checkpoint(workdir, smoke_config(), step=5, version=5))


TOKENS = np.random.RandomState(0).randint(3, 14, (2, 7))


def _logits(model, params):
  """Our model's logits of ``TOKENS`` (float32 [2, 7, vocab])."""
  return np.asarray(nnx.merge(model.graphdef, params)(jnp.asarray(TOKENS, jnp.int32)))


def _transformers_logits(out):
  """transformers' logits of ``TOKENS`` from the directory ``out``."""
  reference = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  with torch.no_grad():
    return reference(torch.tensor(TOKENS)).logits.float().numpy()


def test_export_loads_in_transformers_with_the_same_logits(run, tmp_path):
  workdir, model, params = run
  out = tmp_path / 'hf'
  export.main(['export', f'--checkpoint={workdir}', f'--out={out}'])
  assert {'config.json', 'model.safetensors', 'generation_config.json', 'README.md'} <= {
      p.name for p in out.iterdir()}
  np.testing.assert_allclose(_transformers_logits(out), _logits(model, params), atol=1e-4)
  card = (out / 'README.md').read_text()
  assert f'Exported from step 5 (params version 5) of `{workdir}/checkpoints/steps/5`' in card
  assert '| `model.name` | `"tiny"` |' in card and '| `total_steps` | `3` |' in card
  assert 'the `tiny` preset (seeded init)' in card


@pytest.mark.slow  # the plain export is the default run's; lora.merge_program has its own tests
def test_a_lora_checkpoint_exports_its_merged_weights(tmp_path):
  """A LoRA run's checkpoint (base + adapters, the adapters nonzero) exports a plain model
  whose logits are the merged weights', and its card says so."""
  config = smoke_config(lora__rank=2)
  _, _, model, base, _ = evaluate.policy_params(config)
  lora_model, template = lora_lib.create(model, base, lora_lib.from_config(config),
                                         seed=config.seed)
  write_step_checkpoint(tmp_path, config, step=2, version=2, params=perturbed(template))
  out = tmp_path / 'hf'
  export.main(['export', f'--checkpoint={tmp_path}', f'--out={out}'])
  merged = lora_lib.merge_program(lora_model)(perturbed(template))
  ours = _logits(model, merged)
  assert not np.allclose(ours, _logits(model, base), atol=1e-3)  # the adapters count
  np.testing.assert_allclose(_transformers_logits(out), ours, atol=1e-4)
  assert 'LoRA run: the adapters are merged into the base weights' in (
      out / 'README.md').read_text()


def test_export_errors_are_one_line(run, tmp_path):
  workdir, _, _ = run
  with pytest.raises(SystemExit, match=r'^error: no checkpoint at .*nowhere: pass a run'):
    export.main(['export', f'--checkpoint={tmp_path / "nowhere"}', f'--out={tmp_path / "o"}'])
  (tmp_path / 'full').mkdir()
  (tmp_path / 'full' / 'x').write_text('')
  with pytest.raises(SystemExit, match=r'^error: --out=.*full is not empty; pass an empty or '
                     'new directory, or --overwrite'):
    export.main(['export', f'--checkpoint={workdir}', f'--out={tmp_path / "full"}'])
  with pytest.raises(SystemExit, match=r'^error: --out is required'):
    export.main(['export', f'--checkpoint={workdir}'])
  (tmp_path / 'full' / 'README.md').write_text('an old card')
  export.main(['export', f'--checkpoint={workdir}', f'--out={tmp_path / "full"}',
               '--overwrite'])
  assert (tmp_path / 'full' / 'README.md').read_text().count('## Training run') == 1


def test_export_help_documents_every_flag(capsys):
  export.main(['export', '--help'])
  out = capsys.readouterr().out
  assert out.startswith('usage: python -m rlax_llm.export --checkpoint=PATH --out=DIR')
  for line in ('--checkpoint: The checkpoint to export', '--out: The directory',
               '--overwrite: Write into a non-empty --out'):
    assert line in out
