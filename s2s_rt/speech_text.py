"""Text as a voice should say it: no markdown, and numbers, units and symbols in words.

An LLM writes for the eye: ``**Canberra**``, ``- item``, ``100°F``, ``3:40 pm``,
``2025-06-12``, ``$12.50``, ``5 km/h``. Read aloud as written, a voice says
"asterisk asterisk", "hash", "degrees F", "two thousand twenty five dash
zero six dash twelve". :func:`speakable` rewrites such text before
synthesis. Markdown is removed in every language; numbers, units and
symbols are spelled out in English only (espeak-ng reads digits in the
other languages itself).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen"
).split()
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_SCALES = ((10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (10**3, "thousand"))
_ORDINAL_WORDS = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
                  "nine": "ninth", "twelve": "twelfth"}  # fmt: skip
_MONTHS = ("January February March April May June July August September October November December").split()


def cardinal(n: int) -> str:
    """``n`` in words: 3600 -> "three thousand six hundred", -5 -> "minus five".

    Numbers of 10^15 and more are read digit by digit.
    """
    if n < 0:
        return "minus " + cardinal(-n)
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")
    if n < 1000:
        hundreds, rest = divmod(n, 100)
        return f"{_ONES[hundreds]} hundred" + (f" {cardinal(rest)}" if rest else "")
    if n >= 10**15:
        return " ".join(_ONES[int(d)] for d in str(n))
    for value, name in _SCALES:
        if n >= value:
            high, rest = divmod(n, value)
            return f"{cardinal(high)} {name}" + (f" {cardinal(rest)}" if rest else "")
    raise AssertionError("unreachable")


def ordinal(n: int) -> str:
    """``n`` as an ordinal in words: 12 -> "twelfth", 21 -> "twenty-first"."""
    words = cardinal(n)
    head, sep, last = words.rpartition("-" if "-" in words.rsplit(" ", 1)[-1] else " ")
    if last in _ORDINAL_WORDS:
        last = _ORDINAL_WORDS[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return head + sep + last


def year(n: int) -> str:
    """A year as people say it: 1879 -> "eighteen seventy-nine", 2005 -> "two thousand five"."""
    if not 1000 <= n <= 2099 or 2000 <= n <= 2009 or n % 1000 == 0:
        return cardinal(n)
    high, low = divmod(n, 100)
    if low == 0:
        return f"{cardinal(high)} hundred"
    return f"{cardinal(high)} {'oh ' + cardinal(low) if low < 10 else cardinal(low)}"


def decimal(text: str) -> str:
    """A number as written (``1,234.5``, ``-0.25``) in words."""
    text = text.replace(",", "")
    sign = ""
    if text.startswith(("-", "−")):
        sign, text = "minus ", text[1:]
    whole, _, fraction = text.partition(".")
    words = cardinal(int(whole or "0"))
    if fraction:
        words += " point " + " ".join(_ONES[int(d)] for d in fraction)
    return sign + words


# --- markdown ------------------------------------------------------------------------------

_FENCE = re.compile(r"```[^\n]*\n.*?(```|$)", re.DOTALL)
#: Headings, quotes and bullets. A numbered item keeps its number: "one. Mix the flour" is how people read
#: steps aloud, and a number that starts an answer ("42. That is all.") may be the answer.
_MARKDOWN_LINE = re.compile(r"^[ \t]{0,3}(?:#{1,6}\s+|>\s*|[-*+•]\s+)", re.MULTILINE)
_TABLE_RULE = re.compile(r"^[ \t]*\|?[ \t]*:?-{3,}.*$", re.MULTILINE)
_EMPHASIS = re.compile(r"(\*\*|__)(.+?)\1|(?<![\w*])\*(?!\s)(.+?)(?<!\s)\*(?![\w*])|(?<!\w)_(?!\s)(.+?)(?<!\s)_(?!\w)")
_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_URL = re.compile(r"\bhttps?://(?:www\.)?([^\s/]+)\S*")
_SENTENCE_END = ".!?:;,"


def strip_markdown(text: str) -> str:
    """Plain sentences from markdown: no code, headings, list marks, emphasis, links or tables."""
    text = _FENCE.sub(" ", text)
    text = _TABLE_RULE.sub("", text)
    text = _MARKDOWN_LINE.sub("", text)
    text = _LINK.sub(r"\1", text)
    text = _URL.sub(r"\1", text)
    text = _EMPHASIS.sub(lambda m: next(g for g in m.groups()[1:] if g is not None), text)
    text = re.sub(r"[ \t]*\|[ \t]*", ", ", text.replace("`", ""))
    text = re.sub(r"[*#_~]+(?!\d)", " ", text)
    # Emoji and pictographs have no sound.
    text = "".join(c for c in text if unicodedata.category(c) != "So" or c == "°")
    lines = [re.sub(r"\s+,", ",", line).strip(" ,") for line in text.splitlines()]
    lines = [line for line in lines if line]
    if len(lines) > 1:
        # Each line is a sentence of its own: a list item without a full stop still gets its pause.
        lines = [line + ("" if line[-1] in _SENTENCE_END else ".") for line in lines]
    return re.sub(r"\s+", " ", " ".join(lines)).strip()


# --- numbers, units and symbols (English) ----------------------------------------------------

_NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
_MONTH = r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)\.?"  # noqa: E501
_UNITS = {
    "km": ("kilometer", "kilometers"), "m": ("meter", "meters"), "cm": ("centimeter", "centimeters"),
    "mm": ("millimeter", "millimeters"), "kg": ("kilogram", "kilograms"), "g": ("gram", "grams"),
    "mg": ("milligram", "milligrams"), "lb": ("pound", "pounds"), "lbs": ("pound", "pounds"),
    "oz": ("ounce", "ounces"), "mi": ("mile", "miles"), "ft": ("foot", "feet"), "mph": ("mile per hour",
    "miles per hour"), "km/h": ("kilometer per hour", "kilometers per hour"), "kph": ("kilometer per hour",
    "kilometers per hour"), "m/s": ("meter per second", "meters per second"), "ml": ("milliliter",
    "milliliters"), "l": ("liter", "liters"), "h": ("hour", "hours"), "hr": ("hour", "hours"), "hrs": ("hour",
    "hours"), "min": ("minute", "minutes"), "mins": ("minute", "minutes"), "sec": ("second", "seconds"),
    "ms": ("millisecond", "milliseconds"), "kb": ("kilobyte", "kilobytes"), "mb": ("megabyte", "megabytes"),
    "gb": ("gigabyte", "gigabytes"), "tb": ("terabyte", "terabytes"), "kw": ("kilowatt", "kilowatts"),
    "kwh": ("kilowatt hour", "kilowatt hours"), "mhz": ("megahertz", "megahertz"), "ghz": ("gigahertz",
    "gigahertz"), "°c": ("degree Celsius", "degrees Celsius"), "°f": ("degree Fahrenheit",
    "degrees Fahrenheit"), "°": ("degree", "degrees"), "%": ("percent", "percent"),
}  # fmt: skip
_UNIT_PATTERN = "|".join(sorted((re.escape(u) for u in _UNITS), key=len, reverse=True))
_CURRENCIES = {"$": ("dollar", "dollars", "cent", "cents"), "€": ("euro", "euros", "cent", "cents"),
               "£": ("pound", "pounds", "penny", "pence")}  # fmt: skip
_ABBREVIATIONS = {"e.g.": "for example", "i.e.": "that is", "etc.": "et cetera", "vs.": "versus",
                  "approx.": "approximately", "No.": "number"}  # fmt: skip
_FRACTIONS = {(1, 2): "one half", (1, 4): "one quarter", (3, 4): "three quarters"}


def _amount(number: str) -> tuple[str, bool]:
    """A written number in words, and whether it is exactly one."""
    return decimal(number), number.replace(",", "") in ("1", "1.0")


def _currency(m: re.Match[str]) -> str:
    one, many, cent, cents = _CURRENCIES[m["symbol"]]
    whole, _, fraction = m["amount"].replace(",", "").partition(".")
    if m["scale"]:
        return f"{decimal(m['amount'])} {m['scale']} {many}"
    words = f"{cardinal(int(whole))} {one if whole == '1' else many}"
    if fraction and int(fraction[:2].ljust(2, "0")):
        hundredths = int(fraction[:2].ljust(2, "0"))
        words += f" and {cardinal(hundredths)} {cent if hundredths == 1 else cents}"
    return words


def _unit(m: re.Match[str]) -> str:
    words, is_one = _amount(m["amount"])
    one, many = _UNITS[m["unit"].lower()]
    return f"{words} {one if is_one else many}"


def _clock(m: re.Match[str]) -> str:
    hour, minute = int(m["hour"]), int(m["minute"])
    suffix = f" {m['ampm'][0].upper()}M" if m["ampm"] else ""
    if minute == 0:
        spoken = f"{cardinal(hour)} {'hundred' if hour > 12 and not suffix else ''}".rstrip()
        return spoken + (suffix or (" o'clock" if hour <= 12 else ""))
    minutes = f"oh {cardinal(minute)}" if minute < 10 else cardinal(minute)
    return f"{cardinal(hour)} {minutes}{suffix}"


def _month_name(text: str) -> str:
    key = text.rstrip(".")[:3].lower()
    return next(name for name in _MONTHS if name[:3].lower() == key)


def _plural(words: str) -> str:
    return words[:-1] + "ies" if words.endswith("y") else words + "s"


def _iso_date(m: re.Match[str]) -> str:
    month, day = int(m["month"]), int(m["day"])
    if not (1 <= month <= 12 and 1 <= day <= 31):
        return m[0]
    return f"{_MONTHS[month - 1]} {ordinal(day)}, {year(int(m['year']))}"


def _fraction(m: re.Match[str]) -> str:
    top, bottom = int(m["top"]), int(m["bottom"])
    if (top, bottom) in _FRACTIONS:
        return _FRACTIONS[(top, bottom)]
    if 0 < top < bottom <= 10:
        return f"{cardinal(top)} {ordinal(bottom)}{'s' if top > 1 else ''}"
    return f"{cardinal(top)} over {cardinal(bottom)}"


#: (pattern, replacement) in the order they apply: specific shapes before plain numbers.
_RULES: tuple[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]], ...] = (
    (re.compile("|".join(re.escape(a) for a in _ABBREVIATIONS)), lambda m: _ABBREVIATIONS[m[0]]),
    (re.compile(r"\b(?P<year>\d{4})-(?P<month>\d{2})-(?P<day>\d{2})\b"), _iso_date),
    (
        re.compile(
            r"\b(?P<hour>[01]?\d|2[0-3]):(?P<minute>[0-5]\d)(?::[0-5]\d)?(?:\s*(?P<ampm>[ap])(?:\.m\.|m\b))?", re.I
        ),
        _clock,
    ),
    (
        re.compile(r"\b(?P<hour>1[0-2]|0?[1-9])\s*(?P<ampm>[ap])(?:\.m\.|m\b)", re.I),
        lambda m: f"{cardinal(int(m['hour']))} {m['ampm'].upper()}M",
    ),
    (
        re.compile(rf"(?P<month>{_MONTH})\s+(?P<day>\d{{1,2}})(?:st|nd|rd|th)?\b(?!:)"),
        lambda m: f"{_month_name(m['month'])} {ordinal(int(m['day']))}",
    ),
    (
        re.compile(rf"\b(?P<day>\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?(?P<month>{_MONTH})(?!\w)"),
        lambda m: f"the {ordinal(int(m['day']))} of {_month_name(m['month'])}",
    ),
    (
        re.compile(
            r"(?P<before>\b(?:[Ii]n|[Ss]ince|[Ff]rom|until|by|of|year|around|before|after|between|and)\s|"
            rf"{_MONTH}\s|(?:st|nd|rd|th),\s)"
            rf"(?P<year>1[1-9]\d\d|20\d\d)\b(?![.,]?\d)(?!\s*(?:%|°|(?:{_UNIT_PATTERN})\b))"
        ),
        lambda m: m["before"] + year(int(m["year"])),
    ),
    (re.compile(r"\b(?P<decade>1[1-9]\d0|20\d0)'?s\b"), lambda m: _plural(year(int(m["decade"])))),
    (
        re.compile(r"\b(?P<year>1[1-9]\d\d|20\d\d)\s*(?P<era>BC|AD|BCE|CE)\b"),
        lambda m: f"{year(int(m['year']))} {' '.join(m['era'])}",
    ),
    (
        re.compile(rf"(?P<symbol>[$€£])\s?(?P<amount>{_NUMBER})(?:\s(?P<scale>thousand|million|billion|trillion))?"),
        _currency,
    ),
    (re.compile(rf"(?<![\w.])(?P<amount>-?(?:{_NUMBER}))\s?(?P<unit>{_UNIT_PATTERN})(?![\w/])", re.I), _unit),
    (re.compile(r"\b(?P<number>\d+)(?:st|nd|rd|th)\b"), lambda m: ordinal(int(m["number"]))),
    (re.compile(r"(?<![\d/])(?P<top>\d+)/(?P<bottom>\d+)(?![\d/])"), _fraction),
    (
        re.compile(r"\b\d{3}(?:-\d{3})?-\d{4}\b"),
        lambda m: ", ".join(" ".join(_ONES[int(d)] for d in group) for group in m[0].split("-")),
    ),
    (re.compile(r"(?<=\d)\s*(?:–|—|-(?=\d))\s*(?=\d)"), " to "),
    (re.compile(r"(?<=\d)\s+-\s+(?=\d)"), " minus "),
    (re.compile(r"(?<![\w\d.])[-−](?=\d)"), "minus "),
    (re.compile(r"\s*\+\s*"), " plus "),
    (re.compile(r"(?<=\d)\s*[×x*]\s*(?=\d)"), " times "),
    (re.compile(r"\s*÷\s*"), " divided by "),
    (re.compile(r"\s*=\s*"), " equals "),
    (re.compile(r"\s*&\s*"), " and "),
    (re.compile(r"#(?=\d)"), "number "),
    (re.compile(r"~\s*(?=\d)"), "about "),
    (re.compile(r"°"), " degrees"),
    (re.compile(r"%"), " percent"),
    (re.compile(rf"(?<![\w.])(?P<number>{_NUMBER})(?![\w])"), lambda m: decimal(m["number"])),
)


def spell_out(text: str) -> str:
    """Numbers, units, times, dates and symbols of English text in words."""
    for pattern, replacement in _RULES:
        text = pattern.sub(replacement, text)
    return re.sub(r"\s+", " ", text).strip()


def speakable(text: str, language: str = "en") -> str:
    """What a voice of ``language`` should say for ``text`` (an LLM's answer, or a piece of it).

    Args:
        text: the text as written.
        language: the voice's language (ISO 639-1, such as ``en``);
            numbers and symbols are spelled out for English only.

    Returns:
        The text without markdown, and for English with numbers, units,
        times, dates and symbols in words.
    """
    text = strip_markdown(text)
    if language.lower().startswith("en"):
        text = spell_out(text)
    return text
