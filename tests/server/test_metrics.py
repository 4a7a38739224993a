"""The engine's counters as Prometheus reads them: each tier's chunk count is the engine's own
(``KVPlanner.admit`` counts "chunk_hits" and "chunk_from_<tier>"), not a name it never writes."""
from prometheus_client import CollectorRegistry, generate_latest

from lazy_rag import Chunk, LazyLLM
from lazy_rag.server.metrics import EngineCollector
from tests.tiny_models import tiny_model


class EngineDriver:
    """What the collector asks of a server's driver, over an engine in this process."""

    def __init__(self, engine):
        self.engine, self.alive, self.in_flight = engine, True, 0

    def stats(self):
        return self.engine.stats()


def served(text: str) -> dict[str, float]:
    return {line.split('tier="')[1].split('"')[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("lazy_rag_chunks_served_total{")}


def test_chunks_served_count_each_tier(tokenizer, device):
    llm = LazyLLM(tiny_model("llama", "llama3", seed=2, hidden_size=128).to(device), tokenizer, page_size=16)
    registry = CollectorRegistry()
    registry.register(EngineCollector(EngineDriver(llm.engine)))
    segs = [[101, 102, 103], Chunk(list(range(200, 240)), chunk_id="a"), Chunk(list(range(300, 330)), chunk_id="b"),
            [104, 105]]
    llm.generate(segs, max_new_tokens=1, mode="lazy")   # no tier holds them: encoded
    llm.generate(segs, max_new_tokens=1, mode="lazy")   # resident: pool hits
    llm.engine.pm.evict_unreferenced()
    llm.generate(segs, max_new_tokens=1, mode="lazy")   # the host tier kept them
    assert served(generate_latest(registry).decode()) == {"pool": 2, "host": 2, "disk": 0, "encoded": 2,
                                                          "recomputed": 0}
