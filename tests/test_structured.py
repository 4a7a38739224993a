"""Structured outputs: every answer matches its format (a JSON schema, any JSON object, a regex),
greedy or sampled, in every mode, whatever the weights (a tiny random model: the grammar alone
guarantees the shape); a format that cannot be enforced is refused before the request runs."""
import json
import re

import pytest

from lazy_rag import Chunk, LazyLLM, OutputFormat, build_rag_segments
from lazy_rag.errors import InvalidRequestError
from tiny_models import tiny_model

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "colour"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "colour": {"enum": ["red", "green"]}}}


@pytest.fixture(scope="module")
def llm(tokenizer):
    return LazyLLM(tiny_model("llama", seed=3), tokenizer, page_size=16)


@pytest.fixture(scope="module")
def segments(tokenizer):
    return build_rag_segments(tokenizer, "Describe it as JSON.", [Chunk("The tower is red and 38 metres tall.")])


@pytest.mark.parametrize("mode, temperature", [("lazy", 0.0), ("full", 0.0), ("lazy", 1.0)])
def test_json_schema_output_parses_and_follows_the_schema(llm, segments, mode, temperature):
    res = llm.generate(segments, max_new_tokens=40, mode=mode, temperature=temperature, seed=1,
                       output_format=OutputFormat.json(SCHEMA))
    obj = json.loads(res.text)
    assert res.finish_reason == "stop", res.text  # the grammar closed the object
    assert set(obj) == {"ok", "n", "colour"} and isinstance(obj["ok"], bool)
    assert isinstance(obj["n"], int) and 0 <= obj["n"] <= 99 and obj["colour"] in ("red", "green")


def test_json_object_and_regex_outputs(llm, segments):
    res = llm.generate(segments, max_new_tokens=60, output_format=OutputFormat.json())
    if res.finish_reason == "stop":
        assert isinstance(json.loads(res.text), dict)
    else:  # random weights may write one long string: cut at max_new_tokens, a JSON object's prefix
        assert res.text.startswith("{") and len(res.token_ids) == 60
    res = llm.generate(segments, max_new_tokens=10, output_format=OutputFormat("regex", r"[ab]{3}-[0-9]"))
    assert re.fullmatch(r"[ab]{3}-[0-9]", res.text) and res.finish_reason == "stop"


def test_streamed_pieces_join_to_the_constrained_text(llm, segments):
    stream = llm.generate(segments, max_new_tokens=40, stream=True, output_format=OutputFormat.json(SCHEMA))
    assert "".join(stream) == stream.result.text and json.loads(stream.result.text)


def test_formats_that_cannot_be_enforced_are_refused_up_front(llm, segments):
    with pytest.raises(InvalidRequestError, match="Unknown output format 'yaml'"):
        OutputFormat("yaml")
    with pytest.raises(InvalidRequestError, match="needs the schema as a JSON object"):
        OutputFormat.json("[1, 2]")
    with pytest.raises(InvalidRequestError, match="regex output format cannot be enforced"):
        llm.generate(segments, max_new_tokens=4, output_format=OutputFormat("regex", "(unclosed"))
    assert not llm.engine.handles  # nothing was queued


def test_langchain_structured_output_and_tool_calls(llm):
    """with_structured_output(PydanticModel) and bind_tools through ChatLazyRAG: the answer is a
    valid object / call whatever the weights; a tool's result goes back to the model as a turn."""
    from typing import Literal

    from langchain_core.messages import HumanMessage, ToolMessage
    from pydantic import BaseModel, Field

    from lazy_rag.integrations.langchain import ChatLazyRAG

    class Light(BaseModel):
        colour: Literal["red", "green"]
        flashes: int = Field(ge=0, le=9)

    def get_weather(unit: Literal["c", "f"]) -> str:
        """The weather in Oslo."""
        return "sunny"

    chat = ChatLazyRAG(llm=llm, max_tokens=40)
    light = chat.with_structured_output(Light).invoke("The light flashes green twice. Extract it.")
    assert isinstance(light, Light)
    reply = chat.bind_tools([get_weather], tool_choice="required").invoke("Weather in Oslo?")
    assert reply.response_metadata["finish_reason"] == "tool_calls" and reply.content == ""
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and call["args"]["unit"] in ("c", "f") and call["id"].startswith("call_")
    chunks = list(chat.bind_tools([get_weather], tool_choice="get_weather").stream("Weather?"))
    assert chunks[-1].tool_call_chunks[0]["name"] == "get_weather"
    # the round trip: the call and its result are turns of the next prompt; "auto" may answer in text
    history = [HumanMessage("Weather in Oslo?"), reply, ToolMessage("sunny", tool_call_id=call["id"])]
    final = chat.bind_tools([get_weather]).invoke(history)
    assert final.tool_calls or not final.content.lstrip().startswith("{")
    prompt = chat._prompt(history, "note")
    assert '"name": "get_weather"' in prompt and "sunny" in prompt


def test_tool_choice_naming_no_tool_is_refused():
    from lazy_rag.integrations.tool_calls import plan_tools

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(InvalidRequestError, match="tool_choice 'g' names no tool given \\(f\\)"):
        plan_tools([tool], "g")
    assert plan_tools([tool], "none") is None


def test_presence_and_frequency_penalties_follow_openai_definition(llm, segments):
    """Each greedy token is the argmax of the logits after the penalties over the tokens before it
    (the logits recomputed from the prompt and those tokens), and the options are range-checked."""
    import torch

    from lazy_rag.sampling import apply_penalties

    shifted = apply_penalties(torch.zeros(10), [5, 5, 7], presence=0.5, frequency=1.0)
    assert shifted[5] == -2.5 and shifted[7] == -1.5 and shifted[0] == 0
    out = llm.generate(segments, max_new_tokens=6, presence_penalty=1.5, frequency_penalty=2.0).token_ids
    plain = llm.generate(segments, max_new_tokens=6).token_ids
    assert len(set(out)) >= len(set(plain))
    for i, tok in enumerate(out):
        logits = llm.next_token_logits(segments + [list(out[:i])] if i else segments)
        assert int(apply_penalties(logits, list(out[:i]), 1.5, 2.0).argmax()) == tok
    with pytest.raises(InvalidRequestError, match="presence_penalty must be in \\[-2, 2\\]"):
        llm.generate(segments, max_new_tokens=2, presence_penalty=3)

