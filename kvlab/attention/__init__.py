"""kvlab's attention: the function transformers calls for every layer during a kvlab run, and its backends.

It reads each layer's slots from the heap (:mod:`kvlab.cache`), masks them by the tokens' original positions, and
observes what the run asked for (accumulated scores, statistics, remembered queries).
"""
