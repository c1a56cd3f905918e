"""Multi-turn agents: RL on an environment's episodes (docs/environments.md, "Training on an
environment").

The default: SmolLM2-135M-Instruct learns to use the calculator environment's ``calculate``
tool to multiply a 3-digit by a 2-digit number (tool calls in the documented 'simple' format:
SmolLM2's chat template has no tool format), GRPO over episode returns, greedy held-out
episode success as eval/success.
Variants (``--config=configs/agent.py:VARIANT``):
  calculator_no_tool: the same held-out problems asked with no tool (env.tools=False), for the
    starting point without it (run with total_steps=0 and warmup.steps=0).
  calculator_erring: the recipe with a warm-up on an erring oracle (env.demo_error_rate 0.6:
    those seeds' demonstrations call the tool on a + b and answer that) run longer (24
    steps, lr 3e-5: with the perfect oracle that alone reaches 100%), so that imitation
    plateaus below what RL then reaches (benchmarks/RESULTS.md, "SmolLM2-135M-Instruct
    learns the calculator tool"; total_steps=0 gives the warm-up alone).
  grid: a 4x4 FrozenLake text puzzle (rlax_llm.envs.GridEnv), one move a turn, GRPO over
    episode returns.
  grid_gigpo: the same with GiGPO's step-level credit (rl.advantage_estimator='gigpo').
  grid_small: the same 4x4 puzzle (holes, 8 turns, reward only at the goal) for the tiny
    character-level model of configs/default.py, GRPO over episode returns: the GRPO vs
    GiGPO comparison of benchmarks/agent_grid.py (a SmolLM2 run per seed does not fit a
    2-core machine); a warm-up on an erring oracle's demonstrations (env.demo_error_rate
    0.6); train, held-out and validation maps disjoint (env.split_maps), the
    hyper-parameters picked on the validation maps (benchmarks/RESULTS.md, "Grid puzzle:
    RL on an erring warm-up").
  grid_small_gigpo: the same with GiGPO.
  smoke: a tiny character-level model on a 2x2 grid for a few steps (tests; seconds).
  harness: the calculator task played by an agent harness written with the plain openai
    client (rlax_llm.serve.calculator_agent), served by the endpoint (docs/serving.md,
    "Training an OpenAI-API agent").
  harness_smoke: that harness with a tiny character-level model for two steps (tests).
"""

import ml_collections

from rlax_llm.cli import DEFAULT_CONFIG_PATH, load_config_file, unknown_variant

VARIANTS = ('calculator_no_tool', 'calculator_erring', 'grid', 'grid_gigpo', 'grid_small',
            'grid_small_gigpo', 'smoke', 'harness', 'harness_smoke')
