r"""rlax_llm's GKD generalised JSD against TRL's ``GKDTrainer.generalized_jsd_loss`` on identical
random inputs (issue 63). Prints one JSON object: the largest absolute and relative
per-token difference for each beta.

Runs in benchmarks/peers/.venv-trl (setup.sh: trl, torch CPU), which has no JAX; rlax_llm's
side runs in the repository's own environment as a subprocess (``--side=rlax``):

    benchmarks/peers/.venv-trl/bin/python benchmarks/peers/distill_reference.py \
        [--rlax_python=.venv/bin/python] [--batch=4 --length=16 --vocab=256 --seed=0]

Both sides get the same float32 logits ``[B, T, V]`` (student and teacher). TRL's loss with
``reduction='none'`` is summed over the vocabulary to a per-token divergence;
rlax_llm's ``losses.generalized_jsd`` gets the full log-softmaxes (its top-k support is then
the whole vocabulary, so renormalising changes nothing). TRL's convention, which rlax_llm
follows: ``beta = 0`` is KL(teacher || student), ``beta = 1`` is KL(student || teacher).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

BETAS = (0.0, 0.1, 0.5, 0.9, 1.0)
REPO = pathlib.Path(__file__).resolve().parents[2]


def inputs(batch: int, length: int, vocab: int, seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  logits = lambda: (rng.normal(size=(batch, length, vocab)) * 3.0).astype(np.float32)
  return {'student': logits(), 'teacher': logits()}


def trl_side(data: dict[str, np.ndarray]) -> dict[float, np.ndarray]:
  import torch
  try:
    from trl import GKDTrainer
  except ImportError:  # trl 1.x keeps it under trl.experimental
    from trl.experimental.gkd import GKDTrainer
  student, teacher = (torch.from_numpy(data[k]) for k in ('student', 'teacher'))
  return {beta: GKDTrainer.generalized_jsd_loss(student, teacher, beta=beta,
                                                reduction='none').sum(-1).numpy()
          for beta in BETAS}


def rlax_side(path: str) -> None:
  """Reads the inputs at ``path`` (.npz), writes rlax_llm's per-token JSDs next to them."""
  import jax
  from rlax_llm.losses import generalized_jsd
  data = np.load(path)
  student, teacher = (jax.nn.log_softmax(data[k], axis=-1) for k in ('student', 'teacher'))
  np.savez(path.replace('.npz', '_rlax.npz'),
           **{str(beta): np.asarray(generalized_jsd(student, teacher, beta)) for beta in BETAS})


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--side', choices=('compare', 'rlax'), default='compare')
  parser.add_argument('--path', help='(--side=rlax) the inputs .npz')
  parser.add_argument('--rlax_python', default=str(REPO / '.venv' / 'bin' / 'python'))
  parser.add_argument('--batch', type=int, default=4)
  parser.add_argument('--length', type=int, default=16)
  parser.add_argument('--vocab', type=int, default=256)
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args()
  if args.side == 'rlax':
    rlax_side(args.path)
    return
  data = inputs(args.batch, args.length, args.vocab, args.seed)
  with tempfile.TemporaryDirectory() as tmp:
    path = str(pathlib.Path(tmp) / 'inputs.npz')
    np.savez(path, **data)
    subprocess.run([args.rlax_python, __file__, '--side=rlax', f'--path={path}'], check=True,
                   env={'PYTHONPATH': str(REPO), 'JAX_PLATFORMS': 'cpu',
                        'PATH': '/usr/bin:/bin'})
    ours = np.load(path.replace('.npz', '_rlax.npz'))
    ours = {beta: ours[str(beta)] for beta in BETAS}
  theirs = trl_side(data)
  report = {'shape': [args.batch, args.length, args.vocab], 'seed': args.seed, 'betas': {}}
  for beta in BETAS:
    diff = np.abs(ours[beta].astype(np.float64) - theirs[beta])
    report['betas'][str(beta)] = {
        'max_abs_diff': float(diff.max()),
        'max_rel_diff': float((diff / np.maximum(np.abs(theirs[beta]), 1e-12)).max()),
        'mean_jsd': float(theirs[beta].mean())}
  report['max_abs_diff'] = max(b['max_abs_diff'] for b in report['betas'].values())
  print(json.dumps(report, indent=1))


if __name__ == '__main__':
  sys.exit(main())
