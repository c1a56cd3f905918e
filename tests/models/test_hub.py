"""Models by Hugging Face hub id (``rlax_llm.models.files.hub``), against a hub on loopback.

Random-initialised Llama / Qwen2 / Qwen3 checkpoints saved by ``transformers`` (sharded
safetensors) are served by ``tests/fake_hub.py`` with the routes ``snapshot_download`` uses,
next to files a loader must not fetch (a PyTorch pickle, an ``original/`` folder). The real
``huggingface_hub`` downloads them into a hub cache of its own layout; a second load reads
that cache with ``HF_HUB_OFFLINE=1``. Logits are compared with transformers' at the
tolerance of ``test_hf_parity``.
"""

import dataclasses
import json
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
tokenizers = pytest.importorskip('tokenizers')

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from fake_hub import FakeHub, hub_environment  # noqa: E402

from rlax_llm import model_spec, roles  # noqa: E402
from rlax_llm.config import load_config_file, validate_config  # noqa: E402
from rlax_llm.errors import CheckpointError, ConfigError  # noqa: E402
from rlax_llm.models import presets  # noqa: E402
from rlax_llm.models.decoder_config import DecoderConfig  # noqa: E402
from rlax_llm.models.files import hub  # noqa: E402
from rlax_llm.models.files.pretrained import from_pretrained, save_pretrained  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
             max_position_embeddings=64)
FAMILIES = {
    'llama': (transformers.LlamaConfig, dict(tie_word_embeddings=False)),
    'qwen2': (transformers.Qwen2Config, dict(tie_word_embeddings=False)),
    'qwen3': (transformers.Qwen3Config, dict(tie_word_embeddings=True)),
}
# What a load needs of these repositories (the fixture's shards are those transformers wrote).
NEEDED = {'config.json', 'generation_config.json', 'model.safetensors.index.json',
          'tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json'}
ATOL = 1e-4  # test_hf_parity's prefill tolerance


def _reference(family: str, seed: int):
  """A random-initialised transformers model of ``family`` (fp32, eval mode)."""
  config_cls, extra = FAMILIES[family]
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config_cls(**SMALL, **extra)).eval()
  with torch.no_grad():  # non-trivial norms and biases
    for name, p in model.named_parameters():
      if name.endswith('norm.weight') or name.endswith('.bias'):
        p.add_(0.1 * torch.randn_like(p))
  return model


def _repo_files(model, directory: pathlib.Path) -> dict[str, bytes]:
  """The repository of ``model`` as the hub holds one: transformers' sharded safetensors, a
  tokenizer, and files no loader here should fetch."""
  model.save_pretrained(directory, max_shard_size='20KB')
  vocab = ['<s>', '</s>', '<pad>', '[UNK]'] + [f'w{i}' for i in range(SMALL['vocab_size'] - 4)]
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {token: i for i, token in enumerate(vocab)}, unk_token='[UNK]'))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tokenizer.save(str(directory / 'tokenizer.json'))
  (directory / 'tokenizer_config.json').write_text(json.dumps(
      {'tokenizer_class': 'PreTrainedTokenizerFast', 'bos_token': '<s>', 'eos_token': '</s>',
       'pad_token': '<pad>', 'unk_token': '[UNK]'}))
  (directory / 'special_tokens_map.json').write_text(json.dumps({'eos_token': '</s>'}))
  files = {str(p.relative_to(directory)): p.read_bytes()
           for p in directory.rglob('*') if p.is_file()}
  files |= {'pytorch_model.bin': b'pickle', 'original/consolidated.00.pth': b'pickle',
            'original/model.safetensors': b'not for us', 'original/params.json': b'{}',
            'README.md': b'# a model\n'}
  return files


def _tokens(seed=0):
  return np.random.RandomState(seed).randint(0, SMALL['vocab_size'], (2, 12))


def _assert_matches(ours, reference):
  tokens = _tokens()
  with torch.no_grad():
    want = reference(torch.tensor(tokens)).logits.float().numpy()
  got = np.asarray(ours(jnp.asarray(tokens, jnp.int32)))
  np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


