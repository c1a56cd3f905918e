"""The GKE recipes as Kubernetes manifests: a JobSet (backend local), a KubeRay RayJob (ray)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import ml_collections
import yaml

from launch.recipes.checks import Plan
from launch.recipes.scripts import (REMOTE_DIR, header, launch_args, preemption_footer,
                                    ray_driver_overrides, resources_json, shell_join)
from launch.recipes.slices import SliceType


def _document(comments: Sequence[str], manifest: dict) -> str:
  """``comments`` as ``#`` lines, then ``manifest`` as block YAML (keys in their order)."""
  body = yaml.safe_dump(manifest, sort_keys=False, width=float('inf'))
  return ''.join(f'# {c}\n' for c in comments) + body


def render_jobset(config: ml_collections.ConfigDict, plan: Plan, slice_: SliceType,
                  opts: argparse.Namespace, spec: str, overrides: Sequence[str],
                  distributed: Sequence[str]) -> str:
  """A JobSet: one pod per host of the slice, each running the launch (backend local)."""
  name = opts.name
  args = [str(a) for a in launch_args(spec, [*overrides, *distributed], opts.workdir)[1:]]
  container = {
      'name': 'rlax-llm',
      'image': opts.image,
      'workingDir': f'/app/{REMOTE_DIR}',
      'command': [f'/app/{REMOTE_DIR}/.venv/bin/python'],
      'args': args,
      'resources': {'requests': {'google.com/tpu': slice_.chips_per_host},
                    'limits': {'google.com/tpu': slice_.chips_per_host}},
  }
  if distributed:
    container['env'] = [{'name': 'JOB_COMPLETION_INDEX', 'valueFrom': {'fieldRef': {
        'fieldPath': "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}]
    container['ports'] = [{'containerPort': opts.coordinator_port}]
  manifest = {
      'apiVersion': 'jobset.x-k8s.io/v1alpha2',
      'kind': 'JobSet',
      'metadata': {'name': name, 'labels': {'app': 'rlax-llm'},
                   'annotations': {'alpha.jobset.sigs.k8s.io/exclusive-topology':
                                   'cloud.google.com/gke-nodepool'}},
      'spec': {
          'failurePolicy': {'maxRestarts': opts.max_restarts},
          'replicatedJobs': [{
              'name': 'slice',
              'replicas': 1,
              'template': {'spec': {
                  'parallelism': slice_.hosts,
                  'completions': slice_.hosts,
                  'backoffLimit': 0,
                  'template': {'spec': {
                      'restartPolicy': 'Never',
                      'terminationGracePeriodSeconds': opts.grace_period_s,
                      'nodeSelector': {
                          'cloud.google.com/gke-tpu-accelerator': slice_.gke_accelerator,
                          'cloud.google.com/gke-tpu-topology': slice_.gke_topology},
                      'containers': [container],
                  }},
              }},
          }],
      },
  }
  comments = [(f'rlax_llm gke recipe: {spec} on {slice_.describe()}; apply with: kubectl apply '
            '-f FILE (the JobSet controller must be installed in the cluster)')]
  comments += header(config, plan, spec, overrides)
  comments += preemption_footer('the JobSet restarts every pod (failurePolicy.maxRestarts) '
                               'with the same --workdir.')
  return _document(comments, manifest)


def render_rayjob(config: ml_collections.ConfigDict, plan: Plan, trainer: SliceType,
                  inference: SliceType, opts: argparse.Namespace, spec: str,
                  overrides: Sequence[str]) -> str:
  """A KubeRay RayJob: a CPU head (the driver: controller, parameter server, metrics), a
  trainer worker group on one TPU node pool and an inference group on another."""
  driver = [str(a) for a in launch_args(spec, [
      *overrides, *ray_driver_overrides(plan, '--config.ray.address=auto')], opts.workdir)]
  # The driver validates with as many (CPU) devices as the trainer slice has TPU chips.
  entrypoint = (f'cd /app/{REMOTE_DIR} && XLA_FLAGS=--xla_force_host_platform_device_count='
                f'{plan.devices} {shell_join(driver)}')
  image = opts.image

  def group(name: str, slice_: SliceType, replicas: int, role: str) -> dict:
    chips = slice_.chips_per_host
    # KubeRay passes this to ray start --resources; Ray sees the TPU chips itself.
    resources = '"' + resources_json({role: chips}).replace('"', '\\"') + '"'
    return {
        'groupName': name, 'replicas': replicas, 'minReplicas': replicas,
        'maxReplicas': replicas, 'numOfHosts': slice_.hosts,
        'rayStartParams': {'resources': resources},
        'template': {'spec': {
            'nodeSelector': {'cloud.google.com/gke-tpu-accelerator': slice_.gke_accelerator,
                             'cloud.google.com/gke-tpu-topology': slice_.gke_topology},
            'containers': [{'name': 'ray-worker', 'image': image,
                            'resources': {'requests': {'google.com/tpu': chips},
                                          'limits': {'google.com/tpu': chips}}}],
        }},
    }

  manifest = {
      'apiVersion': 'ray.io/v1',
      'kind': 'RayJob',
      'metadata': {'name': opts.name, 'labels': {'app': 'rlax-llm'}},
      'spec': {
          'entrypoint': entrypoint,
          'shutdownAfterJobFinishes': True,
          'rayClusterSpec': {
              'rayVersion': opts.ray_version,
              'headGroupSpec': {
                  'rayStartParams': {'dashboard-host': '0.0.0.0'},
                  'template': {'spec': {'containers': [{
                      'name': 'ray-head', 'image': image,
                      'resources': {'requests': {'cpu': opts.head_cpu,
                                                 'memory': opts.head_memory}}}]}},
              },
              'workerGroupSpecs': [
                  group('trainer', trainer, 1, 'rlax_trainer'),
                  group('inference', inference, opts.inference_slices, 'rlax_inference')],
          },
      },
  }
  comments = [(f'rlax_llm gke-ray recipe: {spec}; trainer on {trainer.describe()}, workers on '
            f'{opts.inference_slices} x {inference.describe()}; apply with: kubectl apply -f '
            'FILE (KubeRay must be installed in the cluster)')]
  comments += header(config, plan, spec, overrides)
  comments += ['Preemption: the trainer actor writes checkpoints into --workdir (gs://, or storage',
             'the head and the trainer pod both mount); SIGTERM to the driver saves one and exits 0, and',
             'resubmitting with the same --workdir resumes. A lost inference pod\'s workers are',
             'restarted by Ray (ray.worker_restarts); a lost trainer pod stops the job naming the',
             'checkpoint step to resume from.']
  return _document(comments, manifest)
