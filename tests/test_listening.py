"""The input buffer a listener keeps: dropping and taking audio by the session's sample clock."""

from __future__ import annotations

import numpy as np

from s2s_rt.listening.buffer import InputBuffer


def test_input_buffer_matches_a_plain_array_under_random_appends_drops_and_takes() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        buffer, ref, start = InputBuffer(), np.zeros(0, np.float32), 0
        for _ in range(30):
            op = rng.integers(3)
            if op == 0 or buffer.samples == 0:
                x = rng.random(int(rng.integers(1, 50))).astype(np.float32)
                buffer.append(x)
                ref = np.concatenate([ref, x])
            elif op == 1:
                sample = start + int(rng.integers(0, len(ref) + 5))
                buffer.drop_before(sample)
                cut = min(max(0, sample - start), len(ref))
                ref, start = ref[cut:], start + cut
            else:
                a = start + int(rng.integers(0, len(ref) + 1))
                e = a + int(rng.integers(0, len(ref) + 1))
                assert np.array_equal(buffer.take(a, e), ref[max(0, a - start) : max(0, e - start)])
                cut = max(0, min(e, start + len(ref)) - start)
                ref, start = ref[cut:], start + cut
            assert buffer.samples == len(ref) and buffer.start_sample == start
            assert np.array_equal(buffer.audio(), ref)


def test_dropping_old_audio_never_joins_the_chunks_it_keeps() -> None:
    buffer = InputBuffer()
    chunks = [np.full(100, i, np.float32) for i in range(5)]
    for c in chunks:
        buffer.append(c)
    buffer.drop_before(250)
    assert len(buffer.chunks) == 3 and np.shares_memory(buffer.chunks[0], chunks[2])
