"""An OpenAI-compatible endpoint served by an inference worker, recording episodes for RL.

* ``openai_api``: the FastAPI app (``/v1/models``, ``/v1/completions``,
  ``/v1/chat/completions`` with ``tools``, ``/v1/episodes/{id}/reward``) and ``Endpoint``,
  which serves it in-process with uvicorn (loopback by default, optional bearer token). Its
  parts by job: ``http_server`` (OpenAI's error shape, the body cap, the host policy, the
  server thread), ``openai_requests`` (a request checked, its sampling parameters),
  ``chat_prompts`` (messages rendered and spliced), ``openai_responses`` (payloads and
  stream chunks), ``open_episodes`` (keys, requests in flight, abandoned episodes).
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
