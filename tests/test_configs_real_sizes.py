"""configs/gsm8k.py (real model sizes on Cloud TPU): its variants, presets and the memory plan
per chip that the recipes' dry run prints (``presets.memory_plan``), against a hand
calculation and against each slice's HBM. Nothing is downloaded: the plan needs only the
preset's architecture.
"""

import math
import os
import pathlib
import subprocess
import sys

import pytest

from rlax_llm import roles
from rlax_llm.cli import load_config
from rlax_llm.configs import gsm8k
from rlax_llm.launch_help import help_text
from rlax_llm.models import presets

from hub_keys import missing_hub_keys  # tests/hub_keys.py

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the recipes' tooling lives in the checkout, not the package

# pylint: disable=wrong-import-position
from launch.recipes.checks import check_local, memory_check
from launch.recipes.slices import SLICES, SliceError

GIB = 2**30
# The slices each variant is meant for: single hosts and multi-host sizes of each generation.
SLICE_NAMES = ('v5e-8', 'v4-8', 'v5p-8', 'v6e-8', 'v5e-16', 'v5e-32', 'v4-16', 'v4-32',
               'v5p-16', 'v5p-32', 'v5p-128')


def _config(variant: str):
  return load_config([f'--config={ROOT / "configs/gsm8k.py"}:{variant}'])


def _plan_lines(config, slice_name: str) -> tuple[object, list[str]]:
  slice_ = SLICES[slice_name]
  plan = check_local(config, slice_, 'multihost' if slice_.multi_host else 'tpu-vm')
  return plan, memory_check(config, plan, slice_.hbm_gib, slice_.hbm_gib, shared=True)


def test_variants_name_hub_models_of_presets_with_the_agreed_keys():
  assert gsm8k.VARIANTS == ('Qwen2.5-0.5B-Instruct', 'Qwen2.5-1.5B-Instruct', 'Qwen3-0.6B',
                            'Qwen3-1.7B', 'Llama-3.2-1B-Instruct')
  for variant in gsm8k.VARIANTS:
    c = _config(variant)
    preset, repo, _ = gsm8k.MODELS[variant]
    assert c.model.name == preset and preset in presets.PRESETS
    assert c.model.path == repo and repo.endswith('/' + variant) and c.model.revision == ''
    assert (c.model.param_dtype, c.model.dtype) == ('float32', 'bfloat16')
    assert c.task.to_dict() | {'system_prompt': None, 'instruction': None} == dict(
        name='math', path='hf://datasets/openai/gsm8k', hf_config='main', split='train',
        eval_split='test', question_field='question', answer_field='answer', num_eval=256,
        format='chat', system_prompt=None, instruction=None)
    assert c.mesh.trainer.to_dict() == {'data': 1, 'fsdp': -1, 'tensor': 1}
  assert _config('Qwen2.5-0.5B-Instruct').to_dict() == gsm8k.get_config().to_dict()
  with pytest.raises(ValueError, match="Unknown variant 'qwen3' of configs/gsm8k.py; valid: "
                                       'Qwen2.5-0.5B-Instruct, '):
    gsm8k.get_config('qwen3')


def test_help_lists_the_config_and_its_variants():
  text = help_text()
  assert 'gsm8k.py' in text
  for variant in gsm8k.VARIANTS:
    assert variant in text


