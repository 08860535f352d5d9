"""The real model through the disaggregated stack: `pdserve up --model-path SmolLM2.gguf` (router,
prefill and decode servers, real processes; fp32 on CPU) against transformers on the same GGUF.
Greedy chats end at the model's own EOS (<|im_end|>) with finish_reason "stop", token for token;
the prompt's logprobs (echo + logprobs, the prefill server's) equal transformers' log-softmax."""

import openai
import pytest
import torch

from tests.router_stack import pdserve_up
from tests.test_gguf import QUESTIONS, hf_greedy


@pytest.fixture(scope="module")
def stack(smollm2):
    path = smollm2[0]
    proc, port, _ = pdserve_up(path)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=300, max_retries=0)
    yield path, client
    proc.send_signal(2)  # Ctrl-C
    proc.wait(90)
    assert proc.returncode == 0


def test_greedy_chats_end_at_the_models_eos_as_transformers(smollm2, stack):
    _, hf, tokenizer = smollm2
    path, client = stack
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
    path, client = stack
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
