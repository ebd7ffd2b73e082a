"""Training kvlab's default model from text already installed on the machine.

The pipeline, one module per step: :mod:`~training.haystacks` writes the held-out haystacks,
:mod:`~training.corpus` gathers the training text (and records it), :mod:`~training.tokenizer` trains the
byte-level BPE and tokenises the corpus, :mod:`~training.mix` turns it into training sequences with retrieval
episodes mixed in, :mod:`~training.model` fixes the architecture and exports the weights, :mod:`~training.loop`
trains with checkpoints, :mod:`~training.evaluate` measures the result and :mod:`~training.card` writes the
model card. ``python -m training --help`` lists the commands.
"""
