"""A reward for runs of the tiny random model, which never writes a right answer: each
completion's checksum parity, so that groups differ (or, when all parities agree, do not)."""

import zlib


def parity(prompts, completions, **_):
  return [float(zlib.crc32(c.encode()) % 2) for c in completions]
