#!/usr/bin/env python3
"""Renders the KubeRay RayJob of a config (``python -m rlax_llm.tpu_recipes gke-ray``).

    python launch/gke/render_ray.py --trainer-tpu-type=v5p-8 --inference-tpu-type=v5e-8 \
        --image=IMAGE --workdir=/mnt/runs/run --config=configs/smollm2.py --dry-run

Options: launch/gke/README.md, or --help.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from rlax_llm import tpu_recipes  # pylint: disable=wrong-import-position

if __name__ == '__main__':
  tpu_recipes.main(['gke-ray', *sys.argv[1:]])
