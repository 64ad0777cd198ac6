"""Long texts, and the check that an encoder cuts them fast to the ids the whole text
would keep (its first ids, up to max_length)."""

from __future__ import annotations

import random
import time

LONG_TEXT_PIECES = ["the", "quick", "brown", "fox", "jumped", "unjumped", "hello", "world",
                    "東京", "漢字", "中文测试你好世界", "ひらがな", "a" * 150, "x" * 60, "b" * 99,
                    "c" * 101, "??", ",", "https://example.org/a?b=c", "1234567890",
                    "nospacesatallbutlong", "base64+/=QUJD", "Ünïcödé", "😀"]


def kept_ids(enc, text: str) -> list[int]:
    """What `enc.tokenize` must give: the whole text's ids, cut to max_length."""
    tok = enc.tokenizer
    whole = tok.encode(text)
    return whole if len(whole) <= enc.max_length else whole[: enc.max_length - 1] + [tok.eos_id]


def assert_cut_fast_and_exact(enc, texts) -> None:
    """Each long text tokenizes in under a second to the ids its first 100,000
    characters give (the kept ids of the whole text)."""
    for text in texts:
        start = time.perf_counter()
        ids = enc.tokenize(text)
        assert time.perf_counter() - start < 1, text[:20]
        assert ids == kept_ids(enc, text[:100_000]), text[:20]


def random_long_texts(seed: int, n: int, pieces: list[str], max_pieces: int) -> list[str]:
    """Texts of random pieces: half joined at spaces and newlines, half with no
    whitespace at all (only hyphens and dots, or nothing), some then going on in words."""
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        seps = [" ", "", " ", "\n", "\t"] if i % 2 else ["", "", "-", "."]
        text = "".join(rng.choice(pieces) + rng.choice(seps)
                       for _ in range(rng.randint(1, max_pieces)))
        if rng.random() < 0.3:
            text += " then some words" * rng.randint(0, 300)
        texts.append(text)
    return texts
