"""The held-out function-calling set: twenty-five round trips over five other tools, and twelve turns that need none.

It checks whether what was tuned on the first set (:mod:`s2s_rt.evaluation.tool_requests`)
carries over to tools and wordings nobody looked at while tuning. So its
wordings were written, and committed, before any model answered them, and are
not changed after seeing results: a wording that turns out unfair is dropped
in a commit that says so, never reworded.

The tools are described as agent-SDK users describe theirs: short, in
different styles, some parameters explained and some not. The requests are
everyday spoken wordings (commands, questions, needs that never name the
tool; names, numbers and times in words); an argument is checked only where
a request leaves one right value. Of the turns that need no function, five
are about a tool's topic without asking for what it does (a composer beside
``play_music``, a dividend beside ``get_stock_price``).

Graded as the first set is (:class:`~s2s_rt.evaluation.tool_requests.ToolRequest`).
"""

from __future__ import annotations

from typing import Any

from s2s_rt.evaluation.tool_requests import ToolRequest

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "play_music",
        "description": "Play music on the speaker. Pass a song, artist, album, genre or mood.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    },
    {
        "type": "function",
        "name": "send_message",
        "description": "Sends a text message to one of the user's contacts.",
        "parameters": {
            "type": "object",
            "properties": {
                "contact": {"type": "string", "description": "Name of the contact"},
                "text": {"type": "string", "description": "The message to send"},
            },
            "required": ["contact", "text"],
            "additionalProperties": False,
        },
    },
    {
        "type": "function",
        "name": "get_stock_price",
        "description": "get the latest stock price",
        "parameters": {
            "type": "object",
            "properties": {"symbol": {"type": "string", "description": "ticker symbol, e.g. MSFT"}},
            "required": ["symbol"],
        },
    },
    {
        "type": "function",
        "name": "book_table",
        "description": "Book a table at a restaurant for today.",
        "parameters": {
            "type": "object",
            "properties": {
                "restaurant": {"type": "string"},
                "time": {"type": "string", "description": "24h time, HH:MM"},
                "party_size": {"type": "integer", "description": "Number of people"},
            },
            "required": ["restaurant", "time", "party_size"],
            "additionalProperties": False,
        },
    },
    {
        "type": "function",
        "name": "set_thermostat",
        "description": "Set the home thermostat's target temperature (degrees Celsius) and optionally its mode.",
        "parameters": {
            "type": "object",
            "properties": {
                "temperature": {"type": "number"},
                "mode": {"type": "string", "enum": ["heat", "cool", "auto"]},
            },
            "required": ["temperature"],
            "additionalProperties": False,
        },
    },
]

