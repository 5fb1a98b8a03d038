"""The side-by-side race: the two replies of a comparison played back together, each at the pace it was decoded.

`compare` decodes vanilla, then EAGLE, each timed on its own, and records for each run a timeline: one point
[t, chars, tokens] per round, where t = the run's decoding time so far (the rounds' summed `Round.seconds`, as
in the figures' ``elapsed_s``), chars = the length of the reply text then and tokens = its new tokens then.
A reply only grows, so the text at each point is ``text[:chars]`` of the final one, and a round's tokens (an
EAGLE round's accepted draft tokens with the base's own) appear together.

`Race.frames` turns both timelines into what to show and when: frames at most `fps` per second of playback,
at run time t shown at playback time t / speed, each lane finishing at its own measured time; `pane_html`
renders one lane at one frame with `app.highlight.render` (sanitised markdown, accepted draft tokens
highlighted) and its running tokens/s. The page plays the frames from the server (`handlers.play_race`).
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import asdict, dataclass

from .highlight import render

SPEEDS = (0.5, 1.0, 2.0, 4.0)  # the page's choices of playback speed (run seconds per playback second)


@dataclass(frozen=True)
class LaneState:
    """One lane at one moment of the race."""

    chars: int  # the reply's first `chars` characters are shown
    tokens: int
    t: float  # run time of the last round shown (0 before the first)
    tokens_per_s: float | None  # tokens / t at the last round shown (the run's own figure once done)
    done: bool


@dataclass(frozen=True)
class Lane:
    """One finished run: its reply and when each part of it was produced."""

    text: str
    marks: list  # [start, end) character ranges drafted by EAGLE, by source (highlight.Reply.marks; vanilla: none)
    timeline: list  # [[t, chars, tokens]] per round, t and chars non-decreasing; last: [elapsed, len(text), new tokens]
    tokens_per_s: float  # the run's figure (new tokens / elapsed)

    @property
    def elapsed(self) -> float:
        return self.timeline[-1][0]

    @functools.cached_property
    def _times(self) -> list[float]:
        return [p[0] for p in self.timeline]

    def at(self, t: float) -> LaneState:
        """What the run had produced after `t` seconds of decoding."""
        i = bisect.bisect_right(self._times, t) - 1
        if i < 0:
            return LaneState(0, 0, 0.0, None, False)
        when, chars, tokens = self.timeline[i]
        done = i == len(self.timeline) - 1
        tps = self.tokens_per_s if done else (tokens / when if when > 0 else None)
        return LaneState(chars, tokens, when, tps, done)


@dataclass(frozen=True)
class Frame:
    at: float  # playback seconds from the start of the race
    vanilla: LaneState
    eagle: LaneState
    speedup: float | None  # the comparison's speedup, once both lanes have finished (None before)

    @property
    def finished(self) -> bool:
        return self.vanilla.done and self.eagle.done


@dataclass(frozen=True)
class Race:
    vanilla: Lane
    eagle: Lane
    summary: dict  # the comparison's `session.summary`: the final ratio is its speedup

    @classmethod
    def from_comparison(cls, c) -> "Race | None":
        """The race of a finished `session.Comparison`, or None when it did not finish (stopped, an error)."""
        panes = (c.vanilla, c.eagle)
        if not c.done or c.error or c.summary.get("stopped") or not all(p.timeline for p in panes):
            return None
        if any(p.figures.get("stop") in (None, "stopped", "error") for p in panes):
            return None
        lane = lambda p: Lane(p.text, [list(m) for m in p.marks], [list(x) for x in p.timeline],  # noqa: E731
                              p.figures.get("tokens_per_s") or 0.0)  # fmt: skip
        return cls(lane(c.vanilla), lane(c.eagle), dict(c.summary))

    def as_dict(self) -> dict:
        """Plain JSON-able data, for a session's state; `from_dict` gives the race back."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Race":
        return cls(Lane(**d["vanilla"]), Lane(**d["eagle"]), dict(d["summary"]))

    def frames(self, fps: float = 8.0, speed: float = 1.0) -> list[Frame]:
        """The frames of the race in time order: the start (both panes empty), then at playback ticks 1/fps
        apart and at each lane's finish (run time t at playback t / speed), a frame wherever something changed.
        The last frame has both replies whole and the comparison's speedup."""
        end = max(self.vanilla.elapsed, self.eagle.elapsed)
        ticks = int(end / speed * fps)
        times = sorted({*(k * speed / fps for k in range(ticks + 1)), self.vanilla.elapsed, self.eagle.elapsed})
        out: list[Frame] = []
        for t in times:
            v, e = self.vanilla.at(t), self.eagle.at(t)
            if out and (out[-1].vanilla, out[-1].eagle) == (v, e):
                continue
            both = v.done and e.done
            out.append(Frame(t / speed, v, e, self.summary.get("speedup") if both else None))
        return out


def pane_html(lane: Lane, s: LaneState) -> str:
    """A lane at one moment: the reply so far (rendered and sanitised, draft tokens highlighted), then its
    running counter."""
    marks = [[a, min(b, s.chars), *source] for a, b, *source in lane.marks if a < s.chars]  # a source kept
    tps = "–" if s.tokens_per_s is None else f"{s.tokens_per_s:.1f}"
    state = "finished" if s.done else ("racing…" if s.tokens else "")
    counter = (f'<div class="race-counter{" done" if s.done else ""}"><b>{tps}</b> tokens/s · {s.tokens} tokens · '
               f"{s.t:.2f} s" + (f" · {state}" if state else "") + "</div>")  # fmt: skip
    return render(lane.text[: s.chars], marks, True) + counter


def status_html(f: Frame, speed: float) -> str:
    """The line above the panes while the race plays: who has finished, and when."""
    pace = "their measured pace" if speed == 1 else f"{speed:g}× their measured pace"
    first = sorted((("EAGLE", f.eagle), ("vanilla", f.vanilla)), key=lambda lane: lane[1].t)  # who finished first
    done = [f"{name} finished in {s.t:.2f} s" for name, s in first if s.done]
    if f.finished:
        return f'<div class="race-status">🏁 {" · ".join(done)}</div>'
    return f'<div class="race-status">▶ Replaying both runs at {pace}' + "".join(f" · {d}" for d in done) + "</div>"


def parse_speed(value) -> float:
    """A playback speed from an untrusted value: a number in 0.1..10, else 1."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return 1.0
    return min(max(v, 0.1), 10.0) if v == v else 1.0
