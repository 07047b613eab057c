"""Argument types the benchmark scripts share."""

import argparse


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a block size, a count), else a usage error naming it."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
