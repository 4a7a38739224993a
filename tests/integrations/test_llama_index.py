"""LlamaIndex adapter with the bundled SmolLM2: transparent and exact KV reuse in query engines."""
import asyncio

import pytest
from llama_index.core import Settings, VectorStoreIndex
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import Document, TextNode

from lazy_rag.integrations.llama_index import (
    LazyRAGEmbedding,
    LazyRAGLLM,
    LazyRAGQueryEngine,
    LazyRAGRetriever,
    LazyRAGSynthesizer,
    index_from_documents,
)

QUESTIONS = ["When does the bakery open?", "How far can the lighthouse beam be seen?"]

NEW = 8  # tokens generated per call: enough to compare answers, short on 2 CPU cores


@pytest.fixture(scope="module")
def corpus(smollm2, tiny_docs, tmp_path_factory):
    docs = [Document(text=t, id_=name, metadata={"topic": name}) for name, t in tiny_docs.items()]
    lidx, nodes = index_from_documents(docs, tmp_path_factory.mktemp("li") / "index", smollm2, chunk_size=128,
                                       chunk_overlap=0, progress=False)
    assert len(nodes) == len(tiny_docs) and {n.node_id for n in nodes} == set(lidx.by_id)
    assert lidx.wrapper is not None  # what a user gets by default: SmolLM2's bundled chunk wrapper
    vs = VectorStoreIndex(nodes, embed_model=LazyRAGEmbedding(embedder=lidx.embedder))
    return lidx, nodes, vs


def chunk_tokens(lidx, ids):
    """The cached tokens of these chunks: their own and their wrapper's slots (stored with each)."""
    slots = lidx.wrapper.slots if lidx.wrapper else 0
    return sum(len(lidx.by_id[i].token_ids) + slots for i in ids)


def test_llm_metadata_and_settings(smollm2, corpus):
    lidx, _, _ = corpus
    llm = LazyRAGLLM(index=lidx, max_new_tokens=NEW)
    md = llm.metadata
    assert md.context_window == smollm2.context_window and md.num_output == NEW and md.model_name == "smollm2"
    saved = Settings._llm
    try:
        Settings.llm = llm  # accepted as a LlamaIndex LLM (no OpenAI default involved)
        assert Settings.llm is llm
    finally:
        Settings._llm = saved


def test_query_engine_second_question_computes_only_its_own_tokens(smollm2, corpus, capture_prompts,
                                                                     segments_by_hand):
    """An unmodified VectorStoreIndex query engine: chunk text found in its prompt is served from KV."""
    lidx, nodes, vs = corpus
    llm = LazyRAGLLM(index=lidx, max_new_tokens=NEW)
    prompts = capture_prompts(llm.runtime)
    engine = vs.as_query_engine(llm=llm, similarity_top_k=len(nodes))
    engine.query(QUESTIONS[0])
    response = engine.query(QUESTIONS[1])
    stats = llm.last_stats
    ids = [n.node.node_id for n in response.source_nodes]
    assert set(stats["chunk_ids"]) == set(ids) and stats["reuse"] == "span_match"
    assert stats["cached_tokens"] == chunk_tokens(lidx, ids)  # every chunk token came from cache
    assert stats["computed_tokens"] == stats["prompt_tokens"] - stats["cached_tokens"]
    assert stats["chunk_sources"] == {"pool": len(ids)}  # the first question loaded them
    # the same request through LazyLLM.generate in block mode, rebuilt by hand from the prompt
    prompt = prompts[-1]
    assert "file_path" not in prompt and "topic: " in prompt  # the engine's metadata headers are there
    segs = segments_by_hand(prompt, [(lidx.by_id[i].text, lidx.by_id[i].token_ids, i) for i in ids])
    ref = smollm2.generate(segs, max_new_tokens=NEW, mode="block", source=lidx.chunk_source)
    assert llm.runtime.last_result.token_ids == ref.token_ids
    assert str(response) == ref.text.strip() or str(response) == ref.text
    assert ref.stats.computed_tokens == stats["computed_tokens"]


class _AlterNode(BaseNodePostprocessor):
    """Changes one word of the bakery node's text before the engine formats the prompt."""

    def _postprocess_nodes(self, nodes, query_bundle=None):
        for n in nodes:
            if "Bakery" in n.node.text:
                n.node = TextNode(id_=n.node.node_id, text=n.node.text.replace("six", "seven"),
                                  metadata=n.node.metadata)
        return nodes


def test_altered_chunk_text_is_computed(smollm2, corpus, capture_prompts, segments_by_hand):
    lidx, nodes, vs = corpus
    llm = LazyRAGLLM(index=lidx, max_new_tokens=NEW)
    prompts = capture_prompts(llm.runtime)
    engine = vs.as_query_engine(llm=llm, similarity_top_k=len(nodes), node_postprocessors=[_AlterNode()])
    response = engine.query(QUESTIONS[0])
    altered = [n.node.node_id for n in response.source_nodes if "seven" in n.node.text]
    intact = [n.node.node_id for n in response.source_nodes if n.node.node_id not in altered]
    assert len(altered) == 1
    stats = llm.last_stats
    assert set(stats["chunk_ids"]) == set(intact)
    assert stats["cached_tokens"] == chunk_tokens(lidx, intact)
    segs = segments_by_hand(prompts[-1], [(lidx.by_id[i].text, lidx.by_id[i].token_ids, i) for i in intact])
    ref = smollm2.generate(segs, max_new_tokens=NEW, mode="block", source=lidx.chunk_source)
    assert llm.runtime.last_result.token_ids == ref.token_ids
    # a prompt none of whose chunk text survives is computed entirely
    text = lidx.records[0].text.replace(" ", "  ", 1)
    out = llm.complete(f"Context: {text}\nWhat is this about?", max_new_tokens=4)
    assert out.additional_kwargs["lazy_rag"]["cached_tokens"] == 0
    full = smollm2.generate([llm.completion_to_prompt(f"Context: {text}\nWhat is this about?")], max_new_tokens=4,
                            mode="block")
    assert llm.runtime.last_result.token_ids == full.token_ids


