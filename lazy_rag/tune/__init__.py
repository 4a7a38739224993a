"""``lazy-rag tune``: train a chunk wrapper (wrapper.py) by self-distillation, the model frozen.

The teacher is the model with full attention over the plain prompt; the student is the same
model reading the prompt's chunks encoded alone inside the wrapper (block attention, exactly
what ``lazy`` serves). The loss is KL(teacher || student) over the teacher's greedy answer
tokens and the token after them; no labels. ``examples`` builds the prompts (SQuAD train
articles, or an index's own chunks with questions the model writes), ``teacher`` computes and
caches the teacher's answers and top log-probs, ``student`` is the differentiable wrapped
forward, ``trainer`` the loop.
"""
from .examples import Example, index_examples, squad_examples
from .trainer import TuneOptions, train_wrapper

__all__ = ["Example", "TuneOptions", "index_examples", "squad_examples", "train_wrapper"]
