"""The embedder (plain transformers) against sentence-transformers, the independent reference: the
same vectors, to 1e-5, on texts where the pooling, the truncation and the padding matter, for the
bundled all-MiniLM-L6-v2, a CLS-pooled variant and a plain transformers folder; and the folder
configs it refuses, each named in the error."""
import json
from pathlib import Path

import numpy as np
import pytest

from lazy_rag.embedder import DEFAULT_EMBEDDER, Embedder, model_folder
from lazy_rag.errors import EmbedderError

SentenceTransformer = pytest.importorskip("sentence_transformers").SentenceTransformer

LONG = " ".join(f"The lighthouse keeper logged ship number {i} passing the point at dawn." for i in range(60))
TEXTS = ["", "lighthouse", "In what year was the Marrow Point Lighthouse completed?", LONG,
         "Café crème, naïve façade — Übergrößenträger; 東京の灯台は1871年に完成した。 🙂",
         "   spaces around   ", "short again"]
# the files of a plain transformers model (no sentence-transformers configs)
HF_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "vocab.txt")


@pytest.fixture(scope="module")
def bundled():
    return model_folder(DEFAULT_EMBEDDER)


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


def linked_folder(src: Path, dst: Path, names) -> Path:
    """``dst`` with links to ``src``'s files ``names`` (no copy of the weights)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        (dst / name).symlink_to(src / name)
    return dst


def assert_same_vectors(ours: Embedder, folder: Path, texts=TEXTS):
    reference = SentenceTransformer(str(folder), device="cpu").encode(texts, normalize_embeddings=True,
                                                                        convert_to_numpy=True)
    got = ours.encode(texts, batch_size=2)  # batches of unequal lengths: the sort and the padding matter
    assert got.dtype == np.float32 and got.flags.c_contiguous and got.shape == (len(texts), ours.dim)
    assert np.abs(got - reference).max() < 1e-5
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    return got


def test_the_bundled_embedder_matches_sentence_transformers(embedder, bundled):
    assert embedder.dim == 384 and embedder.device == "cpu" and embedder.pooling == "mean"
    assert embedder.max_length == 256  # sentence_bert_config.json, not the tokenizer's 512
    assert len(embedder.tokenizer(LONG)["input_ids"]) > 300  # so truncation decides its vector
    got = assert_same_vectors(embedder, bundled)
    # one call's order is the texts' order, whatever the batching
    np.testing.assert_allclose(np.concatenate([embedder.encode([t]) for t in TEXTS]), got, atol=1e-5)
    assert embedder.encode([]).shape == (0, 384)


def test_the_token_count_is_what_the_model_reads(embedder):
    assert embedder.count_tokens(["lighthouse"]) == 3  # [CLS] lighthouse [SEP]
    assert embedder.count_tokens([LONG, ""]) == 256 + 2


def test_progress_is_one_line_on_stderr(embedder, capsys):
    embedder.encode(["a", "b", "c"], batch_size=2, progress=True)
    assert capsys.readouterr().err == "\rembedded 2/3 texts\rembedded 3/3 texts\n"


def test_a_cls_pooled_folder_matches_sentence_transformers(bundled, tmp_path):
    folder = linked_folder(bundled, tmp_path / "cls", HF_FILES + ("modules.json", "sentence_bert_config.json"))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 384, "pooling_mode": "cls"}))
    ours = Embedder(str(folder))
    assert ours.pooling == "cls"
    assert_same_vectors(ours, folder)


def test_a_plain_transformers_folder_is_mean_pooled_at_the_models_length(bundled, tmp_path):
    folder = linked_folder(bundled, tmp_path / "plain", HF_FILES)
    ours = Embedder(str(folder))
    assert (ours.pooling, ours.max_length) == ("mean", 512)
    assert_same_vectors(ours, folder, TEXTS + [LONG + LONG])  # over 512 tokens


@pytest.mark.parametrize("pooling", [{"pooling_mode": "max"}, {"pooling_mode": ["mean", "cls"]},
                                     {"pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True},
                                     {"pooling_mode_mean_tokens": False}])
def test_a_pooling_it_does_not_compute_is_refused_naming_the_file(tmp_path, pooling):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    with pytest.raises(EmbedderError, match=r"1_Pooling/config.json asks for the pooling"):
        Embedder(str(tmp_path))


def test_a_module_it_does_not_compute_is_refused_naming_the_file(tmp_path):
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(EmbedderError, match=r"modules.json lists the modules .*Dense"):
        Embedder(str(tmp_path))


def test_a_name_that_is_no_folder_is_refused(tmp_path):
    with pytest.raises(EmbedderError, match="neither a bundled one"):
        Embedder(str(tmp_path / "missing"))
