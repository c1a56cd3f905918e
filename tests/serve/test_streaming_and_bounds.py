"""The endpoint streams a sample token by token as the driver draws it (``stream=true``
without tools), records it once complete, and frees its slot when the client goes away
mid-stream; the recorder bounds the episodes left open (a cap and a TTL)."""

import time

import pytest

openai = pytest.importorskip('openai')
pytest.importorskip('fastapi')

from char_model import CHAR_TURN_TOKENS, make_char_worker

from rlax_llm.serve.openai_api import Endpoint
from rlax_llm.serve.recorder import Call, EpisodeRecorder

MODEL = 'tiny'
STEP_S = 0.15  # each decode step is slowed down this much, so that a stream has several chunks


@pytest.fixture(scope='module')
def slow_worker():
  worker = make_char_worker()
  worker.driver.before_step = lambda step: time.sleep(STEP_S)
  yield worker
  worker.driver.before_step = None


def client(endpoint, episode):
  return openai.OpenAI(base_url=endpoint.base_url, api_key='none', max_retries=0,
                       default_headers={'X-Episode-Id': episode})


def test_a_stream_arrives_token_by_token_and_is_recorded_whole(slow_worker):
  with Endpoint(slow_worker, model_name=MODEL) as endpoint:
    arrivals, pieces = [], []
    stream = client(endpoint, 'ep-s').chat.completions.create(
        model=MODEL, messages=[{'role': 'user', 'content': '3*4='}], seed=3, stream=True,
        logprobs=True, stream_options={'include_usage': True})
    chunks = []
    for chunk in stream:
      chunks.append(chunk)
      if chunk.choices and chunk.choices[0].delta.content:
        arrivals.append(time.perf_counter())
        pieces.append(chunk.choices[0].delta.content)
    (call,) = endpoint.recorder.calls('ep-s')
    assert ''.join(pieces) == endpoint.tokenizer.decode(call.completion_ids)
    assert chunks[0].choices[0].delta.role == 'assistant'
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] in ('stop', 'length') and not any(finish[:-1])
    assert chunks[-1].usage.completion_tokens == len(call.completion_ids)
    streamed = [lp.logprob for c in chunks if c.choices and c.choices[0].logprobs
                for lp in c.choices[0].logprobs.content]
    assert streamed == pytest.approx(list(call.logprobs))
    # More than one piece of text, the first long before the last: tokens came as drawn
    # (a reply cut at its first token by eos would have one; this seed's is longer).
    assert len(call.completion_ids) > 2 and len(pieces) >= 2
    assert arrivals[-1] - arrivals[0] > STEP_S
    assert endpoint.stats['streamed'] == 1


def test_a_client_leaving_mid_stream_frees_its_slot(slow_worker):
  with Endpoint(slow_worker, model_name=MODEL) as endpoint:
    stream = client(endpoint, 'ep-gone').completions.create(
        model=MODEL, prompt='3*4=', seed=3, max_tokens=CHAR_TURN_TOKENS, stream=True)
    next(iter(stream))  # the first piece, then the client goes away
    stream.close()
    deadline = time.monotonic() + 10
    while endpoint.scheduler.stats['cancelled'] == 0 and time.monotonic() < deadline:
      time.sleep(0.05)
    assert endpoint.scheduler.stats['cancelled'] == 1
    assert endpoint.stats['disconnects'] == 1
    with pytest.raises(KeyError):  # the client never saw a whole reply: nothing recorded
      endpoint.recorder.calls('ep-gone')


def call(n=1):
  return Call(prompt_ids=(1, 2), completion_ids=(3,) * n, logprobs=(-0.5,) * n,
              supports=(5,) * n, versions=(0,) * n, finish_reason='stop')


def test_open_episodes_are_capped_least_recently_called_first():
  recorder = EpisodeRecorder(max_open=2)
  recorder.record('a', call())
  recorder.record('b', call())
  recorder.record('a', call())  # 'b' is now the least recently called
  recorder.attach('b', 'chat state')
  recorder.record('c', call())
  assert recorder.stats['evicted'] == 1
  assert len(recorder.calls('a')) == 2 and len(recorder.calls('c')) == 1
  with pytest.raises(KeyError):
    recorder.calls('b')
  assert recorder.attached('b') is None  # what the endpoint kept with it went too
  recorder.close('a', 1.0)
  recorder.record('d', call())  # room again: nothing more is dropped
  assert recorder.stats['evicted'] == 1


def test_an_episode_silent_past_its_ttl_is_dropped_when_the_next_opens():
  recorder = EpisodeRecorder(ttl_s=0.2)
  recorder.record('old', call())
  recorder.open('fresh', group_id=3, prompt_id=9)
  assert recorder.stats['evicted'] == 0
  time.sleep(0.3)
  recorder.record('fresh', call(2))  # an open episode's call opens nothing
  assert recorder.stats['evicted'] == 0
  recorder.record('new', call())
  assert recorder.stats['evicted'] == 1  # 'old' went; 'fresh' was called since
  with pytest.raises(KeyError):
    recorder.calls('old')
  episode = recorder.close('fresh', 1.0)
  (trajectory,) = episode.trajectories
  assert (trajectory.group_id, trajectory.prompt_id) == (3, 9)  # the ids it was opened with
  with pytest.raises(ValueError, match='max_open'):
    EpisodeRecorder(max_open=0)
