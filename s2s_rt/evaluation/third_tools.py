"""The third function-calling set: twenty-five round trips over five new tools, and twelve turns that need none.

A second check, after the held-out set (:mod:`s2s_rt.evaluation.held_out_tools`),
of whether what was tuned carries over to tools and wordings nobody looked at
while tuning: none of its tools is in the first two sets. Its wordings were
written, and committed, before any model answered them, and are not changed
after seeing results: a wording that turns out unfair is dropped in a commit
that says so, never reworded.

The tools are described as agent-SDK users describe theirs: one in a terse
lowercase line, some with each parameter explained and some not, one with an
enum. The requests are everyday spoken wordings (commands, questions, needs
that never name the tool: "We're out of milk."; names, numbers, dates and
times in words, flight numbers as people say them); an argument is checked
only where a request leaves one right value. A flight is checked by its
number's digits (the airline's code is the model's to know), a date by its
month and day (no request says the year). Of the turns that need no
function, seven are about a tool's topic without asking for what it does
(how long milk keeps beside the shopping list, tipping a taxi driver beside
``call_taxi``).

Graded as the first set is (:class:`~s2s_rt.evaluation.tool_requests.ToolRequest`).
"""

from __future__ import annotations

from typing import Any

from s2s_rt.evaluation.tool_requests import ToolRequest

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "create_event",
        "description": (
            "Create an event in the user's calendar. Use this when the user wants to schedule something"
            " or keep a date and time in mind."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "title": {"type": "string", "description": "Short title of the event"},
                "date": {"type": "string", "description": "Date as YYYY-MM-DD"},
                "time": {"type": "string", "description": "Start time, 24-hour HH:MM"},
                "duration_minutes": {"type": "integer", "description": "Length in minutes (default 60)"},
            },
            "required": ["title", "date", "time"],
            "additionalProperties": False,
        },
    },
    {
        "type": "function",
        "name": "get_flight_status",
        "description": "flight status by flight number",
        "parameters": {
            "type": "object",
            "properties": {"flight_number": {"type": "string"}},
            "required": ["flight_number"],
        },
    },
    {
        "type": "function",
        "name": "add_to_shopping_list",
        "description": "Adds an item to the household's shared shopping list.",
        "parameters": {
            "type": "object",
            "properties": {
                "item": {"type": "string"},
                "quantity": {"type": "integer", "description": "How many (default 1)"},
            },
            "required": ["item"],
        },
    },
    {
        "type": "function",
        "name": "translate_text",
        "description": "Translate text into another language.",
        "parameters": {
            "type": "object",
            "properties": {
                "text": {"type": "string", "description": "The text to translate"},
                "target_language": {"type": "string", "description": "Language to translate into, e.g. German"},
            },
            "required": ["text", "target_language"],
            "additionalProperties": False,
        },
    },
    {
        "type": "function",
        "name": "call_taxi",
        "description": "Order a taxi to pick the user up where they are now.",
        "parameters": {
            "type": "object",
            "properties": {
                "destination": {"type": "string"},
                "pickup_time": {"type": "string", "description": "HH:MM, 24h. Leave out to be picked up now."},
                "vehicle": {"type": "string", "enum": ["standard", "large", "accessible"]},
            },
            "required": ["destination"],
            "additionalProperties": False,
        },
    },
]

