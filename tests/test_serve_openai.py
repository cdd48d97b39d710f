"""The official ``openai`` client against ``trapetum serve`` (embedded default model, real subprocess)."""
from __future__ import annotations

import httpx
import pytest

import serve_fixtures as F

openai = pytest.importorskip("openai")

KEY = "sk-trapetum-test"
ARGS = ["--api-key", KEY, "--queue", "128", "--threads", "1"]
Q = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    return F.shared_server(ARGS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def model_id(client):
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


def test_models(client, model_id):
    m = client.models.retrieve(model_id)
    assert m.id == model_id and m.object == "model"
    info = m.model_extra["info"]
    assert info["context_size"] > 0 and info["parameters"] > 0


def test_chat(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=Q, max_tokens=12, temperature=0)
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant"
    assert "Paris" in c.message.content
    assert c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 5 and 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_non_stream(client, model_id):
    kw = dict(model=model_id, messages=Q, max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])
    assert len({ch.id for ch in chunks}) == 1


def test_completions(client, model_id):
    r = client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=6,
                                  temperature=0)
    assert r.object == "text_completion" and r.choices[0].text.strip()
    assert r.usage.completion_tokens <= 6
    s = list(client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=6,
                                       temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in s) == r.choices[0].text
    assert s[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_settings_reach_the_engine(client, model_id):
    kw = dict(model=model_id, prompt="List: 1, 2, 3,", max_tokens=8)
    a = client.completions.create(**kw, temperature=1.0, seed=7).choices[0].text
    b = client.completions.create(**kw, temperature=1.0, seed=7).choices[0].text
    assert a == b                                   # seeded sampling is reproducible
    r = client.completions.create(**kw, temperature=0, stop=[","])
    assert "," not in r.choices[0].text and r.choices[0].finish_reason == "stop"


def test_openai_errors(client, model_id, server):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=model_id, messages=Q, n=2)
    assert ei.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=Q, max_tokens=2)
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url + "/health").status_code == 200     # no key needed for health
    assert httpx.get(server.url + "/").status_code == 200           # nor for the page
