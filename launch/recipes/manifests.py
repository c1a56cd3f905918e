"""The GKE recipes as Kubernetes manifests: a JobSet (backend local), a KubeRay RayJob (ray)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

import ml_collections
import yaml

from launch.recipes.checks import Plan
from launch.recipes.scripts import (REMOTE_DIR, header, launch_args, preemption_footer,
                                    ray_driver_overrides, resources_json, setup_flags, shell_join)
from launch.recipes.slices import SliceError, SliceType

# The Kubernetes service account the pods run as (--service-account): with Workload Identity
# it acts as a Google service account, whose credentials write the gs:// workdir.
SERVICE_ACCOUNT = 'rlax-llm'
_KSA_NAME = re.compile(r'[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?')
_GSA_EMAIL = re.compile(r'[a-z][-a-z0-9]{4,28}[a-z0-9]@[-a-z0-9.]+\.gserviceaccount\.com')


def _document(comments: Sequence[str], manifests: Sequence[dict]) -> str:
  """``comments`` as ``#`` lines, then ``manifests`` as block YAML documents (keys in their
  order, ``---`` between two)."""
  body = yaml.safe_dump_all(manifests, sort_keys=False, width=float('inf'))
  return ''.join(f'# {c}\n' for c in comments) + body


def _service_account(opts: argparse.Namespace) -> tuple[list[dict], list[str]]:
  """The ServiceAccount to create (with ``--gcp-service-account``: annotated for Workload
  Identity; else none, it is made beforehand) and the comment lines on the credentials."""
  name, gsa = opts.service_account, opts.gcp_service_account
  if not _KSA_NAME.fullmatch(name):
    raise SliceError(f'--service-account={name!r} is not a Kubernetes name; use lowercase '
                     'letters, digits, "-" and "." (e.g. rlax-llm).')
  if gsa is not None and not _GSA_EMAIL.fullmatch(gsa):
    raise SliceError(f'--gcp-service-account={gsa!r} is not a Google service account email; '
                     'use NAME@PROJECT.iam.gserviceaccount.com.')
  comments = [f'credentials: the pods run as Kubernetes service account {name!r}; with '
              'Workload Identity it acts as a Google service account that needs '
              'roles/storage.objectUser on the bucket of --workdir (launch/gke/README.md)']
  if gsa is None:
    comments.append(f'credentials: create {name!r} and bind it first (launch/gke/README.md), '
                    'or pass --gcp-service-account=EMAIL to create it here')
    return [], comments
  comments.append(f'credentials: the ServiceAccount below acts as {gsa} (the binding: '
                  'roles/iam.workloadIdentityUser for '
                  f'serviceAccount:PROJECT.svc.id.goog[NAMESPACE/{name}] on {gsa})')
  return [{'apiVersion': 'v1', 'kind': 'ServiceAccount',
           'metadata': {'name': name, 'labels': {'app': 'rlax-llm'},
                        'annotations': {'iam.gke.io/gcp-service-account': gsa}}}], comments


def _image_comment(config: ml_collections.ConfigDict, opts: argparse.Namespace, ray: bool
                   ) -> str:
  flags_ = setup_flags(config, tpu=True, ray=ray)
  return (f'image: {opts.image}, built with launch/host_setup.sh {flags_} at least '
          '(launch/gke/Dockerfile: --build-arg SETUP_FLAGS=...; its default is --tpu --data '
          '--smollm2)')


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
                      'serviceAccountName': opts.service_account,
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
  accounts, credentials = _service_account(opts)
  comments += header(config, plan, spec, overrides)
  comments += [_image_comment(config, opts, ray=False), *credentials]
  comments += preemption_footer('the JobSet restarts every pod (failurePolicy.maxRestarts) '
                               'with the same --workdir.')
  return _document(comments, [*accounts, manifest])


def render_rayjob(config: ml_collections.ConfigDict, plan: Plan, trainer: SliceType,
                  inference: SliceType, opts: argparse.Namespace, spec: str,
                  overrides: Sequence[str]) -> str:
  """A KubeRay RayJob: a CPU head (the driver: controller, parameter server, metrics), a
  trainer worker group on one TPU node pool and an inference group on another; with
  on-policy distillation a teacher group on a third (``plan.teacher_slice``)."""
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
            'serviceAccountName': opts.service_account,
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
                  'template': {'spec': {'serviceAccountName': opts.service_account,
                                        'containers': [{
                      'name': 'ray-head', 'image': image,
                      'resources': {'requests': {'cpu': opts.head_cpu,
                                                 'memory': opts.head_memory}}}]}},
              },
              'workerGroupSpecs': [
                  group('trainer', trainer, 1, 'rlax_trainer'),
                  group('inference', inference, opts.inference_slices, 'rlax_inference'),
                  *([group('teacher', plan.teacher_slice, 1, 'rlax_teacher')]
                    if plan.teacher_slice is not None else [])],
          },
      },
  }
  comments = [(f'rlax_llm gke-ray recipe: {spec}; trainer on {trainer.describe()}, workers on '
            f'{opts.inference_slices} x {inference.describe()}'
            + (f', teacher on {plan.teacher_slice.describe()}' if plan.teacher_slice else '')
            + '; apply with: kubectl apply -f '
            'FILE (KubeRay must be installed in the cluster)')]
  accounts, credentials = _service_account(opts)
  comments += header(config, plan, spec, overrides)
  comments += [_image_comment(config, opts, ray=True), *credentials]
  comments += ['Preemption: the trainer actor writes checkpoints into --workdir (gs://, or storage',
             'the head and the trainer pod both mount); SIGTERM to the driver saves one and exits 0, and',
             'resubmitting with the same --workdir resumes. A lost inference pod\'s workers are',
             'restarted by Ray (ray.worker_restarts); a lost trainer pod stops the job naming the',
             'checkpoint step to resume from.']
  return _document(comments, [*accounts, manifest])
