"""argparse ``type=`` validators shared by the management commands (a
command module must not import another)."""

import argparse


def _whole_number(text, minimum, words):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be {words}, not {value}")
    return value


def positive_int(text):
    return _whole_number(text, 1, "at least 1")


def non_negative_int(text):
    return _whole_number(text, 0, "zero or more")
