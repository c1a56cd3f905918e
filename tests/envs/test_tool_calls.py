"""Tool-call parsers per format: well-formed, malformed, partial, nested and huge messages; the
renderers round-trip; the format picked from a chat template; results rendered per format."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_llm.envs.tool_calls import (
  MAX_CALL_CHARS,
  MAX_TOOL_CALLS,
  ToolCall,
  ToolCallError,
  format_tool_result,
  parse_tool_calls,
  render_tool_call,
  run_tool_calls,
  simple_tools_prompt,
  tool_format_for,
  with_tools,
)
from rlax_llm.errors import RlaxError
from rlax_llm.models.files import chat_template
from rlax_llm.models.files.gguf import smollm2_gguf_path
from rlax_llm.models.files.tokenizer import HFTokenizer

TAGGED = ('qwen', 'simple')
TOOLS = [{'type': 'function', 'function': {
    'name': 'calculate', 'description': 'Evaluates an arithmetic expression.',
    'parameters': {'type': 'object', 'properties': {'expression': {'type': 'string'}},
                   'required': ['expression']}}}]

# Condensed stand-ins for the checkpoints' templates, with the markers and the tool handling
# of the real ones (Qwen2.5: tools in the system turn, tool results as <tool_response> in a
# user turn; Llama 3.1: tools in the first user turn, results as an ipython turn).
QWEN_LIKE = (
    '{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}'
    '{% endfor %}\n</tools>\nReturn <tool_call>\n{"name": <function-name>, "arguments": '
    '<args-json-object>}\n</tool_call><|im_end|>\n{% endif %}'
    '{% for m in messages %}{% if m.role == "tool" %}'
    '{% if loop.first or messages[loop.index0 - 1].role != "tool" %}<|im_start|>user{% endif %}'
    '{{ "\n<tool_response>\n" + m.content + "\n</tool_response>" }}'
    '{% if loop.last or messages[loop.index0 + 1].role != "tool" %}<|im_end|>\n{% endif %}'
    '{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}'
    '{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}')
LLAMA_LIKE = (
    '<|begin_of_text|>{% for m in messages %}'
    '{% if m.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>\n\n'
    '{{ m.content | tojson }}<|eot_id|>'
    '{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n'
    '{% if tools and loop.first %}Respond in the format {"name": function name, "parameters": '
    'dictionary of argument name and its value}.{% for t in tools %}{{ t | tojson }}'
    '{% endfor %}\n\n{% endif %}{{ m.content }}<|eot_id|>{% endif %}{% endfor %}'
    '{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}')
CHATML = ('{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n'
          '{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}')


def test_qwen_several_calls_with_text_around():
  text = ('Let me compute.\n<tool_call>\n{"name": "calculate", "arguments": {"expression": '
          '"123 * 45"}}\n</tool_call>\nand\n<tool_call>{"name": "now"}</tool_call> done')
  calls = parse_tool_calls(text, 'qwen')
  assert calls == [
      ToolCall('calculate', {'expression': '123 * 45'},
               '<tool_call>\n{"name": "calculate", "arguments": {"expression": "123 * 45"}}\n'
               '</tool_call>'),
      ToolCall('now', {}, '<tool_call>{"name": "now"}</tool_call>')]
  assert all(c.raw in text for c in calls)
  assert parse_tool_calls('The answer is \\boxed{5535}.', 'qwen') == []
  assert parse_tool_calls('', 'simple') == []


def test_nested_json_and_braces_and_tags_inside_strings():
  text = ('<tool_call>{"name": "f", "arguments": {"a": {"b": [1, {"c": null}], "d": true}, '
          '"s": "} </tool_call> <tool_call> {\\"x\\": 1}", "u": "\\u00e9\\n"}}</tool_call>')
  [call] = parse_tool_calls(text, 'qwen')
  assert call.arguments == {'a': {'b': [1, {'c': None}], 'd': True},
                            's': '} </tool_call> <tool_call> {"x": 1}', 'u': 'é\n'}
  assert call.raw == text


def test_llama3_whole_message_calls():
  [call] = parse_tool_calls('  {"name": "calculate", "parameters": {"expression": "2*3"}}\n',
                            'llama3')
  assert call == ToolCall('calculate', {'expression': '2*3'},
                          '{"name": "calculate", "parameters": {"expression": "2*3"}}')
  calls = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {}}; '
                           '{"name": "g", "arguments": {"x": [1]}}', 'llama3')
  assert [(c.name, c.arguments) for c in calls] == [('f', {}), ('g', {'x': [1]})]
  # A message that does not start with an object is an answer, not a call.
  assert parse_tool_calls('The product is 5535. {"name": "f"}', 'llama3') == []


_NAME_MUST = r'"name" must be a non-empty string'
_NOT_OBJECT = r'"arguments" must be a JSON object, got'
_NO_OBJECT = r'expected a JSON object after <tool_call>'
MALFORMED = [  # (message, what the error says, the character position it names)
    ('<tool_call>{"name": "f", "arguments": {"x": 1,}}</tool_call>',
     r'invalid JSON \(Expecting property name', 46),
    ('<tool_call>{"name" "f"}</tool_call>', r"invalid JSON \(Expecting ':' delimiter\)", 19),
    ('<tool_call>{"arguments": {}}</tool_call>', _NAME_MUST + ', got None', 11),
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>', _NAME_MUST, 11),
    ('<tool_call>{"name": 3}</tool_call>', _NAME_MUST + ', got 3', 11),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', _NOT_OBJECT + ' str', 11),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', _NOT_OBJECT + ' list', 11),
    ('<tool_call>{"name": "f", "args": {}}</tool_call>', r"unknown keys \['args'\]", 11),
    ('<tool_call>["f"]</tool_call>', _NO_OBJECT, 11),
    ('<tool_call>"f"</tool_call>', _NO_OBJECT, 11),
    ('ok <tool_call>{"name": "f"}', r'unclosed <tool_call>', 27),
    ('<tool_call>{"name": "f"} </tool_cal', r'unclosed <tool_call>', 25),
    ('<tool_call>{"name": "f"} trailing</tool_call>', r'expected </tool_call> after', 25),
    ('<tool_call>', r'unclosed <tool_call>', 0),
    ('text </tool_call>', r'</tool_call> without an opening <tool_call>', 5),
    ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', r'NaN is not valid', 11),
]


@pytest.mark.parametrize('fmt', TAGGED)
@pytest.mark.parametrize('text, what, position', MALFORMED)
def test_malformed_calls_raise_with_what_where_and_the_text(fmt, text, what, position):
  with pytest.raises(ToolCallError, match=what) as info:
    parse_tool_calls(text, fmt)
  message = str(info.value)
  assert f'at character {position} ' in message
  assert '(text there: ' in message and '<tool_call>{"name": "TOOL"' in message
  assert isinstance(info.value, RlaxError)


@pytest.mark.parametrize('text, what', [
    ('{"name": "f", "parameters": [1]}', r'"parameters" must be a JSON object'),
    ('{"parameters": {}}', r'"name" must be a non-empty string'),
    ('{"name": "f", "parameters": {}, "arguments": {}}', r'both'),
    ('{"name": "f"} then prose', r'text after the tool call'),
    ('{"name": "f"};', r'expected a JSON object after ";"'),
    ('<|python_tag|>print(1)', r'expected a JSON object after <\|python_tag\|>'),
    ('{"name": "f", "param', r'cut mid-call'),
])
def test_llama3_malformed(text, what):
  with pytest.raises(ToolCallError, match=what):
    parse_tool_calls(text, 'llama3')


@pytest.mark.parametrize('fmt', ['qwen', 'llama3'])
def test_a_message_cut_mid_call_is_reported_at_every_cut(fmt):
  full = render_tool_call('calculate', {'expression': '(12 + 3) * 4', 'n': [1, {'a': 'b'}]},
                          fmt)
  assert parse_tool_calls(full, fmt)
  for cut in range(1, len(full)):
    partial = full[:cut]
    if fmt == 'qwen' and cut < len('<tool_call>'):
      assert parse_tool_calls(partial, fmt) == []  # not yet a tag: plain text
      continue
    with pytest.raises(ToolCallError, match=r'unclosed|cut mid-call|ends inside'):
      parse_tool_calls(partial, fmt)


def test_caps_on_calls_and_call_size():
  one = '<tool_call>{"name": "f"}</tool_call>'
  assert len(parse_tool_calls(one * MAX_TOOL_CALLS, 'qwen')) == MAX_TOOL_CALLS
  with pytest.raises(ToolCallError, match=f'more than {MAX_TOOL_CALLS} tool calls'):
    parse_tool_calls(one * (MAX_TOOL_CALLS + 1), 'qwen')
  fits = render_tool_call('f', {'x': 'y' * (MAX_CALL_CHARS - 100)}, 'qwen')
  assert parse_tool_calls(fits, 'qwen')[0].arguments['x'] == 'y' * (MAX_CALL_CHARS - 100)
  too_long = render_tool_call('f', {'x': 'y' * MAX_CALL_CHARS}, 'qwen')
  with pytest.raises(ToolCallError, match=f'longer than {MAX_CALL_CHARS} characters'):
    parse_tool_calls(too_long, 'qwen')


@pytest.mark.parametrize('fmt', ['qwen', 'llama3'])
@pytest.mark.parametrize('kind', ['plain', 'many_calls', 'one_huge_call', 'deep_nesting',
                                  'many_open_tags', 'spaces'])
def test_one_megabyte_messages_are_parsed_fast_and_bounded(fmt, kind):
  size = 1 << 20
  call = render_tool_call('f', {}, fmt)
  text = {
      'plain': 'x' * size,
      'many_calls': (call + ('; ' if fmt == 'llama3' else ' ')) * (size // (len(call) + 2)),
      'one_huge_call': render_tool_call('f', {'x': 'y' * size}, fmt),
      'deep_nesting': ('<tool_call>' if fmt == 'qwen' else '') + '{"a":' * (size // 5),
      'many_open_tags': '<tool_call>' * (size // 11),
      'spaces': ('<tool_call>' if fmt == 'qwen' else '') + ' ' * size + '{"name": "f"}',
  }[kind]
  start = time.perf_counter()
  try:
    calls = parse_tool_calls(text, fmt)
  except ToolCallError as e:
    assert len(str(e)) < 400  # the message shows an excerpt, never the megabyte
  else:
    no_call = kind == 'plain' or (fmt == 'llama3' and kind == 'many_open_tags')
    assert (calls == [] if no_call else kind == 'spaces' and len(calls) == 1)
  assert time.perf_counter() - start < 0.5


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(), children, max_size=3),
    max_leaves=12)
TEXT_AROUND = st.text().filter(lambda t: '<tool_call>' not in t and '</tool_call>' not in t)


@settings(max_examples=150, deadline=None)
@given(fmt=st.sampled_from(['qwen', 'llama3', 'simple']),
       calls=st.lists(st.tuples(st.text(min_size=1, max_size=20),
                                st.dictionaries(st.text(max_size=10), JSON_VALUES, max_size=4)),
                      min_size=1, max_size=4),
       before=TEXT_AROUND, after=TEXT_AROUND)
def test_render_then_parse_gives_the_calls_back(fmt, calls, before, after):
  rendered = [render_tool_call(name, arguments, fmt) for name, arguments in calls]
  if fmt == 'llama3':
    text = '; '.join(rendered)
  else:
    text = before + '\n'.join(rendered) + after
  parsed = parse_tool_calls(text, fmt)
  assert [(c.name, c.arguments, c.raw) for c in parsed] == [
      (name, arguments, raw) for (name, arguments), raw in zip(calls, rendered)]


def test_unknown_format_and_non_text():
  with pytest.raises(ValueError, match=r"unknown tool-call format 'hermes'; choose one of"):
    parse_tool_calls('x', 'hermes')
  with pytest.raises(TypeError, match='expects the message text as a str'):
    parse_tool_calls(None, 'qwen')


def test_tool_format_for_reads_the_chat_template():
  assert tool_format_for(QWEN_LIKE) == 'qwen'
  assert tool_format_for(LLAMA_LIKE) == 'llama3'
  assert tool_format_for(CHATML) == 'simple'
  assert tool_format_for(None) == 'simple'

  class WithTemplate:
    chat_template = QWEN_LIKE

  assert tool_format_for(WithTemplate()) == 'qwen'


@pytest.mark.skipif(not smollm2_gguf_path().is_file(), reason='SmolLM2 GGUF not installed')
def test_smollm2_gets_the_simple_format_and_renders_it():
  tokenizer = HFTokenizer.from_gguf(smollm2_gguf_path())
  assert tool_format_for(tokenizer) == 'simple'
  messages, kwargs = with_tools([{'role': 'user', 'content': 'What is 123 * 45?'}], TOOLS,
                                'simple')
  call = render_tool_call('calculate', {'expression': '123 * 45'}, 'simple')
  messages += [{'role': 'assistant', 'content': call}, format_tool_result('5535', 'simple')]
  text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
  assert text.startswith('<|im_start|>system\nYou can call these tools')
  assert ('<|im_start|>user\n<tool_response>\n5535\n</tool_response><|im_end|>\n'
          '<|im_start|>assistant\n') in text


def test_results_render_through_each_template():
  user = [{'role': 'user', 'content': 'What is 123 * 45?'}]
  for fmt, template, expected in [
      ('qwen', QWEN_LIKE, '<|im_start|>user\n<tool_response>\n5535\n</tool_response><|im_end|>'),
      ('llama3', LLAMA_LIKE, '<|start_header_id|>ipython<|end_header_id|>\n\n"5535"<|eot_id|>'),
      ('simple', CHATML, '<|im_start|>user\n<tool_response>\n5535\n</tool_response><|im_end|>'),
  ]:
    messages, kwargs = with_tools(user, TOOLS, fmt)
    messages += [{'role': 'assistant', 'content': render_tool_call('calculate', {}, fmt)},
                 format_tool_result('5535', fmt, name='calculate')]
    text = chat_template.render(template, messages, add_generation_prompt=True, **kwargs)
    assert expected in text
    assert '"name": "calculate"' in text  # the tools reached the model's prompt
  assert format_tool_result('7', 'qwen', name='f') == {'role': 'tool', 'content': '7',
                                                       'name': 'f'}


def test_with_tools_keeps_a_system_message_and_leaves_no_tools_alone():
  system = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'hi'}]
  messages, kwargs = with_tools(system, TOOLS, 'simple')
  assert kwargs == {} and len(messages) == 2
  assert messages[0]['content'] == 'Be brief.\n\n' + simple_tools_prompt(TOOLS)
  assert system[0]['content'] == 'Be brief.'  # the caller's messages are not changed
  assert with_tools(system, [], 'qwen') == (system, {})
  assert with_tools(system, TOOLS, 'qwen')[1] == {'tools': TOOLS}


def test_run_tool_calls_contains_every_failure():
  def calculate(expression: str) -> str:
    if expression == 'boom':
      raise ZeroDivisionError('division by zero')
    return expression.upper()

  calls = [ToolCall('calculate', {'expression': 'ok'}, ''),
           ToolCall('calculate', {'expression': 'boom'}, ''),
           ToolCall('calculate', {'expr': 'x'}, ''),
           ToolCall('search', {}, '')]
  contents = run_tool_calls(calls, {'calculate': calculate})
  assert contents[0] == 'OK'
  assert contents[1] == 'error: calculate raised ZeroDivisionError: division by zero'
  assert contents[2].startswith("error: calculate raised TypeError:")
  assert "unexpected keyword argument 'expr'" in contents[2]
  assert contents[3] == "error: unknown tool 'search'; the tools are ['calculate']."