def test_exact_synthesizer_passes_node_ids(smollm2, corpus):
    """The opt-in path: node ids go to the runtime, segments are built from token ids."""
    lidx, nodes, vs = corpus
    llm = LazyRAGLLM(index=lidx, max_new_tokens=NEW)
    engine = vs.as_query_engine(llm=llm, similarity_top_k=len(nodes), response_synthesizer=LazyRAGSynthesizer(llm))
    engine.query(QUESTIONS[0])
    response = engine.query(QUESTIONS[1])
    ids = [n.node.node_id for n in response.source_nodes]
    stats = response.metadata["lazy_rag"]
    assert stats["reuse"] == "chunk_ids" and stats["chunk_ids"] == ids
    assert stats["cached_tokens"] == chunk_tokens(lidx, ids)
    assert stats["chunk_sources"] == {"pool": len(ids)}
    ref = smollm2.generate(lidx.segments(QUESTIONS[1], ids), max_new_tokens=NEW, mode="block", source=lidx.chunk_source)
    assert llm.runtime.last_result.token_ids == ref.token_ids and str(response) == ref.text
    assert stats["computed_tokens"] == ref.stats.computed_tokens

    # the query engine over the LazyIndex itself, streaming
    streaming = LazyRAGQueryEngine.from_index(lidx, similarity_top_k=2, streaming=True)
    sresp = streaming.query(QUESTIONS[0])
    text = "".join(sresp.response_gen)
    sids = [n.node.node_id for n in sresp.source_nodes]
    budget = streaming._response_synthesizer._llm.max_new_tokens  # from_index's LLM has the default budget
    ref = smollm2.generate(lidx.segments(QUESTIONS[0], sids), max_new_tokens=budget, mode="block",
                           source=lidx.chunk_source)
    assert text == ref.text
    assert streaming._response_synthesizer._llm.last_stats["cached_tokens"] == chunk_tokens(lidx, sids)


def test_chat_stream_and_async_do_not_block(smollm2, corpus):
    lidx, _, _ = corpus
    llm = LazyRAGLLM(index=lidx, max_new_tokens=4)
    text = lidx.records[1].text
    msgs = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content=f"{text}\nSummarize.")]
    reply = llm.chat(msgs)
    assert reply.message.additional_kwargs["lazy_rag"]["chunk_ids"] == [lidx.records[1].id]
    deltas = [r.delta for r in llm.stream_chat(msgs)]
    assert "".join(deltas) == reply.message.content

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        t = asyncio.create_task(ticker())
        done = await llm.acomplete(f"{text}\nSummarize.")
        pieces = [r.delta async for r in await llm.astream_chat(msgs)]
        chat = await llm.achat(msgs)
        t.cancel()
        return ticks, done, pieces, chat

    ticks, done, pieces, chat = asyncio.run(main())
    assert ticks > 5  # the event loop kept running while the model worked
    assert done.additional_kwargs["lazy_rag"]["cached_tokens"] == chunk_tokens(lidx, [lidx.records[1].id])
    assert "".join(pieces) == reply.message.content == chat.message.content


def test_retriever_over_lazy_index_and_registered_chunks(smollm2, corpus):
    lidx, _, _ = corpus
    hits = LazyRAGRetriever(lidx, similarity_top_k=2).retrieve(QUESTIONS[0])
    assert len(hits) == 2 and all(h.node.node_id in lidx.by_id for h in hits)
    assert hits[0].node.text == lidx.by_id[hits[0].node.node_id].text and "Bakery" in hits[0].node.text

    # no index: chunks registered with the LLM, KV encoded on first use and kept in its pool
    llm = LazyRAGLLM(llm=smollm2, max_new_tokens=2)
    note = "The ferry to Gull Island leaves the harbour every two hours from seven in the morning."
    [cid] = llm.register([note], ids=["ferry"])
    first = llm.complete(f"{note}\nWhen does the ferry leave?").additional_kwargs["lazy_rag"]
    second = llm.complete(f"Read this: {note}\nHow often?").additional_kwargs["lazy_rag"]
    wrapper = smollm2.default_source.wrapper  # registered text is encoded inside the model's bundled wrapper
    assert wrapper is not None
    n = len(smollm2.tokenizer(note, add_special_tokens=False).input_ids) + wrapper.slots
    assert cid == "ferry" and first["chunk_ids"] == second["chunk_ids"] == ["ferry"]
    assert second["cached_tokens"] == n and second["chunk_sources"] == {"pool": 1}


def test_llama_index_takes_max_tokens_and_refuses_misspelt_keywords(smollm2):
    from pydantic import ValidationError

    llm = LazyRAGLLM(llm=smollm2, max_tokens=2)
    assert llm.max_new_tokens == 2 and llm.metadata.num_output == 2
    assert llm.complete("Say hello.").additional_kwargs["lazy_rag"]["new_tokens"] <= 2
    with pytest.raises(ValidationError, match="max_tokns"):
        LazyRAGLLM(llm=smollm2, max_tokns=5)
