#!/usr/bin/env python3
"""Renders the KubeRay RayJob of a config (``python -m launch.recipes gke-ray``).

    python launch/gke/render_ray.py --trainer-tpu-type=v5p-8 --inference-tpu-type=v5e-8 \
        --image=IMAGE --workdir=gs://BUCKET/run --config=configs/smollm2.py --dry-run

Options: launch/gke/README.md, or --help.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from launch.recipes import cli  # pylint: disable=wrong-import-position

if __name__ == '__main__':
  cli.main(['gke-ray', *sys.argv[1:]])
