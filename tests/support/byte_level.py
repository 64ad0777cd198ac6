"""GPT-2's byte-level alphabet: the printable character that stands in for each byte."""

from __future__ import annotations


def gpt2_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode, written out independently of the package: bytes 0-255
    in order, the printable ones as themselves, the others as chr(256), chr(257), ..."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]
