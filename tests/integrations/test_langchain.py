"""LangChain adapter with the bundled SmolLM2: transparent reuse in chains, the exact RAG runnable."""
import asyncio

import pytest
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableParallel, RunnablePassthrough

from lazy_rag import LazyIndex
from lazy_rag.integrations.langchain import ChatLazyRAG, LazyRAGChain, LazyRAGLLM, LazyRAGRetriever

QUESTIONS = ["When does the bakery open?", "How far can the lighthouse beam be seen?"]
NEW = 8


@pytest.fixture(scope="module")
def index(smollm2, tiny_docs, tmp_path_factory):
    # recovery none: these tests count the tokens served from cache (auto may recompute a risky answer's)
    index = LazyIndex.from_texts(list(tiny_docs.values()), tmp_path_factory.mktemp("lc") / "index", llm=smollm2,
                                 ids=list(tiny_docs), split=False, progress=False, recovery="none")
    assert index.wrapper is not None  # what a user gets by default: SmolLM2's bundled chunk wrapper
    return index


def chunk_tokens(index, ids):
    """The cached tokens of these chunks: their own and their wrapper's slots (stored with each)."""
    slots = index.wrapper.slots if index.wrapper else 0
    return sum(len(index.by_id[i].token_ids) + slots for i in ids)


def test_retriever_returns_documents_with_chunk_ids(index):
    docs = LazyRAGRetriever(index=index, top_k=2).invoke(QUESTIONS[0])
    assert [d.id for d in docs][0] == "bakery" and len(docs) == 2
    assert all(d.page_content == index.by_id[d.id].text and d.metadata["chunk_id"] == d.id for d in docs)


def test_chat_chain_second_question_computes_only_its_own_tokens(smollm2, index, capture_prompts,
                                                                   segments_by_hand):
    """retriever | format | ChatPromptTemplate | ChatLazyRAG: the model sees only a string."""
    chat = ChatLazyRAG(index=index, max_new_tokens=NEW)
    prompts = capture_prompts(chat.runtime)
    retriever = LazyRAGRetriever(index=index, top_k=3)
    prompt = ChatPromptTemplate.from_messages([("system", "Answer from the context."),
                                               ("human", "Context:\n{context}\n\nQuestion: {question}")])
    chain = ({"context": retriever | (lambda ds: "\n\n".join(d.page_content for d in ds)),
              "question": RunnablePassthrough()} | prompt | chat)
    chain.invoke(QUESTIONS[0])
    msg = chain.invoke(QUESTIONS[1])
    stats = msg.response_metadata["lazy_rag"]
    assert set(stats["chunk_ids"]) == set(index.by_id) and stats["reuse"] == "span_match"
    assert stats["cached_tokens"] == chunk_tokens(index, index.by_id)
    assert msg.usage_metadata["input_token_details"]["cache_read"] == stats["cached_tokens"]
    assert stats["computed_tokens"] == stats["prompt_tokens"] - stats["cached_tokens"]
    assert stats["chunk_sources"] == {"pool": 3}
    segs = segments_by_hand(prompts[-1], [(r.text, r.token_ids, r.id) for r in index.records])
    ref = smollm2.generate(segs, max_new_tokens=NEW, mode="block", source=index.chunk_source)
    assert chat.runtime.last_result.token_ids == ref.token_ids and msg.content == ref.text
    # streaming the same chain: the pieces add up to the same answer, stats on the last chunk
    chunks = list(chain.stream(QUESTIONS[1]))
    merged = sum(chunks[1:], chunks[0])
    assert merged.content == ref.text and len(chunks) > 2
    assert merged.response_metadata["lazy_rag"]["cached_tokens"] == stats["cached_tokens"]


def test_llm_kwargs_pass_through_batch_stream_async(smollm2, index, segments_by_hand):
    llm = LazyRAGLLM(index=index, max_new_tokens=4)
    rec = index.by_id["observatory"]
    prompt = f"Context: {rec.text}\nQuestion: What does the observatory house?\nAnswer:"
    text = llm.invoke(prompt, chunk_ids=["observatory"])
    assert llm.last_stats["chunk_ids"] == ["observatory"] and llm.last_stats["cached_tokens"] == chunk_tokens(index, ["observatory"])
    ref = smollm2.generate(segments_by_hand(prompt, [(rec.text, rec.token_ids, rec.id)]), max_new_tokens=4,
                           mode="block", source=index.chunk_source)
    assert text == ref.text
    llm.invoke(prompt, chunk_ids=["bakery"])  # restricted to a chunk that is not in the prompt
    assert llm.last_stats["cached_tokens"] == 0
    gen = llm.generate([prompt], max_new_tokens=2).generations[0][0]  # a generation option as a kwarg
    assert gen.generation_info["lazy_rag"]["new_tokens"] <= 2 and gen.generation_info["lazy_rag"]["chunk_ids"]
    assert llm.batch([prompt, prompt]) == [text, text]
    assert "".join(llm.stream(prompt)) == text
    assert asyncio.run(llm.ainvoke(prompt)) == text
    chat = ChatLazyRAG(index=index, max_new_tokens=4).bind(max_new_tokens=2)
    reply = asyncio.run(chat.ainvoke(f"{rec.text}\nSummarize."))
    assert reply.response_metadata["lazy_rag"]["new_tokens"] <= 2
    assert reply.response_metadata["lazy_rag"]["chunk_ids"] == ["observatory"]