@pytest.fixture(scope='module')
def served(tmp_path_factory):
  """``(hub, references)``: a FakeHub with ``org/tiny-FAMILY`` for each family, and
  ``org/revisions`` (main: seed 1, tag v1: seed 2, both qwen3); references by repo id and
  revision."""
  references = {}
  with FakeHub() as fake:
    for family in FAMILIES:
      model = _reference(family, seed=0)
      fake.add_commit(f'org/tiny-{family}',
                      _repo_files(model, tmp_path_factory.mktemp(family)))
      references[f'org/tiny-{family}', ''] = model
    for seed, ref in ((2, 'v1'), (1, 'main')):
      model = _reference('qwen3', seed=seed)
      sha = fake.add_commit('org/revisions',
                            _repo_files(model, tmp_path_factory.mktemp(f'rev{seed}')), ref=ref)
      references['org/revisions', ref] = references['org/revisions', sha] = model
    references['org/revisions', ''] = references['org/revisions', 'main']
    yield fake, references


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_hub_id_fetches_only_what_it_needs_then_loads_offline(served, family, tmp_path):
  fake, references = served
  repo = f'org/tiny-{family}'
  with hub_environment(fake, tmp_path):
    model, tokenizer = from_pretrained(repo)
  fetched = {path for r, path in fake.downloads if r == repo}
  shards = {p for p in fetched if p.endswith('.safetensors')}
  assert fetched == NEEDED | shards and len(shards) > 1, fetched  # no .bin, no original/
  assert all(p.startswith('model-') for p in shards)
  _assert_matches(model, references[repo, ''])
  assert tokenizer.encode('w1 w2') == [5, 6]

  # huggingface_hub's own cache layout: blobs, the branch's ref, the commit's snapshot.
  storage = tmp_path / f'models--org--tiny-{family}'
  sha = (storage / 'refs' / 'main').read_text()
  snapshot = storage / 'snapshots' / sha
  assert {p.name for p in snapshot.iterdir()} == NEEDED | shards
  assert len(list((storage / 'blobs').iterdir())) == len(NEEDED | shards)

  before = len(fake.downloads)
  with hub_environment(fake, tmp_path, offline=True):
    again, _ = from_pretrained(repo)
  assert len(fake.downloads) == before  # the cache only
  _assert_matches(again, references[repo, ''])


def test_revision_picks_its_snapshot(served, tmp_path):
  fake, references = served
  sha_v1 = fake.refs['org/revisions']['v1']
  with hub_environment(fake, tmp_path):
    for revision in ('', 'v1', 'main', sha_v1):
      model, _ = from_pretrained('org/revisions', revision=revision)
      _assert_matches(model, references['org/revisions', revision])
  with hub_environment(fake, tmp_path, offline=True):
    model, _ = from_pretrained('org/revisions', revision='v1')
    _assert_matches(model, references['org/revisions', 'v1'])
  assert sorted(p.name for p in (tmp_path / 'models--org--revisions' / 'snapshots').iterdir()
                ) == sorted(set(fake.refs['org/revisions'].values()))


def test_offline_without_the_repo_in_the_cache_says_how_to_get_it(served, tmp_path):
  fake, _ = served
  with hub_environment(fake, tmp_path, offline=True), pytest.raises(CheckpointError) as error:
    from_pretrained('org/tiny-llama')
  message = str(error.value)
  assert "'org/tiny-llama' is not (completely) in the hub cache" in message
  assert 'HF_HUB_OFFLINE is set' in message and '`hf download org/tiny-llama --include' in message
  assert fake.downloads.count(('org/tiny-llama', 'config.json')) <= 1  # nothing fetched here


@pytest.mark.parametrize('repo, revision, message', [
    ('org/no-such-model', '', "hub model 'org/no-such-model' is not on the hub"),
    ('org/tiny-qwen2', 'v7', "the repository has no revision 'v7'"),
])
def test_a_missing_repo_or_revision_is_one_clear_error(served, tmp_path, repo, revision,
                                                        message):
  fake, _ = served
  with hub_environment(fake, tmp_path), pytest.raises(CheckpointError, match=message):
    from_pretrained(repo, revision=revision)


