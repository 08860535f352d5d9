"""The real model through the disaggregated stack, started as the README says: `pdserve up` with no
model named serves SmolLM2-135M-Instruct (router, prefill and decode servers, real processes; fp32
on CPU). Against transformers on the same GGUF: greedy chats end at the model's own EOS
(<|im_end|>) with finish_reason "stop", token for token; the prompt's logprobs (echo + logprobs, the
prefill server's) equal transformers' log-softmax. And a newcomer's first requests: a question with
no sampling field, the README's structured-output snippet, tools on a template without tools."""

import contextlib
import io
import json
import pathlib
import re
import shlex
import subprocess
import time

import openai
import pytest
import torch

from tests.router_stack import pdserve_up
from tests.test_docs_walkthrough import shell_commands
from tests.test_gguf import QUESTIONS, hf_greedy

README = pathlib.Path(__file__).parent.parent / "README.md"


@pytest.fixture(scope="module")
def stack(smollm2):
    path = smollm2[0]
    started = time.monotonic()
    # The default model; answers that leave max_tokens out stop at 128 tokens, not 512 (the README's
    # haiku runs on at times at the model's sampling defaults: a minute of this 2-core box)
    proc, port, up_line = pdserve_up(None, "--default-max-tokens", "128")
    print(f"\npdserve up (SmolLM2) ready in {time.monotonic() - started:.1f} s: {up_line.strip()}")
    assert path in up_line
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=300, max_retries=0)
    yield path, client, port
    proc.send_signal(2)  # Ctrl-C
    proc.wait(90)
    assert proc.returncode == 0


def test_greedy_chats_end_at_the_models_eos_as_transformers(smollm2, stack):
    _, hf, tokenizer = smollm2
    path, client, _ = stack
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        [expected] = hf_greedy(hf, [ids], 64, (tokenizer.eos_token_id,))
        assert expected[-1] == tokenizer.eos_token_id, "transformers' answer ends at <|im_end|> within 64 tokens"
        out = client.chat.completions.create(
            model=path, messages=messages, max_tokens=64, temperature=0, extra_body={"return_token_ids": True}
        )
        choice = out.choices[0]
        assert choice.model_extra["token_ids"] == expected and choice.model_extra["prompt_token_ids"] == ids
        assert choice.finish_reason == "stop"
        assert choice.message.content == tokenizer.decode(expected, skip_special_tokens=True)


def test_prompt_logprobs_equal_transformers_log_softmax(smollm2, stack):
    _, hf, tokenizer = smollm2
    path, client, _ = stack
    ids = tokenizer("The capital of France is Paris. The capital of Italy is Rome.")["input_ids"]
    with torch.no_grad():
        scores = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = [scores[p - 1, ids[p]].item() for p in range(1, len(ids))]
    out = client.completions.create(model=path, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    got = out.choices[0].logprobs.token_logprobs
    assert got[0] is None and len(got) == len(ids)
    assert max(abs(a - b) for a, b in zip(got[1:], want)) < 1e-4
    # The top choice at each position is transformers' argmax (the entry that is not the prompt token, or it).
    for p, top in enumerate(out.choices[0].logprobs.top_logprobs[1:], start=1):
        best = tokenizer.decode([int(scores[p - 1].argmax())])
        assert best in top, (p, best, top)


def test_a_question_with_no_sampling_fields_gets_a_short_right_answer(stack):
    """The model's sampling defaults (its model card's; the GGUF carries none) and its served name
    (the file's short name): the answer ends by itself, well within 30 s on a 2-core machine."""
    _, client, port = stack
    [model] = client.models.list().data
    assert model.id == "SmolLM2-135M-Instruct.Q4_1"
    quick = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=30, max_retries=0)
    answer = quick.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": "What is the capital of France?"}], seed=0
    )
    assert "Paris" in answer.choices[0].message.content and answer.choices[0].finish_reason == "stop"


def readme_snippet(marker: str) -> str:
    """The README's Python block that holds `marker`."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    [block] = [b for b in blocks if marker in b]
    return block


def run_snippet(snippet: str, port: int) -> tuple[dict, str]:
    """A README block run as written (only the port differs): its globals and what it printed."""
    assert snippet.count("127.0.0.1:8000") == 1
    scope: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(compile(snippet.replace("127.0.0.1:8000", f"127.0.0.1:{port}"), "README.md", "exec"), scope)
    return scope, printed.getvalue()


def test_the_readme_snippets_run_unchanged(stack):
    """The quickstart's chat snippet prints an answer and a streamed haiku; the structured-output
    snippet parses into its pydantic model; getting-started's curl line gets a chat completion."""
    _, _, port = stack
    scope, printed = run_snippet(readme_snippet("stream=True"), port)
    assert scope["answer"].choices[0].message.content and len(printed) > len(scope["answer"].choices[0].message.content)
    scope, _ = run_snippet(readme_snippet("chat.completions.parse"), port)
    city = scope["city"]
    assert isinstance(city, scope["City"]) and city.name and isinstance(city.population, int)
    assert len(str(abs(city.population))) <= 20  # the bounded integer grammar

    [curl] = [c for c in shell_commands() if c.startswith("curl ")]
    out = subprocess.run(
        shlex.split(curl.replace("127.0.0.1:8000", f"127.0.0.1:{port}")), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and json.loads(out.stdout)["choices"][0]["message"]["content"], out


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def test_tools_on_a_template_without_tools_are_told_not_dropped(stack):
    """SmolLM2's chat template does not render tools: the built-in tools prompt tells the model of
    them (the prompt grows), and a forced call comes back parsed, with no call text as content."""
    path, client, _ = stack
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    plain = client.chat.completions.create(model=path, messages=messages, max_tokens=1)
    told = client.chat.completions.create(model=path, messages=messages, max_tokens=1, tools=TOOLS)
    assert told.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    forced = client.chat.completions.create(
        model=path, messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=64
    )
    [choice] = forced.choices
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.tool_calls[0].function.name == "get_weather"
