"""Docs that must follow the code: every config key is in docs/config.md, the README's
algorithms table is the loss table, the README's results are RESULTS.md's headline, links
resolve."""

import importlib.util
import pathlib
import re
import shlex
import sys

import ml_collections
import pytest

from rlax_llm.cli import load_config, load_config_file

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the recipes' tooling lives in the checkout, not the package

# pylint: disable=wrong-import-position
from launch.recipes import cli as recipes_cli
from launch.recipes.checks import check_local, memory_check
from launch.recipes.slices import get_slice


def _leaves(config: ml_collections.ConfigDict, prefix: str = '') -> list[str]:
  out = []
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict) and len(value):
      out += _leaves(value, f'{prefix}{key}.')
    else:
      out.append(prefix + key)
  return out


@pytest.mark.parametrize('config', ['default.py', 'smollm2.py', 'math.py', 'python.py',
                                    'agent.py'])
def test_every_config_key_is_in_the_config_reference(config):
  listed = set(re.findall(r'`([a-z_][a-z0-9_.]*)`', (ROOT / 'docs' / 'config.md').read_text()))
  missing = [k for k in _leaves(load_config_file(str(ROOT / 'configs' / config)))
             if k not in listed]
  assert not missing, f'add these keys of configs/{config} to docs/config.md: {missing}'


def algorithms_table() -> str:
  """README's algorithms table, rendered from rlax_llm.losses.LOSSES (the one definition)."""
  from rlax_llm.losses import LOSSES  # pylint: disable=import-outside-toplevel
  rows = ['| loss | advantages | ratio | objective | aggregation | clip (low, high) | reference |',
          '| --- | --- | --- | --- | --- | --- | --- |']
  for name, spec in LOSSES.items():
    clip = (f'{spec.eps_low:g}, {spec.eps_high:g}' if spec.objective in ('ppo_clip', 'cispo')
            else '-')
    rows.append(f'| `{name}` | {spec.advantage_estimator} | {spec.ratio} | {spec.objective} | '
                f'{spec.aggregation} | {clip} | {spec.reference} |')
  return '\n'.join(rows)


def test_readme_algorithms_table_matches_the_losses():
  assert algorithms_table() in (ROOT / 'README.md').read_text(), (
      'README.md\'s algorithms table differs from rlax_llm.losses.LOSSES; paste:\n'
      + algorithms_table())


@pytest.mark.parametrize('doc', ['README.md', 'docs/config.md', 'docs/architecture.md',
                                 'docs/checkpoints.md', 'docs/storage.md',
                                 'docs/tasks.md', 'docs/custom_tasks.md',
                                 'docs/own_model_and_data.md', 'docs/models.md',
                                 'docs/serving.md', 'docs/rollout.md',
                                 'docs/environments.md',
                                 'benchmarks/RESULTS.md', 'benchmarks/LAB_NOTES.md',
                                 'launch/README.md',
                                 'launch/tpu_vm/README.md', 'launch/multihost/README.md',
                                 'launch/ray/README.md', 'launch/gke/README.md'])
def test_relative_links_resolve(doc):
  path = ROOT / doc
  for target in re.findall(r'\]\(([^)#]+)', path.read_text()):
    if not target.startswith('http'):
      assert (path.parent / target).exists(), f'{doc} links to {target}, which does not exist'


def test_the_longest_files_scheduled_first_exist():
  """tests/conftest.py's LONGEST_FILES names test files: a renamed one would silently lose
  its place at the front of the test run."""
  # By path: `import conftest` is whichever conftest.py pytest put first on sys.path
  # (tests/backends/ has its own).
  spec = importlib.util.spec_from_file_location('tests_conftest', ROOT / 'tests/conftest.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  names = module.LONGEST_FILES
  assert len(set(names)) == len(names), names
  missing = [name for name in names if not (ROOT / name).is_file()]
  assert not missing, f'LONGEST_FILES names files that do not exist: {missing}'


def _section(path: pathlib.Path, heading: str) -> str:
  """The text under the markdown heading ``heading`` (e.g. '## Results'), up to the next
  heading of the same or a higher level."""
  text = path.read_text()
  level = heading.split()[0]
  match = re.search(rf'^{re.escape(heading)}\n(.*?)(?=^#{{1,{len(level)}}} |\Z)', text,
                    re.MULTILINE | re.DOTALL)
  assert match, f'{path.name} has no {heading!r} section'
  return match.group(1)


def _first_table(text: str) -> list[list[str]]:
  """The rows (cells stripped) of the first markdown table in ``text``, header and
  separator left out."""
  lines = text.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith('|'))
  rows = []
  for line in lines[start + 2:]:
    if not line.startswith('|'):
      break
    rows.append([cell.strip() for cell in line.strip().strip('|').split(' | ')])
  return rows


def headline() -> dict[str, list[str]]:
  """benchmarks/RESULTS.md's headline table: figure -> [value, goal, command, date, machine]."""
  rows = _first_table(_section(ROOT / 'benchmarks' / 'RESULTS.md', '## Headline'))
  assert all(len(row) == 6 for row in rows), [row for row in rows if len(row) != 6]
  figures = [row[0] for row in rows]
  assert len(set(figures)) == len(figures), 'a figure appears twice in the headline table'
  return {row[0]: row[1:] for row in rows}


