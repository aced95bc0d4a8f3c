"""Chat templates of the tool-calling model families, written for the tests.

Each writes the tool markup its family's published template writes (the system prompt wording
is shortened): Qwen2.5-style hermes `<tool_call>` JSON, Qwen3 (hermes plus the `<think>`
block and `enable_thinking`), Qwen3-Coder's XML function/parameter tags, Llama 3.1's JSON with
`parameters` and the `ipython` role, and Mistral v0.3's `[TOOL_CALLS] [...]` list with 9-char ids.
"""

QWEN25 = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are Qwen.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
{%- for tool in tools %}
{{- "\\n" }}{{- tool | tojson }}
{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\
\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}\
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Qwen3: hermes tool calls; enable_thinking=False closes an empty <think> block in the
# generation prompt.
QWEN3 = QWEN25.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}",
)

QWEN3_CODER = """\
{%- if tools %}
{{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.\\n\\n# Tools\\n\\nYou have access to the following \
functions:\\n\\n<tools>' }}
{%- for tool in tools %}
{%- if tool.function is defined %}{%- set tool = tool.function %}{%- endif %}
{{- '\\n<function>\\n<name>' + tool.name + '</name>' }}
{%- if tool.description is defined %}{{- '\\n<description>' + tool.description + '</description>' }}{%- endif %}
{{- '\\n<parameters>' }}
{%- for param_name, param_fields in (tool.parameters.properties or {}) | items %}
{{- '\\n<parameter>\\n<name>' + param_name + '</name>' }}
{%- if param_fields.type is defined %}{{- '\\n<type>' + param_fields.type | string + '</type>' }}{%- endif %}
{{- '\\n</parameter>' }}
{%- endfor %}
{{- '\\n</parameters>\\n</function>' }}
{%- endfor %}
{{- "\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n\
<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n\
</function>\\n</tool_call><|im_end|>\\n" }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or message.role == "system" %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
{%- for args_name, args_value in tool_call.arguments | items %}
{{- '<parameter=' + args_name + '>\\n' }}
{%- if args_value is mapping or (args_value is sequence and args_value is not string) %}\
{{- args_value | tojson }}{%- else %}{{- args_value | string }}{%- endif %}
{{- '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user\\n' }}{%- endif %}
{{- '<tool_response>\\n' + message.content + '\\n</tool_response>\\n' }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA31 = """\
{{- bos_token }}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\\n\\n<|eot_id|>' }}
{%- for message in messages %}
{%- if message.role == 'user' and tools and loop.first %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
{{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments that \
best answers the given prompt.\\n\\n' }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\
Do not use variables.\\n\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
{{- message.content + '<|eot_id|>' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- if message.tool_calls | length != 1 %}{{- raise_exception('This model only supports single tool-calls at once!') }}\
{%- endif %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{{- '{"name": "' + tool_call.name + '", ' }}{{- '"parameters": ' }}{{- tool_call.arguments | tojson }}{{- '}' }}\
{{- '<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
{%- if message.content is mapping %}{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}
{{- '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

MISTRAL_V3 = """\
{%- set user_messages = messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == "user" %}
{%- if tools and message == user_messages[-1] %}
{{- "[AVAILABLE_TOOLS] [" }}
{%- for tool in tools %}{{- tool | tojson }}{%- if not loop.last %}{{- ", " }}{%- endif %}{%- endfor %}
{{- "][/AVAILABLE_TOOLS]" }}
{%- endif %}
{{- "[INST] " + message.content + "[/INST]" }}
{%- elif message.tool_calls is defined and message.tool_calls %}
{{- "[TOOL_CALLS] [" }}
{%- for tool_call in message.tool_calls %}
{%- set out = tool_call.function | tojson %}
{{- out[:-1] }}
{%- if tool_call.id is not defined or tool_call.id | length != 9 %}\
{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{%- endif %}
{{- ', "id": "' + tool_call.id + '"}' }}
{%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
{%- endfor %}
{%- elif message.role == "assistant" %}
{{- " " + message.content | trim + eos_token }}
{%- elif message.role == "tool" %}
{{- '[TOOL_RESULTS] {"content": ' + message.content | string + ', "call_id": "' + message.tool_call_id + '"}\
[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}
"""

# A thinking model's template (Qwen3-Thinking-2507, DeepSeek-R1): the generation prompt opens the
# <think> block, so the output starts inside it.
QWEN3_THINKING = QWEN3.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is not defined or enable_thinking is not false %}{{- '<think>\\n' }}{%- endif %}",
)
assert QWEN3_THINKING != QWEN3

TOOL_TEMPLATES = {"hermes": QWEN25, "qwen3": QWEN3, "qwen3_coder": QWEN3_CODER, "llama3_json": LLAMA31,
                  "mistral": MISTRAL_V3}
