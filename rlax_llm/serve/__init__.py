"""An OpenAI-compatible endpoint served by an inference worker, recording episodes for RL.

* ``openai_api``: the FastAPI app (``/v1/models``, ``/v1/completions``,
  ``/v1/chat/completions`` with ``tools``, ``/v1/episodes/{id}/reward``) and ``Endpoint``,
  which serves it in-process with uvicorn (loopback by default, optional bearer token).
* ``scheduler``: the thread that runs concurrent requests on the worker's driver.
* ``recorder``: every call's token ids, log-probs and versions under an episode id, stitched
  into token-faithful trajectories when the episode is closed.
* ``harness``, ``harness_runner``: a training run whose episodes an agent harness written
  against the OpenAI API plays through the endpoint (``env.name='harness'``);
  ``calculator_agent`` is an example harness.

docs/serving.md describes the endpoint. This ``__init__`` imports nothing, so that
``recorder`` and ``harness`` are usable without the ``serve`` extra (fastapi, uvicorn,
openai).
"""
