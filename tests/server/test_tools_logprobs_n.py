"""OpenAI's tools / tool_choice, logprobs / top_logprobs and n over real HTTP, and /info behind
the API key. Logprobs and n run on the word model (milliseconds a token); the tool calls on
SmolLM2 (the word model's vocabulary has no braces for a JSON call)."""
import json

import httpx
import pytest
import torch

from lazy_rag.chat import render_messages
from lazy_rag.server.prompts import TOOL_RESULT
from lazy_rag.structured import plan_tools
from tests.server.word_model import word_llm

HTTP = httpx.Client(timeout=120)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def word():
    yield word_llm()


@pytest.fixture
def word_server(word, start_server):
    return start_server(word, model_name="m", engine_process=False)


def post(server, path, body, **kw):
    return HTTP.post(server.base_url + path, json={"model": server.model, **body}, **kw)


def sse(text: str) -> list[dict]:
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# -- /info ------------------------------------------------------------------------------------------
def test_info_needs_the_api_key_when_the_server_has_keys(word, start_server, no_server_errors):
    s = start_server(word, model_name="m", engine_process=False, api_key="secret")
    assert HTTP.get(s.base_url + "/info").status_code == 401
    wrong = HTTP.get(s.base_url + "/info", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    ok = HTTP.get(s.base_url + "/info", headers={"Authorization": "Bearer secret"})
    assert ok.status_code == 200 and ok.json()["model"] == "m"
    assert HTTP.get(s.base_url + "/health").status_code == 200  # probes stay open


# -- logprobs ---------------------------------------------------------------------------------------
def teacher_forced_logprobs(llm, prompt_ids: list[int], answer_ids: list[int]) -> torch.Tensor:
    """log_softmax rows predicting each answer token, from one prefill of prompt + answer (full mode)."""
    h = llm.engine.submit([prompt_ids + answer_ids[:-1]], mode="full", max_new_tokens=1, temperature=0,
                          score_rows=len(answer_ids), score_fn=lambda rows: torch.log_softmax(rows.float(), -1).cpu())
    llm.engine.run_until_done()
    return h.score


def test_chat_logprobs_are_the_models_distribution_streamed_and_whole(word, word_server, no_server_errors):
    body = {"messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 3}
    r = post(word_server, "/v1/chat/completions", body).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"] == 6
    assert " ".join(e["token"] for e in content) == r["choices"][0]["message"]["content"]
    for e in content:
        assert len(e["top_logprobs"]) == 3 and e["bytes"] == list(e["token"].encode())
        assert e["top_logprobs"][0]["token"] == e["token"]  # greedy: the most likely token
        assert e["top_logprobs"][0]["logprob"] == e["logprob"] >= e["top_logprobs"][1]["logprob"]
    prompt = word.tokenizer(render_messages(word.tokenizer, [("user", "w1 w2 w3")]),
                            add_special_tokens=False).input_ids
    answer = word.tokenizer([e["token"] for e in content], is_split_into_words=True,
                            add_special_tokens=False).input_ids
    ref = teacher_forced_logprobs(word, prompt, answer)
    for j, e in enumerate(content):
        assert e["logprob"] == pytest.approx(float(ref[j, answer[j]]), abs=1e-3)
        top = ref[j].topk(3)
        assert [t["logprob"] for t in e["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-3)
    events = sse(post(word_server, "/v1/chat/completions", {**body, "stream": True}).text)
    streamed = [e for ev in events for c in ev["choices"] if c["logprobs"] for e in c["logprobs"]["content"]]
    assert streamed == content
    # without top_logprobs: the tokens' logprobs only
    r = post(word_server, "/v1/chat/completions", {**body, "top_logprobs": None}).json()
    assert [e["top_logprobs"] for e in r["choices"][0]["logprobs"]["content"]] == [[]] * 6
    assert post(word_server, "/v1/chat/completions", {**body, "logprobs": False,
                                                      "top_logprobs": None}).json()["choices"][0]["logprobs"] is None


def test_sampled_logprobs_and_the_legacy_completions_format(word_server, no_server_errors):
    body = {"prompt": "w5 w6", "max_tokens": 5, "temperature": 1.0, "seed": 3, "logprobs": 2}
    r = post(word_server, "/v1/completions", body).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert all(len(t) == 2 and max(t.values()) >= lp["token_logprobs"][i] for i, t in enumerate(lp["top_logprobs"]))
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    events = sse(post(word_server, "/v1/completions", {**body, "stream": True}).text)
    tokens = [t for ev in events for c in ev["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert tokens == lp["tokens"]  # the same seed: the same tokens, streamed


def test_logprobs_and_n_through_the_engine_process(start_server, tmp_path, no_server_errors):
    """The default driver: the engine in its own process sends each step's logprobs over the pipe."""
    from lazy_rag.server import EngineSpec
    from tests.server.word_model import word_tokenizer

    word_tokenizer().save_pretrained(tmp_path / "tokenizer")
    s = start_server(EngineSpec(random="tiny-llama", tokenizer=str(tmp_path / "tokenizer"), device="cpu"),
                     model_name="m")
    body = {"messages": [{"role": "user", "content": "w4 w8"}], "max_tokens": 5, "temperature": 0, "n": 2,
            "logprobs": True, "top_logprobs": 2}
    r = post(s, "/v1/chat/completions", body).json()
    assert r["usage"]["completion_tokens"] == 10
    contents = [c["logprobs"]["content"] for c in r["choices"]]

    def same(a, b):  # the same tokens; logprobs equal up to the batch's float rounding
        assert [e["token"] for e in a] == [e["token"] for e in b]
        assert [e["logprob"] for e in a] == pytest.approx([e["logprob"] for e in b], abs=1e-4)
        assert [[t["token"] for t in e["top_logprobs"]] for e in a] == [[t["token"] for t in e["top_logprobs"]]
                                                                         for e in b]

    assert len(contents[0]) == 5 and all(e["top_logprobs"][0]["token"] == e["token"] for e in contents[0])
    same(contents[0], contents[1])
    events = sse(post(s, "/v1/chat/completions", {**body, "stream": True}).text)
    for i in (0, 1):
        same([e for ev in events for c in ev["choices"] if c["index"] == i and c["logprobs"]
              for e in c["logprobs"]["content"]], contents[i])


# -- n ----------------------------------------------------------------------------------------------
def test_n_choices_whole_and_streamed_with_summed_usage(word_server, no_server_errors):
    body = {"messages": [{"role": "user", "content": "w9"}], "max_tokens": 4}
    one = post(word_server, "/v1/chat/completions", {**body, "temperature": 0}).json()
    r = post(word_server, "/v1/chat/completions", {**body, "temperature": 0, "n": 3}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert {c["message"]["content"] for c in r["choices"]} == {one["choices"][0]["message"]["content"]}
    assert r["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]  # counted once, as OpenAI does
    assert r["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    sampled = {**body, "temperature": 1.0, "seed": 11, "n": 4}
    a = post(word_server, "/v1/chat/completions", sampled).json()
    texts = [c["message"]["content"] for c in a["choices"]]
    assert len(set(texts)) > 1  # seed + i per choice: they differ...
    assert texts == [c["message"]["content"]  # ...and repeat
                     for c in post(word_server, "/v1/chat/completions", sampled).json()["choices"]]
    events = sse(post(word_server, "/v1/chat/completions", {**sampled, "stream": True,
                                                            "stream_options": {"include_usage": True}}).text)
    got, finished = ["", "", "", ""], set()
    for ev in events:
        for c in ev["choices"]:
            got[c["index"]] += c["delta"].get("content") or ""
            if c["finish_reason"]:
                finished.add(c["index"])
    assert got == texts and finished == {0, 1, 2, 3}
    assert events[-1]["usage"]["completion_tokens"] == a["usage"]["completion_tokens"] == 16
    assert word_server.wait_idle()["requests_running"] == 0


# -- refusals ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"tools": [WEATHER]}, "tools"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"n": 129}, "n"),
    ("/v1/chat/completions", {"n": 65}, "n"),  # more than the server's queue (64)
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ("/v1/chat/completions", {"tools": [{"type": "retrieval"}]}, "tools"),
    ("/v1/chat/completions", {"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"functions": [WEATHER["function"]]}, "functions"),
])
def test_unsupported_combinations_are_400s_naming_the_field(word_server, path, body, param):
    base = {"messages": ASK} if "chat" in path else {"prompt": "w1"}
    r = post(word_server, path, {**base, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# -- tools ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_server(smollm2):
    from lazy_rag.server import ServerSettings, create_app
    from tests.server.conftest import RunningServer

    s = RunningServer(create_app(smollm2, None, ServerSettings(model_name="smollm2", engine_process=False)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(smol_server):
    from openai import OpenAI

    return OpenAI(base_url=smol_server.base_url + "/v1", api_key="unused", max_retries=0)


def test_tool_call_round_trip_with_the_openai_client(smol_server, client, smollm2, no_server_errors):
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="required",
                                       max_tokens=40, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
    # streamed: the call's deltas (id and name first, then the arguments in pieces) add up to the same call
    parts, finish = [], None
    for chunk in client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=40,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                temperature=0, stream=True):
        for c in chunk.choices:
            parts.extend(c.delta.tool_calls or [])
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and parts[0].id and parts[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments
    assert len(parts) > 2  # the arguments came as they were generated, not in one piece
    # the tool's result goes back as a tool message; the answer reads it
    result = json.dumps({"temperature_c": 21, "sky": "clear"})
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": result}]
    r2 = client.chat.completions.create(model="smollm2", messages=follow, tools=[WEATHER], tool_choice="none",
                                        max_tokens=16, temperature=0)
    assert r2.choices[0].finish_reason in ("stop", "length") and not r2.choices[0].message.tool_calls
    # SmolLM2's template has no tool branch: the result is a user turn, the call the JSON the model wrote
    written = json.dumps({"name": "get_weather", "arguments": args}, separators=(",", ":"))
    turns = [("user", ASK[0]["content"]), ("assistant", written), ("user", TOOL_RESULT + result)]
    want = smollm2.generate([render_messages(smollm2.tokenizer, turns)], max_new_tokens=16, temperature=0).text
    assert r2.choices[0].message.content == want


def test_auto_lets_the_model_choose_and_says_which(smol_server, client, smollm2, no_server_errors):
    """The server's answer is in-process generation's under the same grammar, a call exactly when it
    starts with "{" (SmolLM2-135M answers these in text; the next test covers calls under auto)."""
    plan = plan_tools([WEATHER], "auto")
    for question in ("What is the weather in Paris?", "Say hello."):
        messages = [{"role": "user", "content": question}]
        r = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], max_tokens=40,
                                           temperature=0)
        prompt = render_messages(smollm2.tokenizer, [("system", plan.system_note), ("user", question)])
        want = smollm2.generate([prompt], max_new_tokens=40, temperature=0, output_format=plan.output_format).text
        m = r.choices[0].message
        if want.startswith("{"):
            assert r.choices[0].finish_reason == "tool_calls"
            assert json.loads(want) == {"name": m.tool_calls[0].function.name,
                                        "arguments": json.loads(m.tool_calls[0].function.arguments)}
        else:
            assert m.content == want and not m.tool_calls


@pytest.mark.parametrize("text,kind", [
    ('{"name":"get_weather","arguments":{"city":"Paris"}}', "call"),
    ('{"name":"get_weather","arguments":{"city":"Pa', "cut"),     # cut at max_tokens
    ('{"arguments":{"city":"Rome"},"name":"get_weather"}', "call"),  # another key order: known at the end
    ("It is sunny {maybe}.", "text"),
    (' {"name":"get_weather"} is not a call', "text"),  # auto's text may start with a space, then "{"
])
def test_answers_under_auto_become_content_or_one_streamed_call(text, kind):
    from lazy_rag.server.tools import ToolCallStream, whole_message

    plan = plan_tools([WEATHER], "auto")
    s = ToolCallStream(plan)
    deltas = [d for ch in text for d in s.feed(ch)] + s.finish()  # one character a piece
    whole = whole_message(plan, text)
    if kind == "text":
        assert not s.is_call and "".join(d["content"] for d in deltas) == text == whole["content"]
        return
    calls = [c for d in deltas for c in d["tool_calls"]]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    args = "".join(c["function"]["arguments"] for c in calls)
    assert whole["content"] is None and whole["tool_calls"][0]["function"]["arguments"] == args
    if kind == "cut":
        assert args == '{"city":"Pa' and len(calls) > 3  # streamed as generated, incomplete as generated
    else:
        assert json.loads(args) == json.loads(text)["arguments"]


def test_langchain_chat_openai_bind_tools_against_the_server(smol_server, no_server_errors):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=smol_server.base_url + "/v1", api_key="unused", model="smollm2", max_tokens=40,
                     temperature=0, max_retries=0)
    msg = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather" and "city" in msg.tool_calls[0]["args"]