def test_altered_chunk_text_is_computed(smollm2, index):
    chat = ChatLazyRAG(index=index, max_new_tokens=4)
    altered = index.by_id["bakery"].text.replace("six", "seven")
    msg = chat.invoke(f"Context:\n{altered}\n\n{index.by_id['lighthouse'].text}\n\nWhen does it open?")
    stats = msg.response_metadata["lazy_rag"]
    assert stats["chunk_ids"] == ["lighthouse"]
    assert stats["cached_tokens"] == chunk_tokens(index, ["lighthouse"])
    plain = ChatLazyRAG(index=index, max_new_tokens=4).invoke(f"Context:\n{altered}\nWhen does it open?")
    assert plain.response_metadata["lazy_rag"]["cached_tokens"] == 0


def test_rag_chain_exact_streaming_and_composition(smollm2, index):
    retriever = LazyRAGRetriever(index=index, top_k=3)
    rag = LazyRAGChain(index=index, max_new_tokens=NEW)
    pipeline = RunnableParallel(docs=retriever, question=RunnablePassthrough()) | rag
    pipeline.invoke(QUESTIONS[0])
    pieces = list(pipeline.stream(QUESTIONS[1]))
    assert "sources" in pieces[0] and sum("answer" in p for p in pieces) > 2  # token by token
    out = pieces[0]
    for p in pieces[1:]:
        out = out + p
    ids = [d.id for d in out["sources"]]
    ref = smollm2.generate(index.segments(QUESTIONS[1], ids), max_new_tokens=NEW, mode="block", source=index.chunk_source)
    assert out["answer"] == ref.text and rag.runtime.last_result.token_ids == ref.token_ids
    stats = out["stats"]
    assert stats["reuse"] == "chunk_ids" and stats["cached_tokens"] == chunk_tokens(index, ids)
    assert stats["computed_tokens"] == ref.stats.computed_tokens and stats["chunk_sources"] == {"pool": 3}
    # .assign and RunnableParallel over the runnable; a question string retrieves by itself
    assigned = LazyRAGChain(index=index, top_k=2, max_new_tokens=2).assign(n=lambda x: len(x["sources"]))
    both = RunnableParallel(rag=assigned, echo=RunnablePassthrough()).invoke(QUESTIONS[0])
    assert both["rag"]["n"] == 2 and both["echo"] == QUESTIONS[0] and both["rag"]["answer"]
    answers = asyncio.run(_collect(LazyRAGChain(index=index, max_new_tokens=NEW).pick("answer"), QUESTIONS[1]))
    assert "".join(a for a in answers if a) == ref.text  # top_k=4 retrieves all three, in the same order


async def _collect(runnable, inp):
    return [c async for c in runnable.astream(inp)]


def test_langchain_names_for_options_and_misspelt_keywords(smollm2, index):
    """ChatOpenAI's names work (max_tokens, model); a keyword that is no option is refused, not ignored."""
    from pydantic import ValidationError

    chat = ChatLazyRAG(index=index, max_tokens=3)
    assert chat.max_new_tokens == 3 and chat.model_name == smollm2.model_name
    reply = chat.invoke(f"Context:\n{index.by_id['bakery'].text}\nWhen does it open?")
    assert reply.usage_metadata["output_tokens"] <= 3 and reply.response_metadata["model_name"] == "smollm2"
    assert LazyRAGLLM(llm=smollm2, max_new_tokens=2).max_new_tokens == 2  # lazy-rag's own name too
    assert ChatLazyRAG(llm=smollm2, model="SmolLM2-135M-Instruct").model_name == "SmolLM2-135M-Instruct"
    with pytest.raises(ValidationError, match="max_tokns"):
        ChatLazyRAG(index=index, max_tokns=5)
    with pytest.raises(Exception, match="model='qwen2.5-0.5b', but the index given holds 'smollm2'"):
        ChatLazyRAG(index=index, model="qwen2.5-0.5b")
