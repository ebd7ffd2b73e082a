"""Experiments about eviction beyond accuracy and memory: the side channel (can eviction be seen from outside?)."""
