r"""``python -m rlax_llm.export``: a run's checkpoint as a Hugging Face model directory.

    python -m rlax_llm.export --checkpoint=runs/gsm8k --out=exports/gsm8k [--overwrite]
    python -m rlax_llm.export --checkpoint=gs://BUCKET/runs/gsm8k/checkpoints/steps/200 \
        --out=exports/gsm8k-200

reads the policy params of ``--checkpoint`` (a run's workdir: its latest step, or a step
directory; local or ``gs://``) with the run's own config (its ``config.json``; ``--config``
and ``--config.KEY=VALUE`` as ``python -m rlax_llm.evaluate`` takes them:
``evaluate.config_for``, ``evaluate.policy_params``) and writes them with
``rlax_llm.models.files.pretrained.save_pretrained``: ``config.json``, the weights as
``model.safetensors`` (sharded past 5 GB), ``generation_config.json``, the tokenizer's files
when the tokenizer can save them (Hugging Face tokenizers: ``tokenizer.json``), and a
``README.md`` model card, to which this adds the run: its config's summary, the checkpoint's
step and params version, and the base model id (``model.path`` when it is a hub id).
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads it with the same logits
(``tests/test_export_cli.py``); it is the format vLLM and the hub read (vLLM is not tested
here). A LoRA
run's checkpoint exports its merged weights (base + adapters: ``lora.merge_program``), a
plain model of the base's architecture. ``--out`` must not exist or be empty unless
``--overwrite``; a missing checkpoint, a non-empty ``--out`` and a config that does not fit
are one ``error: ...`` line each.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import ml_collections
from absl import flags

from rlax_llm import cli, console, evaluate
from rlax_llm.errors import ConfigError
from rlax_llm.model_spec import is_hub_id

if TYPE_CHECKING:
  from rlax_llm.checkpoint import StepInfo

# The config keys the model card lists (those that exist in the run's config).
CARD_KEYS = ('name', 'model.name', 'model.path', 'model.revision', 'task.name', 'rl.loss',
             'rl.learning_rate', 'rl.prompts_per_step', 'rl.group_size', 'total_steps',
             'seed', 'lora.rank')


def _get(config: ml_collections.ConfigDict, key: str):
  node = config
  for part in key.split('.'):
    if not hasattr(node, 'get') or part not in node:
      return None
    node = node[part]
  return node


def run_card(config: ml_collections.ConfigDict, step: StepInfo,
             lora: bool) -> str:
  """The model card's section on the run (markdown): the checkpoint's step and params
  version, the base model, whether LoRA adapters were merged, and ``CARD_KEYS``'s values."""
  which = 'the warm-up\'s checkpoint' if step.step is None else f'step {step.step}'
  path = config.model.get('path')
  base = (f'[{path}](https://huggingface.co/{path})' if path and is_hub_id(str(path))
          else f'`{path}`' if path else f'the `{config.model.name}` preset (seeded init)')
  lines = ['', '## Training run (rlax_llm)', '',
           f'Exported from {which} (params version {step.version}) of `{step.path}`; base '
           f'model: {base}.' + (' LoRA run: the adapters are merged into the base weights '
                                '(a plain model, no adapter files).' if lora else ''), '',
           '| config key | value |', '|---|---|']
  lines += [f'| `{key}` | `{json.dumps(_get(config, key))}` |' for key in CARD_KEYS
            if _get(config, key) is not None]
  return '\n'.join(lines) + '\n'


