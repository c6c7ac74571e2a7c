"""Numbers and clock times said in words, written in digits, for a function's arguments.

The other way round from :mod:`s2s_rt.speech_text`: a user who says "wake
me at a quarter to six" or types "change one thousand Swedish kronor" gives
the model words where a function wants ``05:45`` and ``1000``, and the
default model (Qwen2.5-Coder-0.5B) gets them wrong more often than right
("a quarter to six" → ``14:00``, "nine in the evening" → ``17:00``, "one
thousand kronor" → ``100000``: 7 of 32 requests in the function-calling
evaluation). With functions offered, the user's words are shown to it with
those written in digits (:func:`written`): a time with a marker of the day
("in the evening", "pm") on a 24-hour clock, one without as said ("5:30"
for "half past five"), amounts as numbers, a day of a month as "June 20", digits said one by one (three
or more: "BA one one seven" → "BA 117") as one number. English only; other
words pass unchanged.
"""

from __future__ import annotations

import re

_UNITS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
    " seventeen eighteen nineteen"
).split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = {"hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9}
_VALUES = {word: n for n, word in enumerate(_UNITS)} | {word: 20 + 10 * n for n, word in enumerate(_TENS)}

#: One number in words: "twenty-five", "one thousand two hundred and fifty", "eighteen point five".
_WORD = "|".join(sorted([*_VALUES, *_SCALES], key=len, reverse=True))
_NUMBER = re.compile(
    rf"\b(?:{_WORD})(?:(?:[\s-]+|\s+and\s+)(?:{_WORD}))*(?:\s+point(?:\s+(?:{'|'.join(_UNITS[:10])}))+)?\b",
    re.IGNORECASE,
)
_HOUR = r"(?:one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|\d{1,2})"
_MINUTES = rf"(?:(?:oh[\s-]+)?(?:{'|'.join(_UNITS[1:10])})|{'|'.join(_UNITS[10:])}|(?:{'|'.join(_TENS[:4])})(?:[\s-]+(?:{'|'.join(_UNITS[1:10])}))?)"  # noqa: E501
_MORNING = r"(?:in\s+the|this)\s+morning|a\.?m\.?"
_LATER = r"(?:in\s+the|this)\s+(?:afternoon|evening)|at\s+night|tonight|p\.?m\.?"
_MARKER = rf"(?:\s*(?P<morning>{_MORNING})|\s*(?P<later>{_LATER}))?"
#: Clock times, the hour and minutes named: "a quarter to six", "ten past seven", "half past five".
_RELATIVE = re.compile(
    rf"\b(?:(?P<quarter>a\s+quarter|quarter)|(?P<half>half)|(?P<minutes>{_MINUTES})(?:\s+minutes?)?)\s+"
    rf"(?P<way>past|after|to|before)\s+(?P<hour>{_HOUR})(?:\s+o'?clock)?\b{_MARKER}",
    re.IGNORECASE,
)
#: "six thirty", "four fifteen", "seven o'clock", "nine in the evening", "6 pm", after a word that leads to a time.
_PLAIN = re.compile(
    rf"\b(?P<lead>at|for|by|until|till|around|about|from)\s+(?P<hour>{_HOUR})"
    rf"(?:(?:\s+|:)(?P<minutes>{_MINUTES}|\d{{2}}))?(?P<oclock>\s+o'?clock)?\b{_MARKER}",
    re.IGNORECASE,
)
_ORDINALS = (
    "first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth fourteenth"
    " fifteenth sixteenth seventeenth eighteenth nineteenth"
).split()
_DAYS = {word: n + 1 for n, word in enumerate(_ORDINALS)} | {"twentieth": 20, "thirtieth": 30}
_DAYS |= {f"twenty{sep}{word}": 20 + n + 1 for n, word in enumerate(_ORDINALS[:9]) for sep in ("-", " ")}
_DAYS |= {f"thirty{sep}first": 31 for sep in ("-", " ")}
_MONTH = "january|february|march|april|may|june|july|august|september|october|november|december"
_DAY = "|".join(sorted(_DAYS, key=len, reverse=True))
#: A day of a month said as an ordinal: "the twentieth of June", "June the twenty-fifth", "on July third".
_DATE = re.compile(
    rf"\b(?:(?:the\s+)?(?P<day>{_DAY})\s+of\s+(?P<month>{_MONTH})|(?P<month2>{_MONTH})\s+(?:the\s+)?(?P<day2>{_DAY}))\b",
    re.IGNORECASE,
)
_DIGIT = "zero|oh|one|two|three|four|five|six|seven|eight|nine"
#: Digits said one by one, three or more: a flight, an order or a phone number ("BA one one seven", "six oh five").
_DIGITS = re.compile(rf"\b(?!oh\b)(?:{_DIGIT})(?:[\s-]+(?:{_DIGIT})){{2,}}\b", re.IGNORECASE)
_NOON = re.compile(r"\b(?P<lead>at|for|by|until|till|around|about|from)\s+(?P<word>noon|midday|midnight)\b", re.I)


def written(text: str) -> str:
    """``text`` with clock times and numbers said in words written in digits."""
    text = _RELATIVE.sub(_relative, text)
    text = _PLAIN.sub(_plain, text)
    text = _NOON.sub(lambda m: f"{m['lead']} {'00:00' if m['word'].lower() == 'midnight' else '12:00'}", text)
    text = _DATE.sub(_date, text)
    text = _DIGITS.sub(_digits, text)
    return _NUMBER.sub(_number, text)


def number(words: str) -> int | float | None:
    """The value of a number in words ("one thousand two hundred and five" → 1205); None if it is not one."""
    whole, _, fraction = re.sub(r"[\s-]+", " ", words.lower()).partition(" point ")
    total = current = 0
    for word in whole.split():
        if word == "and":
            continue
        if word in _VALUES:
            if current % 100 and (current % 10 or _VALUES[word] >= 10):
                return None  # "two twenty", "twenty thirty": two numbers, not one
            current += _VALUES[word]
        elif word == "hundred":
            current = max(current, 1) * 100
        elif word in _SCALES:
            total, current = total + max(current, 1) * _SCALES[word], 0
        else:
            return None
    value = total + current
    if not fraction:
        return value
    digits = [_VALUES.get(word) for word in fraction.split()]
    if any(d is None or d > 9 for d in digits):
        return None
    return float(f"{value}.{''.join(map(str, digits))}")


def _number(m: re.Match[str]) -> str:
    said = m.group()
    if said.lower() in ("one", "zero"):  # "one of them", "zero in on": words, not amounts
        return said
    if said[0].isupper() and m.string[: m.start()].rstrip()[-1:] not in ("", ".", "!", "?", ":"):
        return said  # capitalised inside a sentence: a name ("The Four Seasons", "Ocean's Eleven")
    value = number(said)
    return said if value is None else str(value)


def _date(m: re.Match[str]) -> str:
    month, day = (m["month"] or m["month2"]), _DAYS[re.sub(r"\s+", " ", (m["day"] or m["day2"]).lower())]
    return f"{month.capitalize()} {day}"


def _digits(m: re.Match[str]) -> str:
    before = m.string[: m.start()].split()
    if before and before[-1].lower().rstrip("-") in _TENS:
        return m.group()  # "twenty one two three": not digits one by one
    said = m.group().lower().replace("-", " ").split()
    return "".join("0" if word == "oh" else str(_VALUES[word]) for word in said)


def _whole(said: str) -> int:
    """A whole number in digits or words ("7", "seven"); 0 if it is not one."""
    value = int(said) if said.isdigit() else number(said)
    return int(value or 0)


def _minutes(said: str) -> int:
    """Minutes as said after an hour: "15", "fifteen", "oh five"."""
    return _whole(re.sub(r"\boh\b", "", said).strip())


def _clock(hour: int, minutes: int, m: re.Match[str]) -> str:
    if m["later"] and hour < 12:
        hour += 12
    elif m["morning"] and hour == 12:
        hour = 0
    if m["later"] or m["morning"]:
        return f"{hour:02d}:{minutes:02d}"
    return f"{hour}:{minutes:02d}"


def _relative(m: re.Match[str]) -> str:
    hour = _whole(m["hour"])
    minutes = 15 if m["quarter"] else 30 if m["half"] else _minutes(m["minutes"])
    if hour > 12 or minutes >= 60:
        return m.group()
    if m["way"].lower() in ("to", "before"):
        hour, minutes = (hour - 1) % 12 or 12, 60 - minutes
    return _clock(hour, minutes, m)


def _plain(m: re.Match[str]) -> str:
    said = m["minutes"]
    if said is None and not (m["oclock"] or m["morning"] or m["later"]):
        return m.group()  # "for two", "at five": a number, not a time
    hour = _whole(m["hour"])
    minutes = 0 if said is None else _minutes(said)
    if hour > 24 or minutes >= 60:
        return m.group()
    return f"{m['lead']} {_clock(hour, minutes, m)}"