REQUESTS: tuple[ToolRequest, ...] = (
    ToolRequest(
        "Put a dentist appointment in my calendar for the third of July at nine thirty in the morning.",
        "create_event",
        {"title": "dentist", "date": "07-03", "time": "09:30"},
        {"created": True, "title": "Dentist appointment", "start": "2025-07-03T09:30"},
        (r"\bnine thirty\b", r"half past nine", r"\b0?9:30\b", r"\bthird of july\b", r"\bjuly (the )?third\b"),
    ),
    ToolRequest(
        "I've got a job interview on the twentieth of June at two in the afternoon, can you note that down?",
        "create_event",
        {"title": "interview", "date": "06-20", "time": "14:00"},
        {"created": True, "event_id": "evt_2207", "start": "2025-06-20T14:00"},
        (r"\btwo\b", r"\b14:00\b", r"\bfourteen hundred\b", r"\btwentieth\b"),
    ),
    ToolRequest(
        "Schedule lunch with Priya on June the twenty-fifth at half past twelve.",
        "create_event",
        {"title": "lunch", "date": "06-25", "time": "12:30"},
        {"created": True, "title": "Lunch with Priya", "start": "2025-06-25T12:30"},
        (r"\btwelve thirty\b", r"half past twelve", r"\b12:30\b", r"\btwenty-fifth\b"),
    ),
    ToolRequest(
        "Block out two hours on the first of August at ten in the morning for the team offsite.",
        "create_event",
        {"date": "08-01", "time": "10:00", "duration_minutes": 120},
        {"created": True, "start": "2025-08-01T10:00", "end": "2025-08-01T12:00"},
        (r"\bten\b", r"\b10:00\b", r"\bnoon\b", r"\btwelve\b", r"\bfirst of august\b", r"\baugust (the )?first\b"),
    ),
    ToolRequest(
        "My sister's wedding is on the sixteenth of August at three in the afternoon, I don't want to forget it.",
        "create_event",
        {"title": "wedding", "date": "08-16", "time": "15:00"},
        {"created": True, "title": "Sister's wedding", "start": "2025-08-16T15:00"},
        (r"\bthree\b", r"\b15:00\b", r"\bfifteen hundred\b", r"\bsixteenth\b"),
    ),
    ToolRequest(
        "Is BA one one seven on time today?",
        "get_flight_status",
        {"flight_number": "117"},
        {"flight": "BA117", "status": "on time", "departs": "14:05", "gate": "B32"},
        (r"\bon time\b", r"\bfourteen oh five\b", r"\btwo oh five\b", r"\b14:05\b", r"\bb ?thirty-two\b", r"\bb32\b"),
    ),
    ToolRequest(
        "When does Lufthansa four hundred land?",
        "get_flight_status",
        {"flight_number": "400"},
        {"flight": "LH400", "status": "in the air", "arrives": "16:20"},
        (r"\bsixteen twenty\b", r"\b16:20\b", r"\bfour twenty\b", r"twenty past four"),
    ),
    ToolRequest(
        "My mum's flying in on easyJet eight one two, has it landed yet?",
        "get_flight_status",
        {"flight_number": "812"},
        {"flight": "EZY812", "status": "landed", "landed_at": "10:48"},
        (r"\byes\b", r"\blanded at\b", r"\bten forty-eight\b", r"\b10:48\b"),
    ),
    ToolRequest(
        "Has Air France thirteen seventy-nine been delayed?",
        "get_flight_status",
        {"flight_number": "1379"},
        {"flight": "AF1379", "status": "delayed", "delay_minutes": 45, "new_departure": "19:15"},
        (r"\bforty-five\b", r"\bnineteen fifteen\b", r"\bseven fifteen\b", r"quarter past seven", r"\b19:15\b"),
    ),
    ToolRequest(
        "Which gate does KLM six oh five leave from?",
        "get_flight_status",
        {"flight_number": "605"},
        {"flight": "KL605", "status": "boarding", "gate": "D7"},
        (r"\bd ?-?7\b", r"\bd seven\b"),
    ),
    ToolRequest(
        "We're out of milk.",
        "add_to_shopping_list",
        {"item": "milk"},
        {"added": "milk", "quantity": 1, "items_on_list": 7},
        (r"\badded\b", r"\bon (the|your) (shopping )?list\b"),
    ),
    ToolRequest(
        "Add three tins of chopped tomatoes to the shopping list.",
        "add_to_shopping_list",
        {"item": "tomato", "quantity": 3},
        {"added": "chopped tomatoes", "quantity": 3},
        (r"\bthree\b",),
    ),
    ToolRequest(
        "Don't let me forget to buy bin bags.",
        "add_to_shopping_list",
        {"item": "bin bag"},
        {"added": "bin bags", "quantity": 1},
        (r"\badded\b", r"\bon (the|your) (shopping )?list\b"),
    ),
    ToolRequest(
        "Can you put six bananas on the list?",
        "add_to_shopping_list",
        {"item": "banana", "quantity": 6},
        {"added": "bananas", "quantity": 6},
        (r"\bsix\b",),
    ),
    ToolRequest(
        "We need two loaves of bread for the weekend.",
        "add_to_shopping_list",
        {"item": "bread", "quantity": 2},
        {"added": "bread", "quantity": 2, "items_on_list": 9},
        (r"\btwo\b", r"\badded\b"),
    ),
    ToolRequest(
        "How do I say 'where is the train station' in Spanish?",
        "translate_text",
        {"text": "train station", "target_language": "Spanish"},
        {"translation": "¿Dónde está la estación de tren?"},
        (r"\bd[oó]nde est[aá]\b", r"\bestaci[oó]n\b"),
    ),
    ToolRequest(
        "Translate 'thank you for your help' into Japanese.",
        "translate_text",
        {"text": "thank you", "target_language": "Japanese"},
        {"translation": "手伝ってくれてありがとう", "romanized": "tetsudatte kurete arigatō"},
        (r"\barigat", r"ありがとう"),
    ),
    ToolRequest(
        "I'm writing to my landlord in Berlin, how would I put 'the heating is broken' in German?",
        "translate_text",
        {"text": "heating", "target_language": "German"},
        {"translation": "Die Heizung ist kaputt."},
        (r"\bheizung\b", r"\bkaputt\b"),
    ),
    ToolRequest(
        "What's the French for 'I'm allergic to peanuts'?",
        "translate_text",
        {"text": "allergic", "target_language": "French"},
        {"translation": "Je suis allergique aux cacahuètes."},
        (r"\ballergique\b", r"\bcacahu[eè]tes\b"),
    ),
    ToolRequest(
        "My neighbour only speaks Italian. Can you help me tell her 'your cat is in my garden'?",
        "translate_text",
        {"text": "cat", "target_language": "Italian"},
        {"translation": "Il tuo gatto è nel mio giardino."},
        (r"\bgatto\b", r"\bgiardino\b"),
    ),
    ToolRequest(
        "Get me a cab to the airport.",
        "call_taxi",
        {"destination": "airport"},
        {"booked": True, "eta_minutes": 6, "driver": "Marek", "car": "grey Toyota Prius"},
        (r"\bsix\b", r"\bmarek\b", r"\bprius\b"),
    ),
    ToolRequest(
        "Order me a taxi to the train station for a quarter to seven this evening.",
        "call_taxi",
        {"destination": "station", "pickup_time": "18:45"},
        {"booked": True, "pickup_time": "18:45", "vehicle": "standard"},
        (r"\beighteen forty-five\b", r"\b18:45\b", r"\bsix forty-five\b", r"quarter to seven"),
    ),
    ToolRequest(
        "There are seven of us with suitcases, we need a big car to the Hilton.",
        "call_taxi",
        {"destination": "Hilton", "vehicle": "large"},
        {"booked": True, "vehicle": "large", "eta_minutes": 12},
        (r"\btwelve\b",),
    ),
    ToolRequest(
        "My grandfather is in a wheelchair, can you call us a taxi to the hospital?",
        "call_taxi",
        {"destination": "hospital", "vehicle": "accessible"},
        {"booked": True, "vehicle": "accessible", "eta_minutes": 15},
        (r"\bfifteen\b", r"\bquarter of an hour\b"),
    ),
    ToolRequest(
        "I've missed the last bus and need a ride home.",
        "call_taxi",
        {"destination": "home"},
        {"booked": True, "eta_minutes": 9, "fare_estimate": 18.5, "currency": "GBP"},
        (r"\bnine\b", r"\beighteen\b"),
    ),
    ToolRequest("Hey, good evening!"),
    ToolRequest("Cheers, that's perfect."),
    ToolRequest("Who painted the Mona Lisa?"),
    ToolRequest("What's the tallest mountain in Africa?"),
    ToolRequest("What's a good way to fall asleep faster?"),
    ToolRequest("Why does February only have twenty-eight days?"),
    ToolRequest("In what year was the Gregorian calendar introduced?"),
    ToolRequest("Why do my ears pop when a plane takes off?"),
    ToolRequest("Roughly how long is a flight from London to New York?"),
    ToolRequest("How long does milk keep once it's opened?"),
    ToolRequest("Which language has the most native speakers?"),
    ToolRequest("How much should I tip a taxi driver in New York?"),
)
