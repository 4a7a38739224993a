"""A LangChain retriever | runnable chain over a lazy-rag index, streaming the answer (offline, CPU).

    python examples/langchain_chain.py
"""
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is bundled: never touch the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from lazy_rag import LazyIndex, LazyLLM  # noqa: E402
from lazy_rag.errors import MissingDependencyError  # noqa: E402

try:
    from lazy_rag.integrations.langchain import ChatLazyRAG, LazyRAGChain, LazyRAGRetriever
except MissingDependencyError as e:  # langchain is an optional extra: one sentence, no traceback
    sys.exit(f"error: {e}")
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import RunnableParallel, RunnablePassthrough  # noqa: E402

CORPUS = Path(__file__).parent / "corpus"
MAX_NEW_TOKENS = int(os.environ.get("LAZY_RAG_MAX_NEW_TOKENS", "48"))


def main() -> None:
    llm = LazyLLM.from_pretrained("smollm2")
    with tempfile.TemporaryDirectory() as tmp:
        index, _ = LazyIndex.build([CORPUS], Path(tmp) / "index", llm=llm, chunk_size=128, progress=False)
        retriever = LazyRAGRetriever(index=index, top_k=2)

        # 1. retriever | runnable: documents keep their chunk ids, the prompt is built from token ids.
        chain = RunnableParallel(docs=retriever, question=RunnablePassthrough()) | LazyRAGChain(
            index=index, max_new_tokens=MAX_NEW_TOKENS)
        for question in ["When does the bakery open?", "What telescope does the observatory have?"]:
            print(f"Q: {question}\nA: ", end="", flush=True)
            for part in chain.stream(question):
                if part.get("answer"):
                    print(part["answer"], end="", flush=True)
                if "sources" in part:
                    sources = part["sources"]
                if "stats" in part:
                    stats = part["stats"]
            print()
            for d in sources:
                print(f"   source: {Path(d.metadata['source']).name} chunk {d.id} (score {d.metadata['score']:.2f})")
            print(f"   prompt {stats['prompt_tokens']} tokens: {stats['cached_tokens']} from cached chunk KV, "
                  f"{stats['computed_tokens']} computed\n")

        # 2. A classic string-prompt chain: the chat model finds the chunks' text in its prompt.
        prompt = ChatPromptTemplate.from_messages([
            ("system", "Answer from the context in one sentence."),
            ("human", "Context:\n{context}\n\nQuestion: {question}"),
        ])
        model = ChatLazyRAG(index=index, max_new_tokens=MAX_NEW_TOKENS)
        classic = ({"context": retriever | (lambda docs: "\n\n".join(d.page_content for d in docs)),
                    "question": RunnablePassthrough()} | prompt | model)
        reply = classic.invoke("Who is the head baker?")
        stats = reply.response_metadata["lazy_rag"]
        print(f"Q: Who is the head baker? (prompt | ChatLazyRAG)\nA: {reply.content.strip()}")
        print(f"   prompt {stats['prompt_tokens']} tokens: {stats['cached_tokens']} from cached chunk KV "
              f"(found in the prompt text), {stats['computed_tokens']} computed")


if __name__ == "__main__":
    main()