def export(config: ml_collections.ConfigDict, checkpoint: str, out: str | os.PathLike, *,
           overwrite: bool = False) -> StepInfo:
  """Writes ``checkpoint``'s policy params (``evaluate.policy_params``: merged for LoRA) with
  ``config``'s model and tokenizer as a Hugging Face directory ``out`` (module docstring).
  Returns the checkpoint exported.

  Raises:
    CheckpointError: no checkpoint at ``checkpoint``, or params that do not fit the config.
    ConfigError: ``out`` is a file, or a non-empty directory without ``overwrite``.
  """
  # pylint: disable=import-outside-toplevel  # Orbax, JAX and the model code: after --help
  from flax import nnx

  from rlax_llm.checkpoint import checkpoint_step
  from rlax_llm.models import lora as lora_lib
  from rlax_llm.models.files.pretrained import save_pretrained
  step = checkpoint_step(checkpoint)  # a missing checkpoint: before the model loads
  out = pathlib.Path(out)
  if out.exists() and not out.is_dir():
    raise ConfigError(f'--out={out} is a file; pass a directory to write the model into.')
  if out.is_dir() and any(out.iterdir()) and not overwrite:
    raise ConfigError(f'--out={out} is not empty; pass an empty or new directory, or '
                      '--overwrite to replace the model files in it.')
  _, _, model, params, tokenizer = evaluate.policy_params(config, checkpoint)
  lora = lora_lib.from_config(config) is not None
  path = config.model.get('path')
  card = out / 'README.md'
  if overwrite:
    card.unlink(missing_ok=True)  # save_pretrained keeps a card it finds: write a new one
  save_pretrained(nnx.merge(model.graphdef, params), tokenizer, out,
                  base_model=str(path) if path and is_hub_id(str(path)) else '')
  card.write_text(card.read_text(encoding='utf-8') + run_card(config, step, lora),
                  encoding='utf-8')
  return step


def _define_flags(values) -> dict:
  """``--checkpoint``, ``--out`` and ``--overwrite`` on the absl ``FlagValues`` ``values``."""
  return {
      'checkpoint': flags.DEFINE_string(
          'checkpoint', None, 'The checkpoint to export: a run\'s workdir (its latest step) '
          'or a checkpoints/steps/<step> directory, local or gs://.', flag_values=values),
      'out': flags.DEFINE_string('out', None, 'The directory to write the Hugging Face '
                                 'model into (new or empty, unless --overwrite).',
                                 flag_values=values),
      'overwrite': flags.DEFINE_bool('overwrite', False, 'Write into a non-empty --out, '
                                     'replacing the model files and the card there.',
                                     flag_values=values)}


_USAGE = """\
usage: python -m rlax_llm.export --checkpoint=PATH --out=DIR [--overwrite]
                                 [--config=PATH[:VARIANT]] [--config.KEY=VALUE ...]

Writes a run's checkpoint as a Hugging Face model directory (safetensors, config.json,
tokenizer, a model card naming the run, its step and its base model), loadable by
transformers' AutoModelForCausalLM.from_pretrained, vLLM or the hub. A LoRA run exports its
merged weights. --config defaults to the run's own config.json."""


def _help_text() -> str:
  """``--help``: the usage and every flag's help string."""
  lines = [_USAGE, '', 'flags:', *cli.flags_help(_define_flags, [
      ('--config=PATH[:VARIANT]', 'Config file and optional variant (default: the run\'s '
       'config.json beside the checkpoint).'),
      ('--config.KEY=VALUE', 'Override one field the run may change (as evaluate takes '
       'them).')])]
  return '\n'.join(lines) + '\n'


def main(argv: Sequence[str]) -> None:
  """The command line (module docstring). Raises SystemExit ``'error: ...'`` for any
  ``RlaxError`` and for a missing ``--checkpoint`` or ``--out``."""
  command = cli.command_line(argv, _help_text, _define_flags)
  if command is None:  # --help
    return
  flag = command.values
  with cli.one_line_errors():
    for name in ('checkpoint', 'out'):
      if not flag[name]:
        raise ConfigError(f'--{name} is required: python -m rlax_llm.export '
                          '--checkpoint=WORKDIR_OR_STEP_DIR --out=DIR.')
    from rlax_llm.checkpoint import checkpoint_step  # pylint: disable=import-outside-toplevel
    checkpoint_step(flag['checkpoint'])  # a missing checkpoint: before the config
    config = evaluate.config_for(command.config_args, flag['checkpoint'], doing='exporting')
    step = export(config, flag['checkpoint'], flag['out'], overwrite=flag['overwrite'])
    which = 'the warm-up' if step.step is None else f'step {step.step}'
    console.phase(f'exported {which} (params version {step.version}) of {step.path} to '
                  f'{flag["out"]}')


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  console.setup_logging()
  main(sys.argv)
