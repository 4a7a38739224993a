"""A LlamaIndex VectorStoreIndex query engine with lazy-rag as the LLM (offline, CPU).

The nodes LlamaIndex retrieves are exactly lazy-rag's chunks (one ``LazyIndex`` chunk per node,
same ids), so their KV is computed once at indexing time. The query engine is unmodified: the LLM
finds the chunks' text in the engine's prompt and serves those spans from cache.

    python examples/llama_index_query_engine.py
"""
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is bundled: never touch the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from lazy_rag import LazyLLM  # noqa: E402
from lazy_rag.errors import MissingDependencyError  # noqa: E402

try:
    from lazy_rag.integrations.llama_index import (LazyRAGEmbedding, LazyRAGLLM, LazyRAGSynthesizer,
                                                   index_from_documents)
except MissingDependencyError as e:  # llama-index is an optional extra: one sentence, no traceback
    sys.exit(f"error: {e}")
from llama_index.core import Settings, SimpleDirectoryReader, VectorStoreIndex  # noqa: E402

CORPUS = Path(__file__).parent / "corpus"
MAX_NEW_TOKENS = int(os.environ.get("LAZY_RAG_MAX_NEW_TOKENS", "48"))


def cache_line(stats: dict) -> str:
    return (f"prompt {stats['prompt_tokens']} tokens: {stats['cached_tokens']} from cached chunk KV "
            f"({len(stats['chunk_ids'])} chunks, {stats['chunk_sources']}), {stats['computed_tokens']} computed")


def main() -> None:
    llm = LazyLLM.from_pretrained("smollm2")
    documents = SimpleDirectoryReader(str(CORPUS)).load_data()
    with tempfile.TemporaryDirectory() as tmp:
        # Split with LlamaIndex's SentenceSplitter in the model's tokens; precompute each node's KV.
        lazy_index, nodes = index_from_documents(documents, Path(tmp) / "index", llm, chunk_size=128,
                                                 chunk_overlap=16, progress=False)
        print(f"{len(nodes)} nodes indexed, KV precomputed for each")

        Settings.embed_model = LazyRAGEmbedding(embedder=lazy_index.embedder)  # bundled MiniLM, no OpenAI
        Settings.llm = LazyRAGLLM(index=lazy_index, max_new_tokens=MAX_NEW_TOKENS)
        vector_index = VectorStoreIndex(nodes)  # embeds the same nodes; retrieval returns them by id
        engine = vector_index.as_query_engine(similarity_top_k=2)

        for question in ["When does the bakery open?", "Who is the head baker?"]:
            response = engine.query(question)
            print(f"\nQ: {question}\nA: {str(response).strip()}")
            for n in response.source_nodes:
                print(f"   source: {Path(n.node.metadata['file_path']).name} node {n.node.node_id} "
                      f"(score {n.score:.2f})")
            print("   " + cache_line(Settings.llm.last_stats))

        # Opt-in exact path: the synthesizer passes node ids, the prompt is built from token ids.
        exact = vector_index.as_query_engine(
            similarity_top_k=2, response_synthesizer=LazyRAGSynthesizer(Settings.llm, streaming=True))
        question = "How far can the lighthouse be seen?"
        print(f"\nQ (exact path, streamed): {question}\nA: ", end="", flush=True)
        for piece in exact.query(question).response_gen:
            print(piece, end="", flush=True)
        print("\n   " + cache_line(Settings.llm.last_stats))


if __name__ == "__main__":
    main()
