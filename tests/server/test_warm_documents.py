"""`lazy-rag serve --warm-documents FILE`: the engine encodes the file's documents when it is
loaded, so the first request naming them reads their KV from its memory tiers (none is encoded);
the file is read as a request body's ``documents`` is, and a bad file is refused naming it."""
import asyncio
import json

import pytest
from typer.testing import CliRunner

from lazy_rag.bench.http_load import run_http
from lazy_rag.cli import app
from lazy_rag.engine import EngineConfig
from lazy_rag.errors import LazyRagError
from lazy_rag.server import EngineSpec
from lazy_rag.server.warm import read_warm_documents

WARM = ["Ledger: the ferry to Port Sallow is painted green.",
        {"title": "Marrow Point", "text": "The lighthouse was completed in 1871."}]


def test_the_file_is_read_as_request_documents_are(tmp_path):
    as_list = tmp_path / "docs.json"
    as_list.write_text(json.dumps(WARM))
    as_lines = tmp_path / "docs.jsonl"
    as_lines.write_text("\n".join(json.dumps(d) for d in WARM) + "\n\n")
    want = (WARM[0], "Marrow Point\nThe lighthouse was completed in 1871.")  # Document.chunk_text
    assert read_warm_documents(as_list) == want
    assert read_warm_documents(as_lines) == want


@pytest.mark.parametrize("content, says", [
    ("[]", "holds no documents"),
    ('["ok"]\n{"text": ', "line 2: not JSON"),
    ('[{"title": "no text"}]', r"documents\[0\] must be a non-empty string"),
])
def test_a_bad_file_is_refused_naming_it(tmp_path, content, says):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(LazyRagError, match=says) as e:
        read_warm_documents(bad)
    assert str(bad) in str(e.value)
    with pytest.raises(LazyRagError, match="Cannot read the warm documents file"):
        read_warm_documents(tmp_path / "missing.json")


def test_serve_refuses_a_missing_file_before_loading_anything(tmp_path):
    result = CliRunner().invoke(app, ["serve", "--warm-documents", str(tmp_path / "missing.json")])
    assert result.exit_code != 0
    assert "Cannot read the warm documents file" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "in-process"])
def test_warmed_documents_are_served_from_cache_on_first_use(start_server, tmp_path, engine_process):
    path = tmp_path / "warm.json"
    path.write_text(json.dumps(WARM))
    spec = EngineSpec(model="smollm2", device="cpu", warm_documents=read_warm_documents(path),
                      engine_config=EngineConfig(kv_bytes=64 << 20))
    server = start_server(spec, engine_process=engine_process)
    warmed = [{"documents": WARM, "question": "When was the lighthouse completed?"}]
    rec, answers = asyncio.run(run_http(server.base_url, warmed, clients=1, max_tokens=2, model="smollm2"))
    assert rec["errors"] == 0 and answers[0]
    assert rec["chunks_by_tier"] == '{"pool": 2}'  # both read from the pool, none encoded
    cold = [{"documents": ["A document nobody warmed: the bell rings at noon."], "question": "When?"}]
    rec, _ = asyncio.run(run_http(server.base_url, cold, clients=1, max_tokens=2, model="smollm2"))
    assert rec["chunks_by_tier"] == '{"encoded": 1}'  # the same route encodes what was not warmed


def test_serve_run_arguments_take_the_file_too(tmp_path):
    from lazy_rag.server.ray_app import app_builder

    with pytest.raises(LazyRagError, match="Cannot read the warm documents file"):
        app_builder({"model": "smollm2", "device": "cpu", "warm_documents": str(tmp_path / "missing.json")})