REQUESTS: tuple[ToolRequest, ...] = (
    ToolRequest(
        "Play some Beatles.",
        "play_music",
        {"query": "Beatles"},
        {"playing": "Here Comes the Sun", "artist": "The Beatles"},
        (r"here comes the sun",),
    ),
    ToolRequest(
        "It's too quiet in here, put some music on.",
        "play_music",
        {},
        {"playing": "Lo-fi Beats", "type": "playlist"},
        (r"\blo-? ?fi\b",),
    ),
    ToolRequest(
        "Can you play Bohemian Rhapsody?",
        "play_music",
        {"query": "Bohemian Rhapsody"},
        {"playing": "Bohemian Rhapsody", "artist": "Queen"},
        (r"\bqueen\b", r"\bbohemian rhapsody\b"),
    ),
    ToolRequest(
        "Put on something relaxing while I study.",
        "play_music",
        {},
        {"playing": "Calm Piano", "type": "playlist"},
        (r"\bcalm piano\b", r"\bpiano\b"),
    ),
    ToolRequest(
        "Play the new Taylor Swift album.",
        "play_music",
        {"query": "Taylor Swift"},
        {"playing": "The Tortured Poets Department", "artist": "Taylor Swift"},
        (r"\btortured poets\b",),
    ),
    ToolRequest(
        "Text Anna that I'll be ten minutes late.",
        "send_message",
        {"contact": "Anna", "text": "late"},
        {"sent": True, "to": "Anna"},
        (r"\bsent\b", r"\blet anna know\b", r"\btold anna\b"),
    ),
    ToolRequest(
        "Send a message to Mum saying happy birthday.",
        "send_message",
        {"contact": "Mum", "text": "birthday"},
        {"status": "delivered", "to": "Mum"},
        (r"\bdelivered\b", r"\bsent\b"),
    ),
    ToolRequest(
        "Can you tell David the meeting moved to three o'clock?",
        "send_message",
        {"contact": "David", "text": "meeting"},
        {"sent": True, "to": "David"},
        (r"\bsent\b", r"\blet david know\b", r"\btold david\b"),
    ),
    ToolRequest(
        "Message my boss Karen: I'm working from home today.",
        "send_message",
        {"contact": "Karen", "text": "home"},
        {"sent": True, "to": "Karen"},
        (r"\bsent\b", r"\blet karen know\b", r"\btold karen\b"),
    ),
    ToolRequest(
        "Let Tom know dinner is ready.",
        "send_message",
        {"contact": "Tom", "text": "dinner"},
        {"status": "sent"},
        (r"\bsent\b", r"\blet tom know\b", r"\btold tom\b"),
    ),
    ToolRequest(
        "What's Apple's stock price?",
        "get_stock_price",
        {"symbol": "AAPL"},
        {"symbol": "AAPL", "price": 189.84, "currency": "USD"},
        (r"\bone hundred (and )?eighty-nine\b",),
    ),
    ToolRequest(
        "How are Microsoft shares doing today?",
        "get_stock_price",
        {"symbol": "MSFT"},
        {"symbol": "MSFT", "price": 415.2, "change_percent": -1.3},
        (r"\bfour hundred (and )?fifteen\b", r"\bdown\b", r"\bone point three\b"),
    ),
    ToolRequest(
        "Check the Tesla share price for me.",
        "get_stock_price",
        {"symbol": "TSLA"},
        {"price": 242.5, "currency": "USD"},
        (r"\btwo hundred (and )?forty-two\b",),
    ),
    ToolRequest(
        "Is Nvidia up or down today?",
        "get_stock_price",
        {"symbol": "NVDA"},
        {"symbol": "NVDA", "price": 131.4, "change_percent": 2.6},
        (r"\bone hundred (and )?thirty-one\b", r"\btwo point six\b", r"\bup (by )?(about )?two\b"),
    ),
    ToolRequest(
        "What's Amazon trading at?",
        "get_stock_price",
        {"symbol": "AMZN"},
        {"symbol": "AMZN", "price": 178.25},
        (r"\bone hundred (and )?seventy-eight\b",),
    ),
    ToolRequest(
        "Book a table for four at Luigi's at seven thirty tonight.",
        "book_table",
        {"restaurant": "Luigi", "time": "19:30", "party_size": 4},
        {"confirmed": True, "restaurant": "Luigi's", "time": "19:30", "party_size": 4},
        (r"\bseven thirty\b", r"\bnineteen thirty\b", r"half past seven", r"\bconfirmed\b", r"\bbooked\b"),
    ),
    ToolRequest(
        "Can you get us a table at the Golden Dragon at eight in the evening? There are two of us.",
        "book_table",
        {"restaurant": "Golden Dragon", "time": "20:00", "party_size": 2},
        {"status": "confirmed", "time": "20:00", "table_for": 2},
        (r"\beight\b", r"\b20:00\b", r"\bconfirmed\b", r"\bbooked\b"),
    ),
    ToolRequest(
        "I'd like to reserve a table for six at Nando's for lunch at half past twelve.",
        "book_table",
        {"restaurant": "Nando", "time": "12:30", "party_size": 6},
        {"confirmed": True, "time": "12:30", "party_size": 6},
        (r"\btwelve thirty\b", r"half past twelve", r"\bconfirmed\b", r"\bbooked\b"),
    ),
    ToolRequest(
        "Reserve Chez Marie for three people at a quarter past eight in the evening.",
        "book_table",
        {"restaurant": "Chez Marie", "time": "20:15", "party_size": 3},
        {"confirmed": True, "time": "20:15"},
        (r"\beight fifteen\b", r"\b20:15\b", r"quarter past eight", r"\bconfirmed\b", r"\bbooked\b"),
    ),
    ToolRequest(
        "My parents are visiting, find us a table for five at Bella Vista at seven in the evening.",
        "book_table",
        {"restaurant": "Bella Vista", "time": "19:00", "party_size": 5},
        {"confirmed": False, "reason": "fully booked", "alternative_time": "21:00"},
        (r"\bfully booked\b", r"\bnine\b", r"\b21:00\b"),
    ),
    ToolRequest(
        "Set the heating to twenty-one degrees.",
        "set_thermostat",
        {"temperature": 21},
        {"ok": True, "target_c": 21},
        (r"\btwenty-one\b",),
    ),
    ToolRequest(
        "It's freezing in here, turn the heat up to twenty-three.",
        "set_thermostat",
        {"temperature": 23},
        {"ok": True, "target_c": 23, "current_c": 17},
        (r"\btwenty-three\b",),
    ),
    ToolRequest(
        "Turn on the air conditioning and set it to twenty degrees.",
        "set_thermostat",
        {"temperature": 20, "mode": "cool"},
        {"ok": True, "target_c": 20, "mode": "cool"},
        (r"\btwenty\b", r"\bcool"),
    ),
    ToolRequest(
        "Change the thermostat to eighteen and a half.",
        "set_thermostat",
        {"temperature": 18.5},
        {"ok": True, "target_c": 18.5},
        (r"\beighteen (point five|and a half)\b",),
    ),
    ToolRequest(
        "We're going to bed, drop the temperature to sixteen.",
        "set_thermostat",
        {"temperature": 16},
        {"ok": True, "target_c": 16, "mode": "heat"},
        (r"\bsixteen\b",),
    ),
    ToolRequest("Hi there, how's it going?"),
    ToolRequest("Thank you so much, that was really helpful."),
    ToolRequest("Goodbye, talk to you later."),
    ToolRequest("What's your name?"),
    ToolRequest("I just got back from a walk in the park."),
    ToolRequest("How many minutes are in a day?"),
    ToolRequest("Is a tomato a fruit or a vegetable?"),
    ToolRequest("Who composed The Four Seasons?"),
    ToolRequest("What is a dividend?"),
    ToolRequest("What temperature should a fridge be kept at?"),
    ToolRequest("What's a kind way to say sorry to a friend?"),
    ToolRequest("What is risotto made of?"),
)
