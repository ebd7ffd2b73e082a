"""Training kvlab's default model from text already installed on the machine.

The pipeline, one module per step: :mod:`~kvlab.train.haystacks` writes the held-out haystacks,
:mod:`~kvlab.train.corpus` gathers the training text (and records it), :mod:`~kvlab.train.tokenizer` trains the
byte-level BPE and tokenises the corpus, :mod:`~kvlab.train.mix` turns it into training sequences with retrieval
episodes mixed in, :mod:`~kvlab.train.model` fixes the architecture and exports the weights, :mod:`~kvlab.train.loop`
trains with checkpoints, :mod:`~kvlab.train.evaluate` measures the result and :mod:`~kvlab.train.card` writes the
model card. ``python -m kvlab.train --help`` lists the commands.
"""
