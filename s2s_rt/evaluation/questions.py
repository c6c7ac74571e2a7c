"""The questions the evaluation asks, and what a right answer must say.

Each question is asked typed and spoken. Its text is written as a person
would say it (numbers in words), so the same text is typed and synthesised.
A right answer matches every pattern of ``must`` and none of ``must_not``
(regular expressions, case-insensitive, on the answer's text with numbers
also spelled as words: "8" and "eight" both match ``\\beight\\b``).

The questions of kind ``time`` are answered against :data:`EVALUATION_NOW`,
the moment the evaluation pretends it is, and only they may say it
(:data:`TOLD_NOW`); ``unknowable`` ones ask what no model can know, and a
right answer says so instead of guessing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

#: The moment the evaluation pretends it is: a Thursday afternoon.
EVALUATION_NOW = datetime(2025, 6, 12, 15, 40)

#: :data:`EVALUATION_NOW` as an answer would say it: a right answer to a question that is not about time never
#: does (a model told the date repeats it: "Einstein … died on June 12, 2025, at 3:40 PM").
TOLD_NOW = r"\bjune\b|\bthursday\b|\b2025\b|\b3:40\b|\bfifteen forty\b|\bthree forty\b"

#: "I cannot know that" in the words small models use.
NOT_KNOWN = (
    r"(can(no|')t|unable|not able|don't|do not|doesn't|no) (access|know|have|provide|check|predict|tell|"
    r"real-time|current|live|information|way)|not sure|no idea|i'm sorry|unfortunately|not possible|"
    r"check (a|the|your|an|local|online)"
)

KINDS = ("fact", "arithmetic", "units", "time", "advice", "small talk", "instruction", "unknowable")


@dataclass(frozen=True, slots=True)
class Question:
    """One question and how to grade its answer."""

    text: str
    kind: str
    #: Patterns a right answer matches, every one.
    must: tuple[str, ...]
    #: Patterns a right answer never matches.
    must_not: tuple[str, ...] = ()


QUESTIONS: tuple[Question, ...] = (
    # Facts
    Question("What is the capital of Australia?", "fact", (r"canberra",)),
    Question("How many legs does a spider have?", "fact", (r"\beight\b",), (r"\b(four|six|ten)\b",)),
    Question("Who wrote Pride and Prejudice?", "fact", (r"austen",)),
    Question("What is the largest planet in our solar system?", "fact", (r"jupiter",)),
    Question("Which planet is closest to the Sun?", "fact", (r"mercury",), (r"\bmars\b|\bvenus\b",)),
    Question("At what temperature does water boil, in degrees Celsius?", "fact", (r"\bone hundred\b",)),
    Question("Who painted the Mona Lisa?", "fact", (r"leonardo|da vinci",)),
    Question("How many continents are there?", "fact", (r"\bseven\b",)),
    Question("What is the tallest mountain in the world?", "fact", (r"everest",)),
    Question("In which country are the pyramids of Giza?", "fact", (r"egypt",)),
    Question("What language do people speak in Brazil?", "fact", (r"portuguese",)),
    Question("Who was the first person to walk on the Moon?", "fact", (r"armstrong",)),
    Question("How old was Albert Einstein when he died?", "fact", (r"\bseventy-six\b",)),
    Question("What is the capital of Japan?", "fact", (r"tokyo",)),
    Question("What gas do plants take in from the air?", "fact", (r"carbon dioxide|\bco2\b|c o two",)),
    Question("How many days are there in a leap year?", "fact", (r"\bthree hundred (and )?sixty-six\b",)),
    # Arithmetic
    Question("What is seven times eight?", "arithmetic", (r"\bfifty-six\b",)),
    Question("What is fifteen plus twenty-seven?", "arithmetic", (r"\bforty-two\b",)),
    Question("What is the square root of one hundred forty-four?", "arithmetic", (r"\btwelve\b",)),
    Question("What is one hundred divided by four?", "arithmetic", (r"\btwenty-five\b",)),
    Question("What is ten percent of two hundred?", "arithmetic", (r"\btwenty\b",)),
    Question("What is half of ninety?", "arithmetic", (r"\bforty-five\b",)),
    Question("What is twelve minus five?", "arithmetic", (r"\bseven\b",)),
    # Units
    Question("How many minutes are there in three and a half hours?", "units", (r"\btwo hundred (and )?ten\b",)),
    Question(
        "Convert one hundred degrees Fahrenheit to Celsius.",
        "units",
        (r"\bthirty-(seven|eight)\b",),
    ),
    Question("How many centimeters are there in a meter?", "units", (r"\bone hundred\b",)),
    Question("How many grams are in a kilogram?", "units", (r"\bone thousand\b",)),
    Question("How many seconds are there in an hour?", "units", (r"\bthree thousand,? six hundred\b",)),
    Question("How many feet are in a mile?", "units", (r"\bfive thousand,? two hundred (and )?eighty\b",)),
    # Time (against EVALUATION_NOW)
    Question("What day of the week is it today?", "time", (r"thursday",)),
    Question("What is today's date?", "time", (r"june", r"\btwelfth\b|\btwelve\b")),
    Question("What time is it?", "time", (r"\bthree forty\b|\bfifteen forty\b|\btwenty to four\b",)),
    Question("What month comes after March?", "time", (r"april",), (r"after april",)),
    Question("How many hours are there in a day?", "time", (r"\btwenty-four\b",)),
    # Advice
    Question(
        "How can I fall asleep faster?",
        "advice",
        (r"screen|caffeine|routine|dark|relax|breath|schedule|bedtime|meditat|cool|quiet|phone",),
    ),
    Question("What should I do if I burn my finger?", "advice", (r"cool|cold",), (r"\bice\b|butter",)),
    Question("How do I keep bread fresh for longer?", "advice", (r"bag|container|freez|airtight|wrap|box|cool",)),
    Question(
        "How often should I water a cactus?",
        "advice",
        (r"week|month|rarely|dry|sparingly|infrequent|every|little",),
    ),
    Question("What is a healthy breakfast?", "advice", (r"oat|fruit|egg|yogh?urt|whole|grain|berr|banana|toast",)),
    # Small talk
    Question("Hello, how are you today?", "small talk", (r"good|fine|well|great|hello|hi\b|doing|thank",)),
    Question("Thank you, that was helpful.", "small talk", (r"welcome|glad|happy|pleasure|anytime",)),
    Question("Good morning!", "small talk", (r"morning|hello|\bhi\b|hey|help",)),
    # Instructions
    Question("Set a timer for twenty minutes.", "instruction", (r"\btwenty\b|can(no|')t|unable|not able",)),
    Question("Spell the word cat.", "instruction", (r"\bc\b\W*\ba\b\W*\bt\b",)),
    Question("Count from one to five.", "instruction", (r"one\W+two\W+three\W+four\W+(and\W+)?five",)),
    Question("Name the three primary colors.", "instruction", (r"\bred\b", r"\bblue\b", r"yellow")),
    Question(
        "Give me a word that rhymes with cat.",
        "instruction",
        (r"\b(hat|bat|mat|rat|sat|fat|pat|chat|flat|that|vat|gnat|splat|spat|brat)\b",),
    ),
    Question("Translate thank you into Spanish.", "instruction", (r"gracias",)),
    Question("What is the opposite of hot?", "instruction", (r"\bcold\b",)),
    # Unknowable: a right answer does not guess
    Question("What will the weather be like tomorrow?", "unknowable", (NOT_KNOWN,)),
    Question("Who won last night's football game?", "unknowable", (NOT_KNOWN,)),
    Question("What is my name?", "unknowable", (NOT_KNOWN,)),
)
