"""The OpenAI API over real HTTP, through the clients people use (the official openai client,
sync, async and streaming; LangChain's ChatOpenAI; LlamaIndex's OpenAILike): every greedy answer
equals the in-process ``LazyLLM.generate`` of the same prompt."""
import asyncio
import uuid

import httpx
import pytest

from lazy_rag.chat import render_messages
from lazy_rag.server.prompts import Document, chat_with_documents

QUESTION = "In what year was the Marrow Point Lighthouse completed?"
MAX = 12
HTTP = httpx.Client(timeout=120)


def in_process(llm, segments, max_new_tokens=MAX):
    return llm.generate(segments, max_new_tokens=max_new_tokens, temperature=0.0).text


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI

    return OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0)


def test_chat_sync_and_stream_equal_in_process(served, client, smollm2, no_server_errors):
    messages = [{"role": "system", "content": "Reply briefly."}, {"role": "user", "content": "Name a colour."}]
    want = in_process(smollm2, [render_messages(smollm2.tokenizer, [(m["role"], m["content"]) for m in messages])])
    r = client.chat.completions.create(model=served.model, messages=messages, max_tokens=MAX, temperature=0)
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == len(smollm2.tokenizer(want, add_special_tokens=False).input_ids) or \
        r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stream = client.chat.completions.create(model=served.model, messages=messages, max_tokens=MAX, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == want
    assert finish == r.choices[0].finish_reason
    assert usage.completion_tokens == r.usage.completion_tokens and usage.prompt_tokens == r.usage.prompt_tokens


def test_completions_and_async_client(served, smollm2, no_server_errors):
    from openai import AsyncOpenAI

    prompt = "The three primary colours are"
    want = in_process(smollm2, [prompt])

    async def main():
        client = AsyncOpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0)
        # concurrent requests are batched by the engine; each answer is still its own
        r1, r2 = await asyncio.gather(
            client.completions.create(model=served.model, prompt=prompt, max_tokens=MAX, temperature=0),
            client.chat.completions.create(model=served.model, max_tokens=MAX, temperature=0,
                                           messages=[{"role": "user", "content": "Name a colour."}]))
        text = ""
        async for chunk in await client.completions.create(model=served.model, prompt=prompt, max_tokens=MAX,
                                                           temperature=0, stream=True):
            text += chunk.choices[0].text if chunk.choices else ""
        return r1, r2, text

    r1, r2, streamed = asyncio.run(main())
    assert r1.choices[0].text == want == streamed
    assert r2.choices[0].message.content == in_process(
        smollm2, [render_messages(smollm2.tokenizer, [("user", "Name a colour.")])])


def test_documents_are_reused_in_another_order(served, client, smollm2, no_server_errors):
    tag = uuid.uuid4().hex[:8]  # documents no earlier request has cached
    docs = [{"title": "Ferry", "text": f"The ferry {tag} leaves Port Sallow every morning at nine o'clock."},
            f"The Marrow Point Lighthouse ({tag}) was designed by the engineer Agnes Thorold."]
    question = [{"role": "user", "content": "Who designed the lighthouse?"}]

    def ask(documents):
        return client.chat.completions.create(model=served.model, messages=question, max_tokens=MAX, temperature=0,
                                              extra_body={"documents": documents})

    first = ask(docs)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # encoded by this request
    second = ask(docs[::-1])
    assert second.usage.prompt_tokens_details.cached_tokens > 0   # the same KV, at other positions
    extra = second.model_extra["lazy_rag"]
    assert extra["chunk_sources"] == {"pool": 2} and extra["encoded_tokens"] == 0
    parsed = [Document(d["text"], d["title"]) if isinstance(d, dict) else Document(d) for d in docs[::-1]]
    want = in_process(smollm2, chat_with_documents(smollm2.tokenizer, [("user", question[0]["content"])], parsed))
    assert second.choices[0].message.content == want


def test_rag_returns_sources_and_the_query_answer(served, client, corpus_index, no_server_errors):
    r = client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": QUESTION}],
                                       max_tokens=24, temperature=0, extra_body={"rag": {"top_k": 2}})
    sources = r.model_extra["sources"]
    assert len(sources) == 2 and sources[0]["source"].endswith("lighthouse.md")
    assert [s["chunk_id"] for s in sources] == [s.chunk_id for s in corpus_index.retrieve(QUESTION, 2)]
    want = corpus_index.query(QUESTION, top_k=2, max_new_tokens=24).answer
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens_details.cached_tokens > 0


def test_indexed_text_in_a_message_is_served_from_its_kv(served, client, corpus_index, smollm2, no_server_errors):
    chunk = corpus_index.records[0]
    messages = [{"role": "user", "content": f"Context:\n{chunk.text}\n\nSummarise the context in five words."}]
    r = client.chat.completions.create(model=served.model, messages=messages, max_tokens=MAX, temperature=0)
    assert r.model_extra["lazy_rag"]["matched_chunks"] == [chunk.id]
    assert r.usage.prompt_tokens_details.cached_tokens >= len(chunk.token_ids)
    plan = served.state.builder.matcher.split(render_messages(smollm2.tokenizer, [("user", messages[0]["content"])]))
    want = smollm2.generate(plan.segments, max_new_tokens=MAX, source=corpus_index.chunk_source).text
    assert r.choices[0].message.content == want


