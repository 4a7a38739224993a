"""Small assertions shared by the tests."""
import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output"
    return float((out - ref).abs().max() / ref.abs().max())

