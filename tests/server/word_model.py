"""A server-test model that answers in a few milliseconds: a word-level tokenizer of a few hundred
words (built in memory) and a tiny random llama over its vocabulary. SmolLM2's 49,152-row output
layer alone takes most of a tiny model's step on a CPU, which drowns what the timing tests
measure (whether a document's KV was encoded or found). Its 4,096 entries are the vocabulary of
``lazy_rag.random_models``' "tiny-llama" too, so every id such a model generates is a word
(an engine process loads that one from an ``EngineSpec``)."""
from __future__ import annotations

SPECIALS = ["<unk>", "<s>", "</s>"]
OTHERS = list("?:.,!") + ["Q", "Documents", "Answer", "user", "assistant", "system"]
VOCAB_SIZE = 4096
WORDS = [f"w{i}" for i in range(VOCAB_SIZE - len(SPECIALS) - len(OTHERS))]
VOCAB = SPECIALS + WORDS + OTHERS


def word_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.WordPiece()  # words joined with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant :{% endif %}")
    return tok


def word_llm(**engine_options):
    """A LazyLLM over the word tokenizer (hidden 128, 2 layers; greedy answers never end early)."""
    from tests.helpers import small_llm
    from tests.tiny_models import tiny_model

    model = tiny_model("llama", vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=512)
    llm = small_llm(model, word_tokenizer(), **engine_options)
    llm.eos_ids = set()
    return llm
