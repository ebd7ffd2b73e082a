"""Evaluation tasks on long contexts: facts to hide in a text and needle prompts that ask for them back.

:mod:`kvlab.tasks.facts` says what a fact looks like (templates, keys and values of several shapes, which templates
are for training and which are held out); :mod:`kvlab.tasks.needle` builds the prompt of an exact length around a
haystack and scores an answer. The training mix of the shipped model and kvlab's evaluations share both modules, so
what the model was taught and what it is tested on are the same format by construction.
"""