# The example agent harness (rlax_llm/serve/calculator_agent.py) of the harness variants.
HARNESS = 'rlax_llm.serve.calculator_agent:calculator_agent'


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  # The packaged default config (the schema, with every key's meaning); what differs follows.
  c = load_config_file(str(DEFAULT_CONFIG_PATH))
  c.name = 'agent_calculator'
  c.total_steps = 200
  # SmolLM2-135M-Instruct as configs/smollm2.py loads it (the packaged GGUF by default).
  c.model = load_config_file(str(DEFAULT_CONFIG_PATH.parent / 'smollm2.py')).model
  c.env = ml_collections.ConfigDict(dict(name='calculator', max_turns=4, tool_format='simple'))
  c.agent.update(dict(max_turns=0, max_concurrent_episodes=0, timeout_s=300.0,
                      max_turn_tokens=48, num_eval=50))
  c.warmup.steps = 0
  c.rl.update(dict(prompts_per_step=4, group_size=8, learning_rate=1e-5))
  # The first prompt (chat template and the tool's description: 182 tokens) and the rest of the
  # conversation: up to 4 turns of 48 tokens and the tool results between them.
  c.sampling.update(dict(temperature=0.7, max_prompt_len=224, max_new_tokens=320))
  c.rollout.update(dict(slots=32))
  c.checkpoint.update(dict(every_steps=25, keep=2))
  c.eval.every_steps = 10
  del c['reward']  # the environment's rewards

  if variant in (None, 'calculator_no_tool', 'calculator_erring'):
    # The calculator recipe (benchmarks/RESULTS.md, "SmolLM2-135M-Instruct learns the
    # calculator tool"): a short supervised warm-up on the oracle's episodes
    # (docs/environments.md), 8 steps of 8 demonstrations, teaches the tool call without
    # solving the task for RL; then GRPO.
    c.total_steps = 6
    c.warmup.update(dict(steps=8, batch_size=8, learning_rate=2e-5, warmup_steps=0))
    # 4 rows of <= 545 tokens at a time, the lm head 128 positions at a time: without remat
    # XLA:CPU's compiled step holds about 1.8 GB a row at this length (8 rows a micro-batch
    # hit the 23 GiB machine's limit and were killed; 4 rows peak at 18.6 GB resident, as
    # measured). model.remat='full' brings 8 rows to 1.8 GB in all (not measured in a run).
    c.rl.update(dict(learning_rate=2e-5, micro_batches=8, logprob_chunk=128))
    c.eval.every_steps = 2
    # A held-out evaluation of the untrained model (4 turns of 48 tokens, 50 episodes) took
    # over 10 minutes on a loaded 2-core machine: the worker's answer may take that long.
    c.rollout.worker_timeout_s = 3600.0
  if variant == 'calculator_no_tool':
    c.name = 'agent_calculator_no_tool'
    c.env.tools = False
    c.warmup.steps = 0  # the oracle needs the tool
  elif variant == 'calculator_erring':
    c.name = 'agent_calculator_erring'
    c.env.demo_error_rate = 0.6
    c.warmup.update(dict(steps=24, learning_rate=3e-5))
  elif variant in ('grid', 'grid_gigpo'):
    c.name = f'agent_{variant}'
    c.env = ml_collections.ConfigDict(dict(name='grid', size=4, frozen_fraction=0.8,
                                           max_turns=8, shaping=0.0))
    c.agent.max_turn_tokens = 16
    c.sampling.update(dict(max_prompt_len=128, max_new_tokens=448))
    if variant == 'grid_gigpo':
      c.rl.advantage_estimator = 'gigpo'
  elif variant in ('grid_small', 'grid_small_gigpo'):
    c.name = f'agent_{variant}'
    c.total_steps = 30
    c.model = load_config_file(str(DEFAULT_CONFIG_PATH)).model
    # The bare grid as the first prompt (the instruction is what a tiny model cannot read);
    # 4x4, holes, 8 turns for a 6-move route, no shaping: only the goal pays, and one move
    # into a hole loses the episode, so credit for the step matters.
    # Train, held-out and validation seeds play disjoint sets of maps (split_maps).
    c.env = ml_collections.ConfigDict(dict(name='grid', size=4, frozen_fraction=0.8,
                                           max_turns=8, shaping=0.0, instruction='{grid}\n',
                                           split_maps=True, demo_error_rate=0.6))
    # The warm-up imitates an erring oracle: 60% of the seeds' demonstrations walk blind to
    # the holes (down, then right), so supervised learning stays far below the oracle
    # (200 steps: 54.7% held out, against 93.8% on perfect demonstrations) and RL has
    # something to fix that imitation cannot. With a short perfect-oracle warm-up (60
    # steps) 20 RL steps did not improve it: 67% of the groups carried no signal
    # (benchmarks/RESULTS.md, "Grid puzzle: why RL did not improve on the warm-up").
    c.warmup.update(dict(steps=200, batch_size=16, warmup_steps=10))
    # A GridEnv never hangs: the deadline only guards the run, and one that load can reach
    # cuts the long (goal-bound) episodes first (120 s cut 84% of a step's episodes at a
    # load average of 18).
    # 64 held-out maps (+-6 points of sampling noise at 50%; 32 gave +-9).
    c.agent.update(dict(max_turn_tokens=8, num_eval=64, timeout_s=3600.0))
    # lr 3e-4: at 1e-3 (one update per batch, so PPO's clip never binds and the step is the
    # learning rate's alone) 4 of 6 runs fell onto a fixed route; 3e-4 held validation success
    # level (benchmarks/RESULTS.md, "Grid puzzle: why RL did not improve on the warm-up").
    c.rl.update(dict(prompts_per_step=4, group_size=8, learning_rate=3e-4))
    # Up to 8 turns of <= 8 tokens and their observations (~45 tokens after a move; an
    # episode that runs past 384 ends as context_full).
    c.sampling.update(dict(temperature=1.0, max_prompt_len=24, max_new_tokens=384))
    c.model.max_seq_len = 409  # max_prompt_len + max_new_tokens + the last sampled token
    c.rollout.slots = 32
    c.eval.every_steps = 10
    c.checkpoint.update(dict(every_steps=0, every_seconds=0.0))
    if variant == 'grid_small_gigpo':
      c.rl.advantage_estimator = 'gigpo'
  elif variant == 'smoke':
    c.name = 'agent_smoke'
    c.total_steps = 3
    c.model = load_config_file(str(DEFAULT_CONFIG_PATH)).model
    c.model.max_seq_len = 129  # max_prompt_len + max_new_tokens + the last sampled token
    c.env = ml_collections.ConfigDict(dict(name='grid', size=2, max_turns=2,
                                           instruction='{grid}'))
    c.agent.update(dict(max_turn_tokens=6, num_eval=4, timeout_s=120.0))
    c.rl.update(dict(prompts_per_step=4, group_size=4, learning_rate=3e-4))
    c.sampling.update(dict(temperature=1.0, max_prompt_len=16, max_new_tokens=112))
    c.rollout.slots = 16
    c.eval.every_steps = 2
    c.checkpoint.update(dict(every_steps=0, every_seconds=0.0))
  elif variant == 'harness':
    # The episodes are the harness's: every call's prompt is its whole conversation so far,
    # so sampling.max_prompt_len bounds the longest call's prompt and max_new_tokens a reply.
    c.name = 'agent_harness'
    c.env = ml_collections.ConfigDict(dict(name='harness', harness=HARNESS, max_turns=4))
    c.sampling.update(dict(max_prompt_len=512, max_new_tokens=48))
  elif variant == 'harness_smoke':
    # The smoke variant's tiny model and schedule; the example harness asks 'a*b=' with
    # one-digit numbers (short texts for a character-level model), two calls an episode.
    c = get_config('smoke')
    c.name = 'agent_harness_smoke'
    c.total_steps = 2
    c.env = ml_collections.ConfigDict(dict(name='harness', harness=HARNESS, max_turns=2,
                                           instruction='{a}*{b}=', retry='?', min_a=1,
                                           max_a=9, min_b=1, max_b=9))
    c.agent.update(dict(max_turn_tokens=8, num_eval=2, timeout_s=60.0))
    c.rl.prompts_per_step = 2
    c.sampling.update(dict(max_prompt_len=80, max_new_tokens=16))
    c.model.max_seq_len = 97  # max_prompt_len + max_new_tokens + the last sampled token
  elif variant is not None:
    raise unknown_variant(variant, 'configs/agent.py', VARIANTS)
  return c
