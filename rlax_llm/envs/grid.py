"""Grid: a FrozenLake puzzle in text, procedurally generated from the seed.

An adapter to ``gymnasium``'s FrozenLake (``gymnasium.envs.toy_text.frozen_lake``) rather than
another copy of its dynamics: ``reset(seed)`` generates a ``size x size`` map with gymnasium's
``generate_random_map(size, p=frozen_fraction, seed=seed)`` (start top left, goal bottom
right, each other tile frozen with probability ``frozen_fraction``, redrawn until a path
exists: solvable by construction), checks it again with a breadth-first search (whose
distances also serve the shaping and the oracle), and steps a non-slippery ``FrozenLakeEnv``.

The model sees the grid as text (``P`` = its position, ``G`` = goal, ``H`` = hole, ``.`` =
ice) and answers each turn with one move, ``up``, ``down``, ``left`` or ``right`` (the last of
these words in the message counts, in any case). Reaching the goal ends the episode with
reward 1.0; stepping into a hole ends it with 0.0; a move into the edge leaves the position
unchanged; a message without a move is described in the observation. Every one of these costs
the turn, and ``max_turns`` turns end the episode. With ``shaping > 0`` each move also earns
``shaping * (d_before - d_after)``, ``d`` the BFS distance to the goal (no shaping for a fall
into a hole), so a route's shaping adds up to ``shaping * d_start`` at the goal. Step-level
credit matters here: one move into a hole loses the episode. ``state_key`` is the grid's
identity and the position, so GiGPO groups the turns taken from one cell of one map.

With ``split_maps=True`` the train, held-out and validation seeds (``envs.seeds.seed_split``)
play disjoint sets of maps: every map belongs to one split by a hash of its tiles (a tenth
each to held-out and validation), and a seed whose map belongs to another split draws again
(from a hash of the seed and the attempt). Without it, distinct seeds often give one map: of
64 held-out 4x4 maps (80% ice), 32 are among the first 400 train seeds' maps.

``oracle_action`` walks a shortest route (the supervised warm-up's demonstrations). With
``demo_error_rate > 0`` the demonstrations are imperfect, as ``task.demo_error_rate``'s are
for arithmetic: the episode of a seed is, with that probability (a pure function of the
seed), demonstrated by a walker blind to the holes, who takes the shortest route as if every
tile were ice (down to the bottom row, then right: start and goal are opposite corners) and
falls into the first hole on it. A systematic mistake, so a warm-up on these demonstrations
plateaus below every map solved: right where the blind route is clear, wrong where it
crosses a hole.
"""

from __future__ import annotations

import collections
import re
import types
from typing import TYPE_CHECKING

from rlax_llm import extras
from rlax_llm.envs.base import EnvStep, TextEnv, check_demo_error_rate, draw_demo_error
from rlax_llm.envs.seeds import seed_split
from rlax_llm.tasks._util import check_int, stable_hash

if TYPE_CHECKING:  # gymnasium is the envs extra, imported when a GridEnv is made
  from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv

# gymnasium's FrozenLake action ids and the (row, column) offset of each move.
MOVES = {'left': (0, (0, -1)), 'down': (1, (1, 0)), 'right': (2, (0, 1)), 'up': (3, (-1, 0))}
DEFAULT_INSTRUCTION = (
    'You are on a frozen lake (P = you, G = goal, H = hole, . = ice). Reach G without stepping '
    'into a hole. Each turn, reply with one move: up, down, left or right.\n\n{grid}')
_MOVE_RE = re.compile(r'\b(up|down|left|right)\b', re.IGNORECASE)
_DEMO_STREAM = 'grid_demo'  # the CounterRng stream of demo_error_rate's draws
_SPLIT_STREAM = 'grid_split'  # the hash stream of split_maps
_SPLIT_ATTEMPTS = 1000  # redraws before a seed's split is declared to have no maps


def map_split(desc: list[str]) -> str:
  """The split (``envs.seeds.SPLITS``) a map belongs to with ``split_maps=True``: a hash of
  its tiles modulo 10 is 0 for ``'held_out'``, 1 for ``'validation'``, else ``'train'``."""
  bucket = stable_hash(_SPLIT_STREAM, *desc) % 10
  return 'held_out' if bucket == 0 else 'validation' if bucket == 1 else 'train'


