"""The errors rlax_llm raises for a user to act on, in one hierarchy.

Every class here carries a message that says what was wrong, the value seen and how to fix
it. The command-line entry points (``launch``, ``evaluate``) catch ``RlaxError`` and print it
as one line (``error: ...``) instead of a traceback; ``Preempted`` is the one member that is
not a failure (the run saved a checkpoint and stops on purpose).

    RlaxError
    ├── ConfigError       a config that cannot run (also a ValueError)
    ├── CheckpointError   a checkpoint or model file that cannot be read or does not fit
    ├── WorkdirError      a run directory that cannot be claimed or used
    │   ├── WorkdirInUse  another live run holds it
    │   └── WorkdirHasRun it holds a finished or different run
    ├── NonFiniteError    the updates diverged (NaN/Inf) past the configured tolerance
    ├── ToolCallError     a model's tool call that does not parse (rlax_llm.envs.tool_calls)
    ├── MissingExtra      an optional package the run needs is not installed (rlax_llm.extras)
    └── Preempted         SIGTERM/SIGINT: a checkpoint was saved, relaunch to resume
"""

from __future__ import annotations


class RlaxError(Exception):
  """Base of the errors a user acts on; the message names the value and the fix."""


class ConfigError(RlaxError, ValueError):
  """A config that cannot run, with the key and the fix in the message."""


class CheckpointError(RlaxError, ValueError):
  """A checkpoint (Orbax run state) or model file (safetensors, GGUF, tokenizer, config.json)
  that is missing, corrupt, or does not fit the model/optimizer it is read into."""


class WorkdirError(RlaxError):
  """A workdir that cannot be claimed or used (not a directory, not lockable, busy, taken)."""


class WorkdirInUse(WorkdirError):
  """Another live process holds the workdir's claim."""


class WorkdirHasRun(WorkdirError):
  """The workdir holds a run that this launch must not resume or overwrite."""


class NonFiniteError(RlaxError):
  """The trainer's updates were non-finite ``max_nonfinite_updates`` times in a row."""


class ToolCallError(RlaxError, ValueError):
  """A tool call in a model's message that does not parse: malformed JSON, a missing name,
  arguments that are not an object, an unclosed tag, more calls or a longer call than the caps.
  The message says what was wrong, where (the character position) and shows the text there;
  an environment turns it into the observation the model sees next."""


class MissingExtra(RlaxError, ImportError):
  """An optional dependency that this run needs is not installed: the message names the
  ``pip install 'rlax_llm[EXTRA]'`` that installs it (``rlax_llm.extras``)."""


class Preempted(RlaxError):
  """A preemption signal (SIGTERM/SIGINT) stopped the run: not a failure. Raised where the
  run stops before it has anything to save (e.g. during the warm-up); the CLI exits 0 and
  relaunching on the same workdir starts or resumes the run."""
