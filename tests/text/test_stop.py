"""StopMatcher: text is emitted as soon as it cannot be part of a stop string."""

from __future__ import annotations

import pytest

from strata.engine.text import StopMatcher


def run(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    out, stopped = [], False
    for piece in pieces:
        text, stopped = matcher.push(piece)
        out.append(text)
        if stopped:
            return out, True
    out.append(matcher.flush())
    return out, stopped


def test_no_stop_passes_everything_through():
    out, stopped = run(StopMatcher(["###"]), ["Hello", " wor", "ld"])
    assert out == ["Hello", " wor", "ld", ""] and not stopped


def test_stop_split_across_pushes_is_held_then_cut():
    matcher = StopMatcher(["</answer>"])
    assert matcher.push("The answer is 4</") == ("The answer is 4", False)
    assert matcher.push("ans") == ("", False)
    assert matcher.push("wer> trailing") == ("", True)
    assert matcher.matched == "</answer>"
    assert matcher.push("more") == ("", True) and matcher.flush() == ""


def test_false_start_is_released():
    matcher = StopMatcher(["STOP"])
    assert matcher.push("ST") == ("", False)
    assert matcher.push("ART") == ("START", False)
    assert matcher.push("S") == ("", False)
    assert matcher.flush() == "S"


def test_overlapping_prefixes():
    # "abab" overlaps itself: "xaba" holds "aba"; "cabab!" shows the real match starts later.
    matcher = StopMatcher(["abab"])
    assert matcher.push("xaba") == ("x", False)
    assert matcher.push("cabab!") == ("abac", True)
    matcher = StopMatcher(["aab"])
    assert matcher.push("aaaa") == ("aa", False)  # "aa" may still start "aab"
    assert matcher.push("b") == ("", True)


def test_earliest_of_several_stops_wins():
    matcher = StopMatcher(["world", "o w", "\n\n"])
    assert matcher.push("Hello world\n\n") == ("Hell", True)
    assert matcher.matched == "o w"
    matcher = StopMatcher(["\n\n", "User:"])
    out, stopped = run(matcher, ["A\n", "\nUser:"])
    assert "".join(out) == "A" and stopped and matcher.matched == "\n\n"


def test_stop_at_very_start_and_single_chars():
    assert StopMatcher(["<"]).push("<tag>") == ("", True)
    assert run(StopMatcher(["a"]), list("bbbab")) == (["b", "b", "b", ""], True)


def test_bad_stop_strings_are_refused():
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher([""])
    assert StopMatcher("END").stop_strings == ("END",)
    assert StopMatcher([]).push("anything") == ("anything", False)
