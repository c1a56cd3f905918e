"""The Cloud TPU user's path on a laptop (issue 64): ``--print_config`` of a TPU config offline
and on too few devices, and the console lines a run prints (in-process: no subprocess, no
network, no compile)."""

import json
import logging

import pytest
from huggingface_hub import constants

from rlax_llm import console, launch_help, roles
from rlax_llm.cli import load_config
from rlax_llm.errors import ConfigError

GSM8K = 'configs/gsm8k.py:Qwen2.5-1.5B-Instruct'


@pytest.fixture
def offline(monkeypatch):
  """HF_HUB_OFFLINE as huggingface_hub reads it: the hub check asks nothing."""
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')
  monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', True)


def test_print_config_of_a_hub_config_offline_prints_it_and_says_what_was_not_verified(
    offline, capsys):
  """Offline, the hub dataset is not read (it used to be, and failed after 25 s of retries);
  the config is printed and one note on stderr names what was not verified (the 8 fake
  devices of tests/conftest.py stand in for a v5e-8)."""
  del offline
  launch_help.print_config(load_config([f'--config={GSM8K}']))
  out, err = capsys.readouterr()
  assert json.loads(out)['task']['path'] == 'hf://datasets/openai/gsm8k'
  assert err == ('note: model and dataset ids not verified: HF_HUB_OFFLINE is set (offline); '
                 'the run fetches Qwen/Qwen2.5-1.5B-Instruct, hf://datasets/openai/gsm8k when '
                 "it starts and reads the task's data then\n")


def test_print_config_of_a_config_the_devices_do_not_fit_names_the_fix(offline, capsys):
  """A TPU config on a laptop: the mesh error says how many devices this machine has and how
  to check the config for the slice's chips (CPU devices standing in, or the recipes)."""
  del offline
  config = load_config([f'--config={GSM8K}', '--config.mesh.inference.tensor=3'])
  with pytest.raises(ConfigError) as e:
    launch_help.print_config(config)
  message = str(e.value)
  assert message.startswith('config.mesh.inference: ')
  assert '(this machine has 8 devices, CPU)' in message
  assert 'JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=CHIPS python -m rlax_llm.launch' in message
  assert 'python -m launch.recipes tpu-vm --tpu-type=SLICE' in message
  assert capsys.readouterr().out == ''


def test_the_rl_starting_point_is_logged_as_a_metrics_line_not_a_dict():
  line = console.format_metrics({'eval/accuracy': 0.25, 'eval/pass@4': 0.5, 'eval/n': 200})
  assert line == 'eval/accuracy 0.25, eval/pass@4 0.5, eval/n 200'


def test_the_device_count_is_spelled_in_the_singular_for_one(monkeypatch, caplog):
  with caplog.at_level(logging.INFO):
    roles.trainer_mesh(load_config(['--config=configs/default.py:smoke']))
  assert '8 devices; trainer mesh' in caplog.text
  monkeypatch.setattr(roles.jax, 'device_count', lambda: 1)
  assert roles.device_count_text() == '1 device'