def test_a_gated_repo_needs_a_token(tmp_path):
  model = _reference('llama', seed=3)
  with FakeHub(token='hf_secret') as fake:
    fake.add_commit('org/gated', _repo_files(model, tmp_path / 'repo'), gated=True)
    with hub_environment(fake, tmp_path / 'cache'), pytest.raises(CheckpointError) as error:
      from_pretrained('org/gated')
    assert "'org/gated' is gated: accept its terms at" in str(error.value)
    assert 'HF_TOKEN' in str(error.value)
    with hub_environment(fake, tmp_path / 'cache', token='hf_secret'):
      loaded, _ = from_pretrained('org/gated')
  _assert_matches(loaded, model)


def test_a_repo_without_safetensors_weights_is_refused(tmp_path):
  config = json.dumps({'architectures': ['LlamaForCausalLM'], 'model_type': 'llama'}).encode()
  with FakeHub() as fake:
    fake.add_commit('org/pickles', {'config.json': config, 'pytorch_model.bin': b'pickle'})
    with hub_environment(fake, tmp_path), pytest.raises(CheckpointError,
                                                        match='no \\*.safetensors weights'):
      from_pretrained('org/pickles')
    assert fake.downloads == [('org/pickles', 'config.json')]


def test_an_unsupported_architecture_names_the_supported_ones(served, tmp_path):
  fake, _ = served
  files = dict(fake.commits['org/tiny-llama'][fake.refs['org/tiny-llama']['main']])
  config = json.loads(files['config.json'])
  config.update(architectures=['MistralForCausalLM'], model_type='mistral')
  files['config.json'] = json.dumps(config).encode()
  fake.add_commit('org/mistral', files)
  with hub_environment(fake, tmp_path), pytest.raises(CheckpointError) as error:
    from_pretrained('org/mistral')
  message = str(error.value)
  assert "['MistralForCausalLM']" in message and "'mistral'" in message
  assert ("['LlamaForCausalLM', 'MixtralForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM', "
          "'Qwen3MoeForCausalLM']") in message


@pytest.mark.parametrize('path, expected', [
    ('Qwen/Qwen2.5-0.5B-Instruct', True), ('meta-llama/Llama-3.2-1B-Instruct', True),
    ('HuggingFaceTB/SmolLM2-135M', True), ('org/model.gguf', False), ('a/b/c', False),
    ('/abs/dir', False), ('./org/name', False), ('org--x/name', False), ('org/na..me', False),
    ('name', False), ('org/', False),
])
def test_is_hub_id(path, expected):
  assert hub.is_hub_id(path) is expected


def test_a_local_directory_named_like_a_hub_id_is_local(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / 'Qwen' / 'Qwen3-0.6B').mkdir(parents=True)
  assert not hub.is_hub_id('Qwen/Qwen3-0.6B')
  assert hub.resolve_model_path('Qwen/Qwen3-0.6B') == pathlib.Path('Qwen/Qwen3-0.6B')


def test_a_revision_for_a_local_path_is_refused(tmp_path):
  with pytest.raises(ConfigError, match="revision 'main' was given for"):
    hub.resolve_model_path(tmp_path, 'main')
  assert hub.resolve_model_path(tmp_path) == tmp_path


# ----------------------------------------------------------------------------- the config


def _config(**model):
  config = load_config_file(str(ROOT / 'rlax_llm' / 'configs' / 'default.py'))
  for key, value in model.items():
    config.model[key] = value
  return config


@pytest.mark.parametrize('name', ['auto', 'qwen3-0.6b'])
def test_validation_takes_a_hub_id_without_fetching_it(name):
  # Nothing is fetched: the id does not exist on the test hub and nothing listens for it.
  validate_config(_config(name=name, path='Qwen/Qwen3-0.6B', revision='main'))


@pytest.mark.parametrize('model, message', [
    (dict(name='auto'), "config.model.name='auto' needs config.model.path"),
    (dict(name='auto', path='no/such/dir/x'), 'does not exist and is not a Hugging Face hub id'),
    (dict(name='auto', path=str(ROOT / 'tests'), revision='v1'),
     "config.model.revision='v1' picks a revision of a hub model"),
    (dict(name='smollm2-135m', revision='v1'), 'config.model.revision='),
])
def test_validation_errors_name_the_key(model, message):
  with pytest.raises(ConfigError, match=message):
    validate_config(_config(**model))


