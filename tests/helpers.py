"""Small assertions shared by the tests."""
import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output"
    return float((out - ref).abs().max() / ref.abs().max())


class IdTokenizer:
    """Prompts of token ids only, for random models with a vocabulary no tokenizer matches."""

    bos_token_id = eos_token_id = unk_token_id = None
    all_special_tokens: list = []
    chat_template = None

    def get_vocab(self):
        return {}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))
