"""Direct tests of ``runtime.generate._StopScan``: the stop-string filter between the token stream and the text
the user sees.

Its contract, as ``stream_tokens`` relies on it:
* ``feed(piece)`` returns the text that can be shown now: everything so far except the longest tail that could
  still grow into a stop string (held back, never retracted);
* when the text so far contains a stop string, ``hit`` becomes True and the text is cut before the occurrence
  that starts first (among the stops completed by then); no part of a stop is ever returned;
* ``flush()`` returns what is held back (the generation ended without a stop), nothing after a hit;
* ``text`` is the whole visible text (the completion's text).
Strings are Python strings: a piece never splits a code point (``StreamDecoder`` sees to that upstream).
"""
from __future__ import annotations

import random

import pytest

from trapetum.runtime.generate import _StopScan


def _run(stops, pieces, flush=True):
    """(outputs per feed, flushed tail, scan) feeding ``pieces`` until a hit, as stream_tokens does."""
    scan = _StopScan(list(stops))
    outs = []
    for p in pieces:
        outs.append(scan.feed(p))
        if scan.hit:
            break
    tail = scan.flush() if flush else ""
    return outs, tail, scan


def _held(text: str, stops) -> int:
    """The longest tail of ``text`` that is a proper prefix of a stop (what may not be shown yet)."""
    return max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
               default=0)


def _reference(stops, pieces) -> tuple[str, bool]:
    """Brute force: after each piece, the earliest start of any stop in the whole text so far."""
    text = ""
    for p in pieces:
        text += p
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            return text[:min(found)], True
    return text, False


def test_no_stops_passes_everything_through():
    outs, tail, scan = _run([], ["Hello", ", ", "world"])
    assert outs == ["Hello", ", ", "world"] and tail == "" and not scan.hit and scan.text == "Hello, world"


def test_stop_inside_one_piece():
    outs, tail, scan = _run(["STOP"], ["Hello STOP world", "never fed"])
    assert outs == ["Hello "] and tail == "" and scan.hit and scan.text == "Hello "


def test_stop_split_across_pieces_is_held_then_dropped():
    outs, tail, scan = _run(["STOP"], ["Hel", "lo S", "TO", "P and more", "never fed"])
    assert outs == ["Hel", "lo ", "", ""]  # "S", then "STO" held back; nothing of the stop is shown
    assert scan.hit and scan.text == "Hello " and tail == ""


def test_a_held_prefix_that_does_not_become_a_stop_is_released():
    outs, tail, scan = _run(["STOP"], ["a ST", "ay", " here S"])
    assert outs == ["a ", "STay", " here "] and not scan.hit
    assert tail == "S" and scan.text == "a STay here S"  # flush gives the held tail at the end


def test_stop_at_the_very_start():
    outs, tail, scan = _run(["<|end|>"], ["<|", "end", "|>", "x"])
    assert outs == ["", "", ""] and scan.hit and scan.text == "" and tail == ""


def test_flush_after_a_hit_gives_nothing():
    scan = _StopScan(["END"])
    assert scan.feed("abc EN") == "abc "
    assert scan.feed("D tail") == "" and scan.hit
    assert scan.flush() == "" and scan.text == "abc "


def test_multiple_stops_earliest_occurrence_wins():
    # both stops are in the piece: the one that starts first cuts, whatever the list order
    for stops in (["world", "lo"], ["lo", "world"]):
        outs, _, scan = _run(stops, ["hello world"])
        assert outs == ["hel"] and scan.text == "hel"
    outs, _, scan = _run(["world", "lo"], ["hel", "lo wor", "ld"])
    assert "".join(outs) == "hel" and scan.hit
    outs, _, scan = _run(["\n\n", "User:"], ["Answer.", "\n", "User", ":"])
    assert outs == ["Answer.", "", "\n", ""] and scan.text == "Answer.\n"  # "\n" held until "User" rules out "\n\n"


def test_overlapping_stops():
    # "bc" completes before "abcd" (which starts earlier) is complete: the first stop completed cuts
    outs, _, scan = _run(["abcd", "bc"], ["a", "b", "c", "d"])
    assert "".join(outs) == "a" and scan.text == "a"
    # completed by the same piece: the earlier start cuts
    outs, _, scan = _run(["abcd", "bc"], ["abcd"])
    assert outs == [""] and scan.text == ""
    # a stop overlapping itself, and a held tail that shifts by one
    outs, _, scan = _run(["aab"], ["a", "a", "a", "b"])
    assert outs == ["", "", "a", ""] and scan.text == "a"
    outs, _, scan = _run(["abab"], ["ab", "ab", "ab"])
    assert "".join(outs) == "" and scan.hit
    # one stop a prefix of another: the shorter one completes first
    outs, _, scan = _run(["</s>", "</"], ["x<", "/s>"])
    assert "".join(outs) == "x" and scan.text == "x"


def test_unicode_stops():
    outs, _, scan = _run(["。"], ["日本", "語。", "続き"])
    assert outs == ["日本", "語"] and scan.text == "日本語"
    outs, _, scan = _run(["停止"], ["開始 停", "止 後"])
    assert outs == ["開始 ", ""] and scan.text == "開始 "
    outs, tail, scan = _run(["🛑 stop"], ["go 🛑", " st", "ay 🚀"])
    assert "".join(outs) + tail == "go 🛑 stay 🚀" and not scan.hit
    outs, _, scan = _run(["e\u0301!"], ["cafe", "\u0301", "!"])  # a combining accent inside the stop
    assert "".join(outs) == "caf" and scan.text == "caf"


@pytest.mark.parametrize("seed", range(40))
def test_random_texts_and_splits_match_a_brute_force_scan(seed):
    rng = random.Random(seed)
    alphabet = rng.choice(["ab", "abc", "aé🙂"])
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 20)))) if len(text) > 1 else []
    pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])] if text else []
    want, hit = _reference(stops, pieces)
    scan = _StopScan(list(stops))
    shown, so_far = "", ""
    for p in pieces:
        shown += scan.feed(p)
        so_far += p
        if scan.hit:
            break
        assert shown == so_far[:len(so_far) - _held(so_far, stops)], (stops, pieces)  # holds back the minimum
    shown += scan.flush()
    assert (shown, scan.hit) == (want, hit), (stops, pieces)
    assert scan.text == want and not any(s in shown for s in stops)