@pytest.mark.parametrize("mode", ["block", "prefix", "full"])
def test_mode_per_request(served, client, smollm2, mode, no_server_errors):
    messages = [{"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(model=served.model, messages=messages, max_tokens=MAX, temperature=0,
                                       extra_body={"rag": {"top_k": 2}, "mode": mode})
    assert r.model_extra["lazy_rag"]["mode"] == mode
    if mode == "full":
        assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_langchain_chat_openai(served, client, no_server_errors):
    from langchain_openai import ChatOpenAI

    messages = [{"role": "user", "content": "Name a colour."}]
    want = client.chat.completions.create(model=served.model, messages=messages, max_tokens=MAX,
                                          temperature=0).choices[0].message.content
    llm = ChatOpenAI(base_url=served.base_url + "/v1", api_key="unused", model=served.model, max_tokens=MAX,
                     temperature=0, max_retries=0)
    assert llm.invoke("Name a colour.").content == want
    assert "".join(c.content for c in llm.stream("Name a colour.")) == want


def test_llama_index_openai_like(served, client, no_server_errors):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    want = client.chat.completions.create(model=served.model, max_tokens=MAX, temperature=0,
                                          messages=[{"role": "user", "content": "Name a colour."}]
                                          ).choices[0].message.content
    llm = OpenAILike(model=served.model, api_base=served.base_url + "/v1", api_key="unused", is_chat_model=True,
                     max_tokens=MAX, temperature=0, context_window=8192, max_retries=0)
    assert llm.chat([ChatMessage(role="user", content="Name a colour.")]).message.content == want
    assert llm.complete("Name a colour.").text == want


def test_models_health_ready_metrics(served, client, no_server_errors):
    assert [m.id for m in client.models.list()] == [served.model]
    assert HTTP.get(served.base_url + "/health").json() == {"status": "ok"}
    assert HTTP.get(served.base_url + "/ready").status_code == 200
    text = HTTP.get(served.base_url + "/metrics").text
    for name in ("lazy_rag_http_requests_total", "lazy_rag_ttft_seconds_bucket", "lazy_rag_request_latency_seconds",
                 "lazy_rag_prompt_tokens_total", "lazy_rag_cached_prompt_tokens_total",
                 "lazy_rag_generated_tokens_total", "lazy_rag_queue_depth", 'lazy_rag_pool_pages{state="in_use"}',
                 'lazy_rag_chunks_served_total{tier="pool"}'):
        assert name in text, name
    ok = [line for line in text.splitlines()
          if line.startswith('lazy_rag_http_requests_total{endpoint="/v1/chat/completions",status="200"}')]
    assert ok and float(ok[0].split()[-1]) >= 1


def test_response_format_json_schema_and_json_mode_through_the_openai_client(served, client, no_server_errors):
    """OpenAI's response_format: the answer parses and follows the schema (enforced while sampling)."""
    import json

    schema = {"type": "object", "additionalProperties": False, "required": ["year", "lit"],
              "properties": {"year": {"type": "integer", "minimum": 1000, "maximum": 2100}, "lit": {"type": "boolean"}}}
    messages = [{"role": "user", "content": QUESTION + " Answer as JSON."}]
    r = client.chat.completions.create(model=served.model, messages=messages, max_tokens=24, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "answer", "schema": schema}})
    obj = json.loads(r.choices[0].message.content)
    assert r.choices[0].finish_reason == "stop" and set(obj) == {"year", "lit"} and 1000 <= obj["year"] <= 2100
    r = client.chat.completions.create(model=served.model, messages=messages, max_tokens=24, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")


def test_embeddings_through_the_openai_client_equal_the_index_embedder(served, client, corpus_index,
                                                                      no_server_errors):
    """/v1/embeddings with the official client (which asks for base64) and with floats over plain HTTP."""
    import numpy as np

    texts = ["When does the bakery open?", "The lighthouse was completed in 1871."]
    r = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    got = np.array([d.embedding for d in r.data], dtype=np.float32)
    np.testing.assert_allclose(got, corpus_index.embedder.encode(texts), atol=1e-5)
    assert r.model == "all-MiniLM-L6-v2" and r.usage.prompt_tokens > len(texts)
    plain = HTTP.post(served.base_url + "/v1/embeddings", json={"model": served.model, "input": texts[0]}).json()
    np.testing.assert_allclose(plain["data"][0]["embedding"], got[0], atol=1e-5)
    r = HTTP.post(served.base_url + "/v1/embeddings", json={"model": "text-embedding-3-small", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = HTTP.post(served.base_url + "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": [1, 2]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"

