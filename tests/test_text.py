"""qgather.model.text.clip: a reason cut at a word with "...", never mid-word."""

from qgather.model.text import clip


def test_clip_cuts_at_a_word_with_an_ellipsis():
    reason = ("rank 0 raised RuntimeError: The size of tensor a (64) must match the size of tensor b (128) "
              "at non-singleton")
    clipped = clip(reason, 100)
    assert clipped == ("rank 0 raised RuntimeError: The size of tensor a (64) must match the size of tensor b "
                       "(128) at...")
    assert len(clipped) <= 100 and reason.startswith(clipped[:-3])


def test_clip_keeps_short_lines_and_takes_the_first_line():
    assert clip("short\nsecond line", 100) == "short"
    assert clip("", 10) == ""
    assert clip("x" * 50, 10) == "xxxxxxx..."  # one word longer than the width