def test_auto_and_a_matching_preset_load_a_hub_model_a_mismatch_is_named(served, tmp_path,
                                                                          monkeypatch):
  fake, references = served
  tiny_qwen3 = DecoderConfig(
      vocab_size=64, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8,
      mlp_dim=48, tie_embeddings=True, qk_norm=True, family='qwen3')
  monkeypatch.setitem(presets.PRESETS, 'test-qwen3', tiny_qwen3)
  monkeypatch.setitem(model_spec.PRESET_ARCHITECTURES, 'test-qwen3', tiny_qwen3)  # validation's
  with hub_environment(fake, tmp_path):
    for name in ('auto', 'test-qwen3'):
      config = _config(name=name, path='org/tiny-qwen3', max_seq_len=None)
      validate_config(config)
      model, params, tokenizer = roles.build_model(config, roles.build_task(config))
      assert model.config.family == 'qwen3' and tokenizer.eos_id == 1
    with pytest.raises(ConfigError) as error:
      roles.build_model(_config(name='qwen3-0.6b', path='org/tiny-qwen3', max_seq_len=None),
                        None)
  message = str(error.value)
  assert message.startswith("config.model.path='org/tiny-qwen3' (at ")
  assert "is not a 'qwen3-0.6b' checkpoint: vocab_size 64 (preset: 151936)" in message
  assert "or to 'auto'" in message
  # The experts' fields are the architecture's too: a dense checkpoint under a MoE preset.
  moe = dataclasses.replace(tiny_qwen3, family='qwen3_moe', num_experts=4,
                            num_experts_per_tok=2, moe_mlp_dim=16)
  monkeypatch.setitem(presets.PRESETS, 'test-qwen3', moe)
  with hub_environment(fake, tmp_path), pytest.raises(ConfigError, match=(
      r"family 'qwen3' \(preset: 'qwen3_moe'\), num_experts 0 \(preset: 4\), "
      r"num_experts_per_tok 0 \(preset: 2\), moe_mlp_dim 0 \(preset: 16\)")):
    roles.build_model(_config(name='test-qwen3', path='org/tiny-qwen3', max_seq_len=None), None)


# ----------------------------------------------------------------------------- export


def test_export_loads_in_transformers_and_from_the_hub_as_is(served, tmp_path):
  fake, references = served
  with hub_environment(fake, tmp_path / 'cache'):
    model, tokenizer = from_pretrained('org/tiny-qwen2')
  out = tmp_path / 'export'
  save_pretrained(model, tokenizer, out, max_shard_bytes=20_000, base_model='org/tiny-qwen2')
  names = {p.name for p in out.iterdir()}
  shards = {n for n in names if n.endswith('.safetensors')}
  assert names == NEEDED | shards | {'README.md'} and len(shards) > 1
  config = json.loads((out / 'config.json').read_text())
  assert (config['architectures'], config['model_type'], config['torch_dtype']) == (
      ['Qwen2ForCausalLM'], 'qwen2', 'float32')
  card = (out / 'README.md').read_text()
  assert card.startswith('---\nlibrary_name: transformers\n')
  assert 'base_model: org/tiny-qwen2' in card

  loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  _assert_matches(model, loaded)
  # (AutoTokenizer would take Qwen2's tokenizer class from config.json: this toy vocabulary is
  # word-level, not Qwen2's BPE.)
  reloaded = transformers.PreTrainedTokenizerFast.from_pretrained(out)
  assert reloaded('w1 w2')['input_ids'] == tokenizer.encode('w1 w2') == [5, 6]

  # The directory uploaded as is is a hub repository the loader reads back.
  fake.add_commit('org/exported', {p.name: p.read_bytes() for p in out.iterdir()})
  with hub_environment(fake, tmp_path / 'cache'):
    again, _ = from_pretrained('org/exported')
  _assert_matches(again, references['org/tiny-qwen2', ''])

  save_pretrained(model, tokenizer, out)  # one file again: the shards of before are gone
  assert {p.name for p in out.glob('*.safetensors')} == {'model.safetensors'}
  assert not (out / 'model.safetensors.index.json').exists()
