"""Speculative decoding: proposers draft tokens, the target verifies them in the step's batch.

    proposer.py   the Proposer interface every drafting method implements
    ngram.py      prompt lookup: the continuation of the last earlier match of the newest n-gram
"""