def test_memory_plan_of_qwen3_0_6b_on_v5e_8_matches_a_hand_calculation():
  """Qwen3-0.6B (config.json: 28 layers, d 1024, 16 heads, 8 kv heads, head_dim 128, mlp 3072,
  vocab 151936, tied) on v5e-8: trainer fsdp 8, one worker of data 2 x tensor 4."""
  config = _config('Qwen3-0.6B')
  plan, lines = _plan_lines(config, 'v5e-8')
  assert plan.trainer_mesh == {'data': 1, 'fsdp': 8, 'tensor': 1}
  assert plan.inference_mesh == {'data': 2, 'fsdp': 1, 'tensor': 4}
  layers, d, heads, kv_heads, hd, mlp, vocab = 28, 1024, 16, 8, 128, 3072, 151_936
  per_layer = 2 * d + 2 * hd + d * heads * hd * 2 + d * kv_heads * hd * 2 + 3 * d * mlp
  n = layers * per_layer + vocab * d + d  # + the tied embedding and the final norm
  assert n == presets.count_params(presets.get_preset('qwen3-0.6b'))
  # Trainer: everything has an 'embed' axis (split 8 ways) but q_norm and k_norm (head_dim).
  replicated = layers * 2 * hd
  params = 4 * ((n - replicated) / 8 + replicated)  # float32 master copy
  optimizer = 2 * params  # AdamW: two float32 moments
  gradients = 2 * params  # the gradient and, with 8 micro-batches, its accumulator
  # Activations (bfloat16, remat 'full'): 256 rows / 8 micro-batches / 8 devices = 4 rows of
  # 384 + 640 = 1024 tokens; block inputs saved, one block in flight, logits 128 at a time.
  rows, length, t = 4, 1024, 4 * 1024
  saved = layers * t * 2 * d
  work = t * 2 * (5 * d + 3 * heads * hd + 4 * kv_heads * hd + 4 * mlp) + (
      4 * rows * heads * length**2)
  logits = 3 * 4 * rows * 128 * vocab
  # Worker: heads, kv heads, mlp and vocab split 4 ways (tensor); norms replicated.
  inference_params = 4 * (layers * (2 * d + 2 * hd + (2 * d * heads * hd + 2 * d * kv_heads
                                                      * hd + 3 * d * mlp) / 4)
                          + vocab * d / 4 + d)
  # KV cache: 256 slots x 1024 positions x layers x kv heads x head_dim x (k, v) x bfloat16,
  # slots over data 2 and kv heads over tensor 4.
  kv = 256 * 1024 * layers * kv_heads * hd * 2 * 2 / (2 * 4)
  inference_logits = 4 * (256 / 2) * vocab * 4
  want = dict(params=params, optimizer=optimizer, gradients=gradients, reference=0.0,
              activations=saved + work + logits, inference_params=inference_params,
              kv_cache=kv, inference_logits=inference_logits)
  model = presets.get_preset('qwen3-0.6b').with_execution(
      param_dtype=roles.DTYPES['float32'], dtype=roles.DTYPES['bfloat16'], remat='full')
  got = roles.run_memory_plan(model, config, plan.trainer_mesh, plan.inference_mesh,
                              shared=True)
  for field, value in want.items():
    assert getattr(got, field) == pytest.approx(value, rel=1e-9), field
  total = sum(want.values())
  assert got.trainer_bytes + got.inference_bytes == pytest.approx(total, rel=1e-9)
  assert lines[-1] == (f'memory plan per chip (qwen3-0.6b): trainer + inference: '
                       f'{total / GIB:.2f} GiB of 16.00 GiB HBM per chip '
                       f'({100 * total / (16 * GIB):.0f}%)')
  assert lines[0].startswith(f'memory plan per chip (qwen3-0.6b): trainer: params '
                             f'{params / GIB:.2f} GiB, optimizer {optimizer / GIB:.2f} GiB')


@pytest.mark.parametrize('variant', gsm8k.VARIANTS)
def test_every_variant_fits_the_chips_of_every_slice_it_is_meant_for(variant):
  config = _config(variant)
  for name in SLICE_NAMES:
    _, lines = _plan_lines(config, name)
    total = float(lines[-1].split('trainer + inference: ')[1].split(' GiB')[0])
    assert 0 < total <= SLICES[name].hbm_gib * 0.8, (name, lines)  # 20% headroom for XLA


def test_a_plan_that_exceeds_hbm_is_refused_naming_the_fixes():
  with pytest.raises(SliceError, match=r'memory: the trainer \+ inference chips need 21\.\d\d '
                                       r'GiB each for qwen3-1\.7b but a chip has 16 GiB of HBM'
                                       r' \(trainer: params .*; shard more'):
    _plan_lines(_config('Qwen3-1.7B'), 'v5e-4')


@pytest.mark.parametrize('args', [
    ('tpu-vm', '--tpu-type=v5e-8', '--config=configs/gsm8k.py:Qwen3-1.7B'),
    ('tpu-vm', '--tpu-type=v4-8', '--config=configs/gsm8k.py:Llama-3.2-1B-Instruct'),
    ('tpu-vm', '--tpu-type=v5p-8', '--config=configs/gsm8k.py:Qwen2.5-1.5B-Instruct'),
    ('multihost', '--tpu-type=v5e-16', '--config=configs/gsm8k.py:Qwen3-0.6B'),
])
def test_the_dry_run_prints_the_memory_plan_before_the_commands(args):
  missing = missing_hub_keys()
  if missing:
    pytest.skip(f'the config validation of this checkout lacks {", ".join(missing)}')
  env = dict(os.environ, HF_HUB_OFFLINE='1',
             PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''))
  result = subprocess.run([sys.executable, '-m', 'launch.recipes', *args, '--zone=z',
                           '--workdir=gs://b/r', '--dry-run'], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  plan = [line for line in out.splitlines() if line.startswith('# checked: memory plan')]
  assert len(plan) == 3 and 'HBM per chip' in plan[-1]
  assert out.index('# checked: memory plan') < out.index('gcloud compute tpus')
  assert math.isfinite(float(plan[-1].split('inference: ')[1].split(' GiB')[0]))
