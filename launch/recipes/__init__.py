r"""Cloud TPU launch recipes: the slice table, a config checked against a slice, the commands.

Deployment tooling, not part of the ``rlax_llm`` package (the wheel does not ship it). The
recipes in ``launch/`` (one TPU VM, a multi-host slice, trainer and inference on separate
slices with Ray, a GKE JobSet, a GKE KubeRay RayJob) are thin wrappers around its command
line, run from the repository root::

    python -m launch.recipes tpu-vm --tpu-type=v5e-8 --zone=us-west4-a \
        --workdir=gs://BUCKET/runs/smoke --config=configs/smollm2.py:smoke --dry-run
    python -m launch.recipes slices          # the slice table

Each recipe

1. loads the config with its ``--config.KEY=VALUE`` overrides exactly as the launcher does
   (``rlax_llm.cli.load_config``);
2. checks it against the slice(s) (``checks``): the role meshes against the chips and hosts
   (``check_local``, ``check_ray``, sized by ``rlax_llm.sharding.mesh_shape``), then
   ``rlax_llm.config.validate_config`` with as many devices as the launch will see (CPU
   stand-ins, so it works offline), then the memory plan per chip against the chip's HBM
   (``rlax_llm.memory_fit.run_memory_plan``; named presets only);
3. renders the exact commands (``scripts``: ``gcloud``, ``ray``) or the manifest
   (``manifests``: a JobSet, a KubeRay RayJob; needs PyYAML).

``--dry-run`` prints them as a bash script (or the manifest) and runs nothing; without it the
script runs under ``bash``, which needs ``gcloud`` (or ``kubectl``) with credentials. Nothing
here talks to the cloud. A config that does not fit fails with ``error: ...`` naming the key,
the value seen and the fix.

``python -m launch.recipes compile`` compiles the run's programs for the slice's chips with
the TPU compiler (libtpu) on this machine and reports memory per chip, compile time and a
roofline estimate (``compile``, ``program_report``).

Modules: ``slices`` (the slice table), ``checks`` (config against slices), ``scripts`` (the
gcloud recipes as bash), ``manifests`` (the GKE manifests), ``compile`` (the programs
compiled for TPU), ``program_report`` (each compiled program's memory and roofline, and the
refusal of one that does not fit), ``cli`` (the command line).
"""