def test_readme_results_are_rows_of_the_headline_table_of_results_md():
  """README's Results is a short table: every figure is in RESULTS.md's headline table with
  the same value, goal and command, and there are about ten of them."""
  rows = _first_table(_section(ROOT / 'README.md', '## Results'))
  assert all(len(row) == 4 for row in rows), [row for row in rows if len(row) != 4]
  assert 5 <= len(rows) <= 12, f'README Results has {len(rows)} figures; keep about ten'
  readme = {row[0]: row[1:] for row in rows}
  assert len(readme) == len(rows), 'a figure appears twice in README Results'
  results = headline()
  only_readme = sorted(set(readme) - set(results))
  assert not only_readme, f'README Results figures missing from RESULTS.md: {only_readme}'
  differ = {f: (readme[f], results[f][:3]) for f in readme if readme[f] != results[f][:3]}
  assert not differ, f'value, goal or command differ (README, RESULTS.md): {differ}'


def test_every_headline_goal_is_judged():
  """A figure with a goal says whether it was met, as the goal was set: '(met', '(missed'
  (or, for a figure that is not a measurement, '(not judged'); no goal is left unjudged."""
  for figure, (_, goal, _, _, _) in headline().items():
    if goal.startswith('-'):
      continue
    assert re.search(r'\((met|missed|not judged)\b', goal), (figure, goal)


def test_every_headline_figure_names_a_command_and_when_and_where_it_was_measured():
  for figure, (value, _, command, date, machine) in headline().items():
    assert value and machine, figure
    assert re.fullmatch(r'\d{4}-\d{2}-\d{2}', date), (figure, date)
    assert command.startswith('`') and command.endswith('`'), (figure, command)
    words = command.strip('`').split()
    if words[0].startswith('benchmarks/'):
      assert (ROOT / words[0]).is_file(), f'{figure}: {words[0]} does not exist'
    else:
      assert words[:2] in (['bash', 'scripts/run.sh'], ['bash', 'scripts/test.sh'],
                           ['python', '-m']), (figure, command)


def test_readme_opens_with_what_it_is_then_the_two_commands():
  text = (ROOT / 'README.md').read_text()
  before, block = re.match(r'(.*?)```bash\n(.*?)```', text, re.DOTALL).groups()
  statement = [line for line in before.splitlines()[1:] if line.strip()]
  assert before.startswith('# rlax_llm\n') and 0 < len(statement) <= 5, statement
  commands = [line.split('#')[0].strip() for line in block.splitlines()]
  assert commands == ['bash scripts/run.sh', 'bash scripts/test.sh'], commands


def test_readme_keeps_to_this_repository():
  text = (ROOT / 'README.md').read_text()
  assert '../shared' not in text and '/work/' not in text


def test_weight_transfer_docs_name_the_gather_and_the_per_shard_push():
  """The docs that describe the weight transfer name the multi-host local backend's gather
  (`host_params()`) and the Ray trainer across hosts that pushes per shard
  (`ray.trainer_processes`), and no longer call that push planned."""
  for doc in ('README.md', 'docs/architecture.md'):
    text = (ROOT / doc).read_text()
    assert 'host_params()' in text and 'trainer_processes' in text, doc
    assert 'a Ray trainer spanning hosts' not in text, doc


def _bash_commands(doc: pathlib.Path) -> list[list[str]]:
  """The commands of ``doc``'s bash blocks as argument lists (continuation lines joined)."""
  blocks = re.findall(r'```bash\n(.*?)```', doc.read_text(), re.DOTALL)
  return [shlex.split(line) for block in blocks for line in block.replace('\\\n', ' ').splitlines()
          if line.strip() and not line.startswith('#')]


def test_own_model_and_data_commands_load_and_quote_the_printed_plan():
  """docs/own_model_and_data.md: its launch and recipe commands load (the config, every
  --config.KEY=VALUE key and type, the recipe's options), and the memory plan it quotes is
  the one the dry run prints for its command. (That the commands validate against the hub
  dataset was checked offline against a stand-in cache, as tests/hub_cache.py lays it out.)"""
  doc = ROOT / 'docs' / 'own_model_and_data.md'
  commands = [c for c in _bash_commands(doc) if c[:2] == ['python', '-m']]
  compiles = [c for c in commands if c[2:4] == ['launch.recipes', 'compile']]
  for command in compiles:  # "Before you book a TPU": the options and the config load
    opts, rest = recipes_cli.build_parser().parse_known_args(command[3:])
    assert opts.recipe == 'compile' and not rest, command
    load_config([f'--config={opts.config}'])
  commands = [c for c in commands if c not in compiles]
  assert len(compiles) == 2
  assert [c[2] for c in commands] == ['rlax_llm.launch', 'launch.recipes'], commands
  launch, recipe = commands
  config = load_config([a for a in launch[3:] if a.startswith('--config')])
  assert (config.model.path, config.task.path) == ('Qwen/Qwen2.5-0.5B-Instruct',
                                                   'hf://datasets/HuggingFaceH4/MATH-500')
  assert set(launch[3:]) - {a for a in launch if a.startswith('--config')} == {
      '--workdir=runs/own-smoke', '--print_config'}
  opts, rest = recipes_cli.build_parser().parse_known_args(recipe[3:])
  assert (opts.recipe, opts.dry_run, opts.workdir) == ('tpu-vm', True,
                                                       'gs://BUCKET/runs/math500-qwen')
  config = load_config([f'--config={opts.config}', *recipes_cli._split_overrides(rest)])
  slice_ = get_slice(opts.tpu_type)
  plan = memory_check(config, check_local(config, slice_, opts.recipe), slice_.hbm_gib,
                      slice_.hbm_gib, shared=True)
  assert f'# checked: {plan[-1]}\n' in doc.read_text(), plan[-1]