def _frozen_lake() -> types.ModuleType:
  """gymnasium's FrozenLake module, or MissingExtra naming the envs extra."""
  return extras.require('gymnasium.envs.toy_text.frozen_lake', "env.name='grid'")


def goal_distances(desc: list[str]) -> dict[tuple[int, int], int]:
  """BFS distance (in moves) to the goal ``'G'`` of every cell that reaches it without crossing
  a hole ``'H'``: ``{(row, column): distance}``."""
  rows, columns = len(desc), len(desc[0])
  goal = next((r, c) for r in range(rows) for c in range(columns) if desc[r][c] == 'G')
  distances = {goal: 0}
  queue = collections.deque([goal])
  while queue:
    r, c = queue.popleft()
    for _, (dr, dc) in MOVES.values():
      cell = (r + dr, c + dc)
      if (0 <= cell[0] < rows and 0 <= cell[1] < columns and cell not in distances
          and desc[cell[0]][cell[1]] != 'H'):
        distances[cell] = distances[(r, c)] + 1
        queue.append(cell)
  return distances


class GridEnv(TextEnv):
  """FrozenLake in text; implements ``rlax_llm.envs.Environment``."""

  name = 'grid'

  def __init__(self, size: int = 4, frozen_fraction: float = 0.8, max_turns: int = 12,
               shaping: float = 0.0, instruction: str = DEFAULT_INSTRUCTION,
               demo_error_rate: float = 0.0, split_maps: bool = False):
    """Validates the arguments.

    Args:
      size: the grid is ``size x size``, 2..12.
      frozen_fraction: the probability that a tile is ice, in ``[0.5, 1]`` (below that
        gymnasium's redraw-until-solvable loop gets slow).
      max_turns: moves per episode, >= 1 (the shortest route takes ``2 * (size - 1)``).
      shaping: the per-move reward for getting one step closer to the goal (>= 0; 0: only
        the goal pays).
      instruction: the first user message, a ``str.format`` template over ``{grid}``.
      demo_error_rate: the probability, in ``[0, 1]``, that a seed's episode is demonstrated
        by ``oracle_action`` blind to the holes (module docstring); 0: every demonstration
        is a shortest route. Only ``oracle_action`` (the warm-up) reads it.
      split_maps: True: train, held-out and validation seeds play disjoint sets of maps
        (module docstring); False: a seed's map is gymnasium's map of that seed.
    Raises ValueError for an invalid argument; MissingExtra without gymnasium (the envs
    extra).
    """
    super().__init__(max_turns)
    _frozen_lake()
    owner = type(self).__name__
    self.size = check_int(owner, 'size', size, 2, 12)
    if (isinstance(frozen_fraction, bool) or not isinstance(frozen_fraction, (int, float))
        or not 0.5 <= frozen_fraction <= 1):
      raise ValueError(f'{owner} frozen_fraction must be in [0.5, 1], got {frozen_fraction!r}.')
    if isinstance(shaping, bool) or not isinstance(shaping, (int, float)) or not shaping >= 0:
      raise ValueError(f'{owner} shaping must be a number >= 0, got {shaping!r}.')
    try:
      instruction.format(grid='P.\n.G')
    except (AttributeError, KeyError, IndexError, ValueError) as e:
      raise ValueError(f'{owner} instruction={instruction!r} is not a str.format template '
                       f'over {{grid}}: {e!r}.') from None
    if not isinstance(split_maps, bool):
      raise ValueError(f'{owner} split_maps must be True or False, got {split_maps!r}.')
    self.frozen_fraction, self.shaping = float(frozen_fraction), float(shaping)
    self.split_maps = split_maps
    self.demo_error_rate = check_demo_error_rate(owner, demo_error_rate,
                                                 'are blind to the holes')
    self.instruction = instruction
    self.desc: list[str] = []
    self.grid_id = ''
    self.position = (0, 0)
    self._distances: dict[tuple[int, int], int] = {}
    self._demo_distances: dict[tuple[int, int], int] = {}  # what oracle_action walks by
    self.demo_errs = False  # whether this seed's demonstration is blind to the holes
    self._lake: FrozenLakeEnv | None = None

  def _reset(self, seed: int) -> str:
    frozen_lake = _frozen_lake()
    self.desc = frozen_lake.generate_random_map(self.size, p=self.frozen_fraction, seed=seed)
    if self.split_maps:
      split = seed_split(seed)
      for attempt in range(1, _SPLIT_ATTEMPTS + 1):
        if map_split(self.desc) == split:
          break
        self.desc = frozen_lake.generate_random_map(
            self.size, p=self.frozen_fraction, seed=stable_hash(_SPLIT_STREAM, seed, attempt))
      else:
        raise RuntimeError(f'no {split} map in {_SPLIT_ATTEMPTS} draws for seed {seed} '
                           f'(size={self.size}, frozen_fraction={self.frozen_fraction}); '
                           'set split_maps=False.')
    self._distances = goal_distances(self.desc)
    if (0, 0) not in self._distances:  # gymnasium redraws until solvable: never happens
      raise RuntimeError(f'grid of seed {seed} is not solvable: {self.desc}')
    self.demo_errs = draw_demo_error(_DEMO_STREAM, seed, self.demo_error_rate)
    self._demo_distances = (goal_distances([row.replace('H', 'F') for row in self.desc])
                            if self.demo_errs else self._distances)
    self.grid_id = f'{stable_hash(*self.desc):016x}'
    self._lake = frozen_lake.FrozenLakeEnv(desc=self.desc, is_slippery=False)
    self._lake.reset(seed=seed % (1 << 32))
    self.position = (0, 0)
    return self.instruction.format(grid=self.render())

  def render(self) -> str:
    """The grid as text, one row a line, with ``P`` at the current position."""
    rows = []
    for r, row in enumerate(self.desc):
      cells = ['P' if (r, c) == self.position else '.' if tile in 'SF' else tile
               for c, tile in enumerate(row)]
      rows.append(''.join(cells))
    return '\n'.join(rows)

  def _step(self, action: str) -> EnvStep:
    last = None
    for last in _MOVE_RE.finditer(action):
      pass
    if last is None:
      error = 'error: no move in your message; reply with one of up, down, left, right.'
      return EnvStep(f'{error}\n\n{self.render()}', 0.0, False, {'error': error})
    move = last[1].lower()
    before = self.position
    state, reward, terminated, _, _ = self._lake.step(MOVES[move][0])
    self.position = divmod(int(state), self.size)
    tile = self.desc[self.position[0]][self.position[1]]
    shaping = 0.0
    if self.shaping and tile != 'H':
      shaping = self.shaping * (self._distances[before] - self._distances[self.position])
    if tile == 'G':
      return EnvStep(f'You moved {move} and reached the goal.', float(reward) + shaping, True,
                     {'success': True})
    if tile == 'H':
      return EnvStep(f'You moved {move} into a hole.', 0.0, True, {'success': False})
    if self.position == before:
      error = f'error: you cannot move {move}: the edge of the grid.'
      return EnvStep(f'{error}\n\n{self.render()}', 0.0, False, {'error': error})
    return EnvStep(f'You moved {move}.\n\n{self.render()}', shaping, bool(terminated), {})

  def state_key(self) -> str:
    """The map and the position: ``grid/<map hash>/<row>,<column>``."""
    return f'grid/{self.grid_id}/{self.position[0]},{self.position[1]}'

  def oracle_action(self) -> str:
    """A scripted policy: a move along a shortest route to the goal (BFS); on the seeds that
    ``demo_error_rate`` picks (``demo_errs``), along the shortest route of the map without
    its holes, which may lead into one."""
    r, c = self.position
    here = self._demo_distances[self.position]
    for move, (_, (dr, dc)) in MOVES.items():
      if self._demo_distances.get((r + dr, c + dc)) == here - 1:
        return move
    raise RuntimeError(f'no route from {self.position} in {self.desc}')  # at the goal only
